"""The development inspector (ProfilingMiddleware(..., ui_path=...)).

Two parts:

* the access gate, routing and ring, by calling the middleware directly
  with WSGI environs (REMOTE_ADDR=10.1.2.3 and friends);
* the pages in a real headless browser: Debian's chromium driven by
  Selenium through /usr/bin/chromedriver (never selenium-manager), against
  ``python -m greqprof serve --ui`` (gevent.pywsgi) in a subprocess.

With GREQPROF_SCREENSHOTS=1 the browser tests also save
docs/inspector-list.png and docs/inspector-profile.png."""
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import requests

from greqprof import ConfigError, ProfilingMiddleware
from greqprof.renderers import as_view

from test_renderers import HOSTILE, synthetic_profile

pytestmark = pytest.mark.timeout(60)

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
DOCS = Path(__file__).resolve().parent.parent / "docs"
UI = "/_greqprof"


# ---------------------------------------------------------------------------
# WSGI-level helpers

def app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"the app"]


def make(**kw):
    kw.setdefault("pct", 0.0)
    kw.setdefault("blocking_ms", None)   # no hooks in this thread
    kw.setdefault("report", False)
    kw.setdefault("ui_path", UI)
    return ProfilingMiddleware(app, **kw)


class Resp:
    def __init__(self, status, headers, body):
        self.status = status
        self.code = int(status.split()[0])
        self.headers = dict(headers)
        self.body = body
        self.text = body.decode("utf-8", "replace")


def call(mw, path, addr="127.0.0.1", host="127.0.0.1:8000", method="GET",
         query="", headers=None, body=b""):
    environ = {
        "REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": query,
        "SCRIPT_NAME": "", "REMOTE_ADDR": addr, "SERVER_NAME": "x",
        "SERVER_PORT": "8000", "wsgi.input": io.BytesIO(body),
        "CONTENT_LENGTH": str(len(body)), "wsgi.url_scheme": "http"}
    if host is not None:
        environ["HTTP_HOST"] = host
    for k, v in (headers or {}).items():
        environ["HTTP_" + k.upper().replace("-", "_")] = v
    got = {}

    def start_response(status, hdrs, exc_info=None):
        got["status"], got["headers"] = status, hdrs

    out = mw(environ, start_response)
    data = b"".join(out)
    if hasattr(out, "close"):
        out.close()
    return Resp(got["status"], got["headers"], data)


# ---------------------------------------------------------------------------
# the gate

def test_off_by_default():
    mw = make(ui_path=None)
    assert mw.inspector is None
    assert call(mw, UI + "/").body == b"the app"


def test_inspector_requests_are_not_app_requests():
    mw = make()
    assert call(mw, UI + "/").code == 200
    assert call(mw, UI).code == 200
    assert call(mw, "/_greqprofx").body == b"the app"
    assert call(mw, "/other").body == b"the app"
    assert mw.stats["requests"] == 2


@pytest.mark.parametrize("addr", ["127.0.0.1", "127.3.2.1", "::1",
                                  "::ffff:127.0.0.1"])
def test_loopback_allowed(addr):
    assert call(make(), UI + "/", addr=addr).code == 200


@pytest.mark.parametrize("addr", ["10.1.2.3", "192.168.1.9", "::ffff:10.0.0.1",
                                  "2001:db8::1", "", "garbage"])
def test_non_loopback_refused(addr):
    r = call(make(), UI + "/", addr=addr)
    assert r.code == 403 and b"forbidden" in r.body
    r = call(make(), UI + "/clear", addr=addr, method="POST")
    assert r.code == 403


@pytest.mark.parametrize("host,code", [
    ("127.0.0.1:8000", 200), ("localhost:8000", 200), ("[::1]:8000", 200),
    ("localhost", 200), (None, 200),
    ("evil.example:8000", 403), ("evil.example", 403), ("10.1.2.3", 403)])
def test_host_header_defeats_dns_rebinding(host, code):
    assert call(make(), UI + "/", host=host).code == code


def test_ui_allow():
    mw = make(ui_allow=["10.0.0.0/8", "192.168.1.9"], ui_hosts=["dev"])
    assert call(mw, UI + "/", addr="10.1.2.3", host="dev:8000").code == 200
    # the Host check stays on (DNS rebinding): only loopback and ui_hosts
    assert call(mw, UI + "/", addr="10.1.2.3", host="evil.example").code \
        == 403
    assert call(mw, UI + "/", addr="192.168.1.9").code == 200
    assert call(mw, UI + "/", addr="192.168.1.10").code == 403
    assert call(mw, UI + "/", addr="::ffff:10.9.9.9").code == 200
    assert call(mw, UI + "/", addr="127.0.0.1").code == 403  # replaced


def test_ui_token():
    tok = "s3cret-token-value"
    mw = make(ui_token=tok, ui_hosts=["dev.example"])
    assert call(mw, UI + "/").code == 403
    assert call(mw, UI + "/", query="token=wrong").code == 403
    assert call(mw, UI + "/", headers={"X-Greqprof-Token": tok[:-1]}).code \
        == 403
    r = call(mw, UI + "/", query="token=" + tok, addr="10.1.2.3",
             host="dev.example")
    assert r.code == 200
    assert call(mw, UI + "/", query="token=" + tok, addr="10.1.2.3",
                host="evil.example").code == 403
    assert call(mw, UI + "/", headers={"X-Greqprof-Token": tok},
                addr="10.1.2.3").code == 200
    # links keep the token for browser use
    mw._deliver(synthetic_profile())
    r = call(mw, UI + "/", query="token=" + tok)
    assert 'href="/_greqprof/p/1?token=s3cret-token-value"' in r.text
    both = make(ui_token=tok, ui_allow=["10.0.0.0/8"])
    assert call(both, UI + "/", addr="10.1.2.3", query="token=" + tok).code \
        == 200
    assert call(both, UI + "/", addr="11.1.2.3", query="token=" + tok).code \
        == 403
    assert tok not in repr(mw) and tok not in repr(mw.inspector)


@pytest.mark.parametrize("kw,option", [
    ({"ui_path": "nope"}, "ui_path"), ({"ui_path": "/"}, "ui_path"),
    ({"ui_keep": 0}, "ui_keep"), ({"ui_keep": True}, "ui_keep"),
    ({"ui_token": "short"}, "ui_token"),
    ({"ui_allow": ["not-an-ip"]}, "ui_allow"),
    ({"ui_path": None, "ui_token": "long-enough"}, "ui_token need ui_path"),
    ({"ui_path": None, "ui_hosts": ["dev"]}, "ui_hosts and ui_token need"),
    ({"formats": ["json"]}, "formats needs profile_dir"),
])
def test_config_errors(kw, option):
    with pytest.raises(ConfigError, match=option):
        make(**kw)


# ---------------------------------------------------------------------------
# routes and the ring

def test_ring_is_bounded_newest_first():
    mw = make(ui_keep=3)
    for i in range(5):
        mw._deliver(synthetic_profile(path="/n%d" % i))
    ids = [i for i, _ in mw.inspector.profiles()]
    assert ids == [5, 4, 3]
    r = call(mw, UI + "/")
    assert r.text.count('class="gq-profile-row') == 3
    assert r.text.index("/n4") < r.text.index("/n3") < r.text.index("/n2")
    assert "/n1" not in r.text
    assert call(mw, UI + "/p/1").code == 404
    assert call(mw, UI + "/p/5").code == 200


def test_pages_headers_and_exports():
    mw = make()
    mw._deliver(synthetic_profile())
    mw._deliver(synthetic_profile(path="/nocalls", calls=False))
    r = call(mw, UI + "/p/1")
    assert r.code == 200 and r.headers["Content-Type"].startswith("text/html")
    csp = r.headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
    assert r.headers["Referrer-Policy"] == "no-referrer"
    assert r.headers["Cache-Control"] == "no-store"
    assert r.headers["X-Content-Type-Options"] == "nosniff"
    j = call(mw, UI + "/p/1.json")
    assert json.loads(j.body) == json.loads(synthetic_profile().to_json())
    assert "Content-Disposition" not in j.headers
    for fmt in ("trace", "speedscope", "pstats", "callgrind", "html", "text"):
        e = call(mw, UI + "/p/1/" + fmt)
        assert e.code == 200 and e.body, fmt
        assert "attachment" in e.headers["Content-Disposition"]
    assert call(mw, UI + "/p/2/pstats").code == 404
    assert "calls=True" in call(mw, UI + "/p/2/pstats").text
    assert "/p/2/pstats" not in call(mw, UI + "/p/2").text  # no dead link
    assert call(mw, UI + "/p/1/bogus").code == 404
    assert call(mw, UI + "/p/99").code == 404
    assert call(mw, UI + "/nowhere").code == 404
    assert call(mw, UI + "/p/1", method="POST").code == 405
    assert call(mw, UI + "/", method="DELETE").code == 405


def test_list_escapes_everything():
    mw = make()
    p = synthetic_profile(path="/" + HOSTILE)
    p.method = "<b>M</b>"
    p.status = '200 <img src=x onerror="alert(1)">'
    p.error = "<i>err</i>"
    mw._deliver(p)
    page = call(mw, UI + "/").text
    assert "<script>window" not in page and "<img" not in page
    assert "<b>M" not in page and "<i>err" not in page
    assert "&lt;script&gt;window.__gq_pwned=1&lt;/script&gt;" in page
    assert "<script" not in page  # the list page has no script at all


def test_clear_needs_post_and_the_form_key():
    mw = make()
    mw._deliver(synthetic_profile())
    assert call(mw, UI + "/clear").code == 405
    assert call(mw, UI + "/clear", method="POST").code == 403
    assert call(mw, UI + "/clear", method="POST", body=b"key=forged").code \
        == 403
    assert len(mw.inspector.profiles()) == 1
    key = re.search(r'name="key" value="([^"]+)"',
                    call(mw, UI + "/").text).group(1)
    r = call(mw, UI + "/clear", method="POST",
             body=("key=" + key).encode())
    assert r.code == 303 and r.headers["Location"] == UI + "/"
    assert mw.inspector.profiles() == []


def test_profile_dir_through_the_middleware(tmp_path):
    mw = make(ui_path=None, profile_dir=str(tmp_path / "p"),
              formats=["json", "trace"], calls=True)
    mw._deliver(synthetic_profile(path="/a"))
    mw._deliver(synthetic_profile(path="/a"))
    files = sorted(os.listdir(str(tmp_path / "p")))
    assert len(files) == 4 and len(set(files)) == 4
    assert sum(f.endswith(".trace.json") for f in files) == 2

    def boom(profile):
        raise OSError("disk full")
    mw._outputs.writer.write = boom
    mw._deliver(synthetic_profile())  # contained, counted
    assert mw.stats["errors"] == 1 and mw.stats["delivered"] == 3


# ---------------------------------------------------------------------------
# a real server and a real browser

SERVED_APP = textwrap.dedent('''
    import time
    import gevent

    def burn(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def parse_row(i):
        return sum(range(200 * (i + 1)))

    def fetch(n):
        for i in range(n):
            burn(0.003)
            parse_row(i)
            gevent.sleep(0.004)    # waits like I/O: other greenlets run

    def render_page():
        burn(0.004)

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/block":
            time.sleep(0.08)       # not monkey-patched: holds the loop
        else:
            gevent.joinall([gevent.spawn(fetch, k) for k in (1, 2, 3)])
            render_page()
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]
''')

TARGETS = ["/api/orders", "/block",
           quote("/" + "<script>window.__gq_pwned=1</script>", safe="/")]
HOSTILE_PATH = "/<script>window.__gq_pwned=1</script>"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    (d / "inspector_demo_app.py").write_text(SERVED_APP)
    err = open(str(d / "stderr.txt"), "wb")  # never a full pipe
    proc = subprocess.Popen(
        [sys.executable, "-m", "greqprof", "serve", "inspector_demo_app:app",
         "--port", "0", "--ui", "--calls", "--pct", "1.0",
         "--blocking-ms", "30", "--quiet"],
        cwd=str(d), stdout=subprocess.PIPE, stderr=err)
    try:
        line = proc.stdout.readline().decode()
        m = re.search(r"on (http://\S+)", line)
        assert m, (line, (d / "stderr.txt").read_text()[:4000])
        url = m.group(1)
        for t in TARGETS:
            assert requests.get(url + t, timeout=10).status_code == 200
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            page = requests.get(url + UI + "/", timeout=10).text
            if page.count('class="gq-profile-row') == len(TARGETS):
                break
            time.sleep(0.05)
        else:
            raise AssertionError("profiles did not reach the inspector")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        err.close()


@pytest.fixture(scope="module")
def browser():
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("needs Debian's chromium and chromium-driver "
                    "(%s, %s)" % (CHROMIUM, CHROMEDRIVER))
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu",
              "--disable-dev-shm-usage", "--window-size=1280,900",
              "--disable-extensions", "--no-first-run",
              "--disable-background-networking"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: Selenium Manager is never run.
    drv = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER),
                           options=opts)
    drv.set_page_load_timeout(20)
    try:
        yield drv
    finally:
        drv.quit()


def css(drv, selector):
    from selenium.webdriver.common.by import By
    return drv.find_elements(By.CSS_SELECTOR, selector)


def console_errors(drv):
    return [e for e in drv.get_log("browser") if e["level"] == "SEVERE"]


def profile_ids(drv, server):
    """{path: id} from the list page's rows."""
    drv.get(server + UI + "/")
    out = {}
    for row in css(drv, "tr.gq-profile-row"):
        link = row.find_element("css selector", "td.gq-path a")
        out[link.text] = int(row.get_attribute("data-id"))
    return out


def screenshot(drv, name):
    if os.environ.get("GREQPROF_SCREENSHOTS") != "1":
        return
    height = drv.execute_script("return document.documentElement"
                                ".scrollHeight")
    drv.set_window_size(1280, min(max(height + 20, 400), 1500))
    DOCS.mkdir(exist_ok=True)
    # the <main> content plus header, without the empty window below it
    drv.find_element("tag name", "body").screenshot(str(DOCS / name))
    drv.set_window_size(1280, 900)


def test_browser_list_page(browser, server):
    ids = profile_ids(browser, server)
    assert not console_errors(browser)
    assert set(ids) == {"/api/orders", "/block", HOSTILE_PATH}
    rows = css(browser, "tr.gq-profile-row")
    assert [int(r.get_attribute("data-id")) for r in rows] == \
        sorted(ids.values(), reverse=True)  # newest first
    cells = {r.find_element("css selector", "td.gq-path a").text:
             [c.text for c in r.find_elements("css selector", "td")]
             for r in rows}
    # #, time, method, path, status, wall, CPU, spans, greenlets, blocked
    for path, pid in ids.items():
        v = _expected(server, pid)
        r = v.request
        row = cells[path]
        assert row[0] == str(pid)
        assert row[2:5] == ["GET", path, "200 OK"]
        assert row[5] == "%.1f ms" % (r.wall * 1000)
        assert row[6] == "%.1f ms" % (r.cpu * 1000)
        assert row[7:10] == [str(len(r.spans) + r.dropped_spans),
                             str(len(r.greenlets)), str(len(r.blocking))]
    assert int(cells["/api/orders"][8]) >= 4   # the request + 3 fetchers
    assert int(cells["/block"][9]) >= 1
    # the hostile path is text, and its script never ran
    assert browser.execute_script("return typeof window.__gq_pwned") == \
        "undefined"
    screenshot(browser, "inspector-list.png")


def _expected(server, pid):
    from greqprof import RequestProfile
    d = requests.get("%s%s/p/%d.json" % (server, UI, pid), timeout=10).json()
    return as_view(RequestProfile.from_dict(d))


@pytest.mark.parametrize("path", ["/api/orders", "/block"])
def test_browser_profile_timeline(browser, server, path):
    from selenium.webdriver.common.action_chains import ActionChains
    pid = profile_ids(browser, server)[path]
    v = _expected(server, pid)
    browser.get("%s%s/p/%d" % (server, UI, pid))
    assert not console_errors(browser), console_errors(browser)
    assert css(browser, "h1")[0].text == "GET " + path
    assert len(css(browser, ".gq-row-request")) == 1
    rows = css(browser, ".gq-row-greenlet")
    assert len(rows) == len(v.greenlet_rows())
    assert [int(r.get_attribute("data-gid")) for r in rows] == \
        [g.id for g in v.greenlet_rows()]
    bars = css(browser, ".gq-span")
    assert len(bars) == len(v.spans)
    per_row = {r.get_attribute("data-gid"):
               len(r.find_elements("css selector", ".gq-span"))
               for r in rows}
    for g in v.greenlet_rows():
        assert per_row[str(g.id)] == sum(1 for s in v.spans
                                         if s.greenlet_id == g.id)
    blocking = css(browser, ".gq-span.gq-blocking")
    assert len(blocking) == sum(v.is_blocking(s) for s in v.spans)
    assert len(css(browser, ".gq-wait")) == len(v.waiting_intervals())
    # every bar is on its greenlet's row, placed on the shared time axis
    geo = browser.execute_script(
        "var c = document.querySelector('.gq-canvas').getBoundingClientRect();"
        "return [c.left, c.width, Array.from(document.querySelectorAll("
        "'.gq-span')).map(function (b) { var r = b.getBoundingClientRect();"
        "return [+b.dataset.i, +b.parentNode.dataset.gid, r.left, r.width];"
        "})];")
    left, width, placed = geo
    scale = width / (v.horizon - v.origin)
    by_start = sorted(v.spans, key=lambda s: s.start)
    for i, gid, x, w in placed:
        s = by_start[i]
        assert gid == s.greenlet_id
        assert abs(x - (left + (s.start - v.origin) * scale)) <= 1.5
        assert abs(w - max(s.wall * scale, 1)) <= 1.5
    # function table
    fn_rows = css(browser, "table.gq-functions tbody tr.gq-fn-row")
    assert len(fn_rows) == len(v.calls)
    # hover shows a summary, click shows details and the stack
    target = blocking[0] if blocking else max(
        bars, key=lambda b: b.rect["width"])
    ActionChains(browser).move_to_element(target).perform()
    tip = css(browser, ".gq-tip")[0]
    assert tip.is_displayed() and "ran" in tip.text
    target.click()
    details = css(browser, ".gq-details")[0].text
    assert "greenlet" in details and "CPU" in details
    if path == "/block":
        assert blocking, "the blocking span is highlighted"
        assert details.startswith("Blocking span")
        # its stack where it switched out, then the blocking event with
        # what the watchdog saw running (the app's time.sleep line)
        assert "File " in css(browser, ".gq-details pre.gq-stack")[0].text
        events = css(browser, ".gq-blocking-event")
        assert len(events) == len(v.request.blocking) >= 1
        sampled = v.request.blocking[0].sampled_stack
        if sampled:
            assert "inspector_demo_app.py" in events[0].text
    else:
        screenshot(browser, "inspector-profile.png")


def test_browser_function_table_sorts(browser, server):
    pid = profile_ids(browser, server)["/api/orders"]
    browser.get("%s%s/p/%d" % (server, UI, pid))

    def column(i):
        return browser.execute_script(
            "var i = arguments[0]; return Array.from(document"
            ".querySelectorAll('table.gq-functions tr.gq-fn-row'))"
            ".map(function (r) { return r.cells[i].textContent; });", i)

    def header(key):
        return css(browser, 'table.gq-functions th[data-key="%s"]' % key)[0]

    assert header("ttot").get_attribute("aria-sort") == "descending"
    header("ncall").click()
    calls = [int(c.split("/")[0]) for c in column(1)]
    assert calls == sorted(calls, reverse=True)
    assert header("ncall").get_attribute("aria-sort") == "descending"
    header("ncall").click()
    calls = [int(c.split("/")[0]) for c in column(1)]
    assert calls == sorted(calls)
    header("fn").click()
    names = [c.lower() for c in column(0)]
    assert names == sorted(names)
    # filtering and the callee sub-rows
    box = css(browser, "input.gq-filter")[0]
    box.send_keys("fetch")
    assert column(0) == ["inspector_demo_app.fetch"]
    css(browser, "table.gq-functions tr.gq-fn-row")[0].click()
    sub = css(browser, "table.gq-functions tr.gq-callees")[0].text
    assert "burn" in sub and "parse_row" in sub


def test_browser_hostile_path_is_text(browser, server):
    pid = profile_ids(browser, server)[HOSTILE_PATH]
    browser.get("%s%s/p/%d" % (server, UI, pid))
    assert css(browser, "h1")[0].text == "GET " + HOSTILE_PATH
    assert browser.title == "greqprof: GET " + HOSTILE_PATH
    assert css(browser, ".gq-label-request .gq-fn")[0].get_attribute(
        "textContent") == "GET " + HOSTILE_PATH
    assert browser.execute_script("return typeof window.__gq_pwned") == \
        "undefined"
    assert not console_errors(browser)


def test_browser_clear(browser, server):
    # last browser test: empties the module's server
    browser.get(server + UI + "/")
    from selenium.webdriver.support.ui import WebDriverWait
    css(browser, "button.gq-clear")[0].click()
    WebDriverWait(browser, 10).until(lambda d: css(d, ".gq-empty"))
    assert browser.current_url.rstrip("/").endswith(UI)
    assert not css(browser, "tr.gq-profile-row")
