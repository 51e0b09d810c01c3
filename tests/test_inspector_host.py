"""The inspector's Host check (issue 15, item 3): a strict Host parser, on
in every mode (``ui_allow`` and ``ui_token`` too, which used to switch it
off and let a DNS-rebound page read every profile), with ``ui_hosts`` as
the explicit allow-list of names for non-loopback use.  Through a real
gevent.pywsgi server, with raw sockets so any Host header can be sent."""
import pytest

from greqprof import ConfigError, ProfilingMiddleware
from greqprof.inspector import parse_host

from test_middleware import http_raw, parse_response, serve  # noqa: F401

pytestmark = pytest.mark.timeout(60)

UI = "/_greqprof"
TOKEN = "s3cret-token-value"


@pytest.mark.parametrize("value,parsed", [
    ("localhost", ("localhost", None)),
    ("LocalHost.:8000", ("localhost", 8000)),
    ("127.0.0.1:80", ("127.0.0.1", 80)),
    ("[::1]", ("::1", None)),
    ("[0:0::1]:65535", ("::1", 65535)),
    ("dev.example.com", ("dev.example.com", None)),
    ("my_service:8080", ("my_service", 8080)),
    ("10.1.2.3", ("10.1.2.3", None)),
])
def test_parse_host_accepts(value, parsed):
    assert parse_host(value) == parsed


@pytest.mark.parametrize("value", [
    "localhost:80@evil.com", "[::1]evil.com", "localhost:evil",
    "user@localhost", "user:pw@localhost:80", "a..b", ".localhost",
    "localhost..", "", ":80", "localhost:", "localhost:99999",
    "localhost:123456", "localhost:80:80", "::1", "[::1", "[::1]:",
    "[::1]:x", "[fe80::1%25eth0]", "[127.0.0.1]", "127.1", "0x7f.0.0.1",
    "127.0.0.01", "256.0.0.1", "1.2.3.4.5", "local host", " localhost",
    "localhost\t", "loc\u0430lhost", "-bad.example", "bad-.example",
    "a" * 64 + ".example", "evil.com/x", "evil.com#", "evil.com?",
    "localhost\\@evil", "[::1]:80@evil.com", "localhost\x00",
    "\u0661\u0662\u0667.0.0.1",
])
def test_parse_host_rejects(value):
    assert parse_host(value) is None


def get(port, host, target=UI + "/", extra=b""):
    head = b"GET " + target.encode() + b" HTTP/1.1\r\n"
    if host is not None:
        head += b"Host: " + host.encode("latin-1") + b"\r\n"
    raw = http_raw(port, head + extra + b"Connection: close\r\n\r\n")
    return parse_response(raw).status


def app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"app"]


BAD_HOSTS = ["localhost:80@evil.com", "[::1]evil.com", "localhost:evil",
             "user@localhost", "a..b", "evil.example", "evil.example:80",
             "localhost.evil.example", "127.1", "10.1.2.3", ""]


@pytest.mark.parametrize("mode", ["loopback", "ui_allow", "ui_token",
                                  "ui_allow+ui_token"])
def test_host_check_in_every_mode(serve, mode):
    kw = {}
    extra = b""
    if "ui_allow" in mode:
        kw["ui_allow"] = ["127.0.0.0/8", "10.0.0.0/8"]
    if "ui_token" in mode:
        kw["ui_token"] = TOKEN
        extra = b"X-Greqprof-Token: " + TOKEN.encode() + b"\r\n"
    s = serve(app, pct=0.0, blocking_ms=None, ui_path=UI,
              ui_hosts=["dev.example", "192.0.2.7"], **kw)
    port = s.port
    for host in ["localhost", "localhost:%d" % port, "127.0.0.1:%d" % port,
                 "[::1]:%d" % port, "LOCALHOST.", "dev.example",
                 "Dev.Example:%d" % port, "192.0.2.7:%d" % port]:
        assert get(port, host, extra=extra) == 200, (mode, host)
    for host in BAD_HOSTS:
        assert get(port, host, extra=extra) == 403, (mode, host)
        # nor can such a page POST the clear action
        raw = http_raw(port, b"POST " + UI.encode() + b"/clear HTTP/1.1\r\n"
                       b"Host: " + host.encode() + b"\r\n" + extra +
                       b"Content-Length: 0\r\nConnection: close\r\n\r\n")
        assert parse_response(raw).status == 403, (mode, host)
    # the app itself is not concerned
    assert get(port, "evil.example", target="/x") == 200


def test_without_ui_hosts_only_loopback_names(serve):
    """ui_allow used to switch the Host check off: a page of any name
    rebound to this address could read the profiles."""
    s = serve(app, pct=0.0, blocking_ms=None, ui_path=UI,
              ui_allow=["127.0.0.0/8"])
    assert get(s.port, "attacker.example") == 403
    assert get(s.port, "localhost:%d" % s.port) == 200


@pytest.mark.parametrize("hosts", [["localhost:80"], ["http://dev"],
                                   ["a..b"], [""], [42], ["dev/"],
                                   ["user@dev"]])
def test_ui_hosts_entries_are_checked(hosts):
    with pytest.raises(ConfigError, match="ui_hosts"):
        ProfilingMiddleware(app, ui_path=UI, ui_hosts=hosts, environ={})


def test_list_survives_a_profile_with_raw_text(serve):
    """A profile delivered with bytes and a lone surrogate in its fields
    (built by hand, or by a capture that missed them) does not turn the
    list page into a 500 (before: TypeError / UnicodeEncodeError until 50
    newer profiles pushed it out)."""
    from dataclasses import replace
    from test_renderers import synthetic_profile
    s = serve(app, pct=0.0, blocking_ms=None, ui_path=UI)
    s.mw.inspector.add(replace(synthetic_profile(), status=b"200 OK",
                               path="/x\udcff", error="E\ud800"))
    raw = http_raw(s.port, b"GET " + UI.encode() + b"/ HTTP/1.1\r\n"
                   b"Host: localhost\r\nConnection: close\r\n\r\n")
    r = parse_response(raw)
    assert r.status == 200
    assert b"/x\\udcff" in r.body and b"200 OK" in r.body


def test_fixed_loopback_names(serve):
    """Names that are loopback by definition get in without ui_hosts:
    ``*.localhost`` (RFC 6761: browsers resolve every name under it to
    loopback themselves, so no page elsewhere can carry it) and Debian's
    fixed names for ::1.  The list is fixed, never read from /etc/hosts
    or DNS: a name that merely resolves to loopback may be rebound."""
    s = serve(app, pct=0.0, blocking_ms=None, ui_path=UI)
    port = s.port
    for host in ["app.localhost:%d" % port, "a.b.localhost", "APP.LOCALHOST.",
                 "ip6-loopback:%d" % port, "ip6-localhost", "IP6-Loopback.",
                 "[::ffff:127.0.0.1]:%d" % port]:
        assert get(port, host) == 200, host
    for host in ["localhost.evil.example", "evil-localhost", "xlocalhost",
                 "ip6-loopback.evil.example", "ip6-loopback6",
                 "localhost6", "localhost.localdomain", "app.localhost.evil"]:
        assert get(port, host) == 403, host


def test_ui_hosts_take_ipv6_addresses_with_or_without_brackets(serve):
    """docs/viewing.md says ui_hosts takes names or IP addresses: a bare
    IPv6 address used to be refused (only "[fd00::5]" passed)."""
    s = serve(app, pct=0.0, blocking_ms=None, ui_path=UI,
              ui_hosts=["fd00::5", "[fd00::6]", "2001:DB8:0:0::1",
                        "dev.example"])
    assert s.mw.inspector.hosts == {"fd00::5", "fd00::6", "2001:db8::1",
                                    "dev.example"}
    for host in ["[fd00::5]:%d" % s.port, "[fd00::6]", "[2001:db8::1]:80",
                 "[fd00:0::5]"]:
        assert get(s.port, host) == 200, host
    for host in ["fd00::5", "[fd00::7]", "[fd00::5]:x"]:
        assert get(s.port, host) == 403, host


@pytest.mark.parametrize("hosts", [["fe80::1%eth0"], ["[fe80::1%25eth0]"],
                                   ["fd00::5::6"], ["[fd00::5]:80"]])
def test_ui_hosts_ipv6_entries_are_checked(hosts):
    # a zone id names no host a browser would send; a port is not a host
    with pytest.raises(ConfigError, match="ui_hosts"):
        ProfilingMiddleware(app, ui_path=UI, ui_hosts=hosts, environ={})
