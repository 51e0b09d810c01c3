"""The development inspector: a small WSGI sub-app that ProfilingMiddleware
serves under ``ui_path`` (off unless configured).

Routes (below ``ui_path``, GET unless noted)::

    /                 list of the last ``ui_keep`` profiles, newest first
    /p/<id>           profile page: timeline + function table
    /p/<id>.json      the profile's JSON (``view`` reads it back)
    /p/<id>/<format>  download in another format (trace, speedscope, ...)
    POST /clear       forgets the kept profiles (the only state change)

Access: in every mode the Host header, parsed strictly (``parse_host``),
must name loopback or one of ``ui_hosts``, which defeats DNS rebinding.
Then, by default, only loopback clients (REMOTE_ADDR in 127.0.0.0/8 or
::1); ``ui_allow`` (addresses or networks) replaces the loopback rule;
``ui_token`` requires ``?token=`` or an ``X-Greqprof-Token`` header
(compared in constant time) and, without ``ui_allow``, lets any address in.
Everyone else gets 403 (docs/viewing.md has the table).  Pages carry a strict Content-Security-Policy and
``Referrer-Policy: no-referrer``; POST /clear also needs the per-process
form key of the list page (no cross-site request can clear)."""
import collections
import datetime
import hmac
import html
import ipaddress
import itertools
import re
import secrets
import threading
import zlib
from urllib.parse import parse_qs, quote, urlencode

from . import _registry, config
from ._text import clean
from .errors import ConfigError
from .routes import RECENT_S
from .renderers import RENDERERS, RenderError, get_renderer
from .renderers.html import HtmlRenderer, asset, content_security_policy

_ID = re.compile(r"^/p/(\d{1,18})(?:(\.json)|/([a-z]{1,20}))?$")
#: Host names that are loopback by definition, fixed (never looked up:
#: a name that merely resolves to loopback today can be rebound): localhost
#: and, below, every *.localhost name (RFC 6761; browsers resolve them to
#: loopback themselves), and Debian's /etc/hosts names for ::1.
_LOOPBACK_HOSTS = ("localhost", "ip6-localhost", "ip6-loopback")
MAX_BODY = 4096


def _ip(addr):
    """The address as an ipaddress object (IPv4-mapped IPv6 addresses, as a
    dual-stack server reports IPv4 clients, become IPv4), or None."""
    try:
        ip = ipaddress.ip_address(str(addr).split("%", 1)[0])
    except ValueError:
        return None
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _is_loopback(addr):
    ip = _ip(addr)
    return ip is not None and ip.is_loopback


_PORT = re.compile(r"[0-9]{1,5}\Z", re.ASCII)
_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)\Z", re.ASCII)
_IPV4 = re.compile(r"(?:(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}"
                   r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\Z",
                   re.ASCII)


def parse_host(value):
    """``(name, port)`` of an HTTP Host header value, strictly: ``host`` or
    ``host:port`` where host is a DNS name (labels of letters, digits,
    ``-`` and ``_``; no empty label), a dotted-quad IPv4 address or a
    bracketed IPv6 address, and port is 1 to 5 digits (at most 65535).
    ``name`` is lower-case, without a trailing dot (IPv6 without
    brackets, compressed); port is an int or None.  None for anything else:
    userinfo (``a@b``), ``localhost:80@evil.com``, ``[::1]evil.com``,
    ``localhost:evil``, spaces, ``a..b``, numeric names that are not a
    dotted quad (``127.1``)."""
    if not isinstance(value, str) or not value or len(value) > 300 or \
            not value.isascii():
        return None
    port = None
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        rest = value[end + 1:]
        if rest:
            if not rest.startswith(":") or not _PORT.match(rest[1:]):
                return None
            port = int(rest[1:])
        if "%" in value[1:end]:
            return None   # a zone id names no host a browser would ask for
        try:
            name = str(ipaddress.IPv6Address(value[1:end]))
        except ValueError:
            return None
    else:
        name, sep, p = value.partition(":")
        if sep:
            if not _PORT.match(p):
                return None
            port = int(p)
        name = name.lower()
        if name.endswith("."):
            name = name[:-1]
        labels = name.split(".")
        if len(name) > 253 or not all(_LABEL.match(x) for x in labels):
            return None
        if labels[-1].isdigit() and not _IPV4.match(name):
            return None
    if port is not None and port > 65535:
        return None
    return name, port


def _host_is_loopback(name):
    """True when a parsed Host name is this machine's loopback."""
    return name in _LOOPBACK_HOSTS or name.endswith(".localhost") or \
        _is_loopback(name)


def _hosts(hosts):
    """ui_hosts as a set of parsed names (ConfigError for an entry that
    is not a host name or IP address; IPv6 with or without brackets)."""
    if isinstance(hosts, str):
        hosts = [hosts]
    names = set()
    for h in hosts:
        parsed = None
        if isinstance(h, str):
            h6 = h.strip()
            if ":" in h6 and not h6.startswith("["):
                h6 = "[%s]" % h6   # (a bare IPv6 address; else refused)
            parsed = parse_host(h6)
        if parsed is None or parsed[1] is not None:
            raise ConfigError("ui_hosts: %s is not a host name or IP address "
                              "(no port, no scheme)" % clean(repr(h), 100))
        names.add(parsed[0])
    return frozenset(names)


def _networks(allow):
    if isinstance(allow, str):
        allow = [allow]
    nets = []
    try:
        for a in allow:
            nets.append(ipaddress.ip_network(str(a).strip(), strict=False))
    except (TypeError, ValueError) as e:
        raise ConfigError("ui_allow must be a list of IP addresses or "
                          "networks: %s" % e) from None
    if not nets:
        raise ConfigError("ui_allow must list at least one address or "
                          "network (an empty list lets nobody in)")
    return nets


def _ms(seconds):
    return "-" if seconds is None else "%.1f ms" % (seconds * 1000.0)


def _when(ts):
    try:
        return datetime.datetime.fromtimestamp(ts).strftime("%H:%M:%S.%f")[:-3]
    except (OverflowError, OSError, ValueError, TypeError):
        return "-"


class Inspector:
    """The inspector sub-app and its bounded ring of RequestProfiles."""

    def __init__(self, ui_path="/_greqprof", ui_allow=None, ui_token=None,
                 ui_keep=50, ui_hosts=None):
        config.check("ui_path", ui_path)
        if ui_path is None or ui_path.rstrip("/") == "":
            raise ConfigError("ui_path must be a path like '/_greqprof', got "
                              "%r" % (ui_path,))
        config.check("ui_keep", ui_keep)
        config.check("ui_token", ui_token)
        ui_hosts = config.check("ui_hosts", ui_hosts)   # (a list now)
        self.path = ui_path.rstrip("/")
        self.allow = _networks(ui_allow) if ui_allow is not None else None
        #: Host names (beyond loopback ones) the pages may be reached by
        self.hosts = _hosts(ui_hosts) if ui_hosts is not None else frozenset()
        self._token = ui_token.encode("utf-8") if ui_token else None
        self.keep = ui_keep
        self._ring = collections.deque(maxlen=ui_keep)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._form_key = secrets.token_urlsafe(24)
        self._html = HtmlRenderer()
        #: the middleware's RouteAggregates (the Routes page), or None
        self.routes = None
        #: the middleware's stack_hz: the Routes page links the stack
        #: samples of each route (0: off)
        self.stack_hz = 0

    def __repr__(self):
        return "<Inspector %s keep=%d>" % (self.path, self.keep)

    @property
    def token_required(self):
        """True when every request must carry ``ui_token``."""
        return self._token is not None

    # -- the ring ---------------------------------------------------------
    def add(self, profile):
        with self._lock:
            self._ring.append((next(self._ids), profile))

    def profiles(self):
        """[(id, RequestProfile)], newest first."""
        with self._lock:
            return list(reversed(self._ring))

    def get(self, pid):
        with self._lock:
            for i, p in self._ring:
                if i == pid:
                    return p
        return None

    def clear(self):
        with self._lock:
            self._ring.clear()

    # -- routing ----------------------------------------------------------
    def matches(self, environ):
        p = environ.get("PATH_INFO", "")
        return p == self.path or p.startswith(self.path + "/")

    def host_allowed(self, environ):
        """The Host check, in every mode: no Host (HTTP/1.0: nothing to
        rebind), or a strictly valid one naming loopback or one of
        ``ui_hosts``.  A page of another site that a DNS name was rebound
        for carries that name, so it never gets in (DNS rebinding)."""
        host = environ.get("HTTP_HOST")
        if host is None:
            return True
        parsed = parse_host(host)
        if parsed is None:
            return False
        return _host_is_loopback(parsed[0]) or parsed[0] in self.hosts

    def allowed(self, environ):
        """The access rule (see the module doc)."""
        if not self.host_allowed(environ):
            return False
        addr = environ.get("REMOTE_ADDR", "")
        if self.allow is not None:
            ip = _ip(addr)
            if ip is None or not any(ip in n for n in self.allow):
                return False
        elif self._token is None:
            if not _is_loopback(addr):
                return False
        if self._token is not None:
            given = environ.get("HTTP_X_GREQPROF_TOKEN")
            if given is None:
                given = (parse_qs(environ.get("QUERY_STRING", ""))
                         .get("token", [None])[0])
            if given is None or not hmac.compare_digest(
                    given.encode("utf-8", "replace"), self._token):
                return False
        return True

    def __call__(self, environ, start_response):
        # (not the app's work, should a middleware around this one profile
        # the request)
        _registry.own_work()
        if not self.allowed(environ):
            return self._plain(start_response, "403 Forbidden",
                               "greqprof inspector: forbidden\n")
        sub = environ.get("PATH_INFO", "")[len(self.path):] or "/"
        method = environ.get("REQUEST_METHOD", "GET")
        if sub == "/clear":
            if method != "POST":
                return self._plain(start_response, "405 Method Not Allowed",
                                   "POST only\n", [("Allow", "POST")])
            return self._clear(environ, start_response)
        if method not in ("GET", "HEAD"):
            return self._plain(start_response, "405 Method Not Allowed",
                               "GET only\n", [("Allow", "GET, HEAD")])
        if sub == "/":
            return self._list(environ, start_response)
        if sub == "/routes" and self.routes is not None:
            return self._routes_page(environ, start_response)
        if sub in ("/routes/pprof", "/routes/speedscope") and \
                self.routes is not None:
            return self._stacks(environ, start_response,
                                sub.rsplit("/", 1)[1])
        if sub == "/routes/flame" and self.routes is not None:
            return self._flame_page(environ, start_response)
        m = _ID.match(sub)
        if m:
            profile = self.get(int(m.group(1)))
            if profile is None:
                return self._plain(start_response, "404 Not Found",
                                   "no such profile (only the last %d are "
                                   "kept)\n" % self.keep)
            if m.group(2):
                return self._export(start_response, profile, "json",
                                    int(m.group(1)), inline=True)
            if m.group(3):
                if m.group(3) not in RENDERERS:
                    return self._plain(start_response, "404 Not Found",
                                       "unknown format\n")
                return self._export(start_response, profile, m.group(3),
                                    int(m.group(1)))
            return self._profile_page(environ, start_response, profile,
                                      int(m.group(1)))
        return self._plain(start_response, "404 Not Found", "not found\n")

    # -- responses --------------------------------------------------------
    @staticmethod
    def _headers(ctype, extra=()):
        return [("Content-Type", ctype), ("Cache-Control", "no-store"),
                ("X-Content-Type-Options", "nosniff"),
                ("Referrer-Policy", "no-referrer"),
                ("X-Frame-Options", "DENY")] + list(extra)

    def _plain(self, start_response, status, text, extra=()):
        body = text.encode("utf-8")
        start_response(status, self._headers(
            "text/plain; charset=utf-8",
            [("Content-Length", str(len(body)))] + list(extra)))
        return [body]

    def _html_response(self, start_response, text, csp):
        body = text.encode("utf-8")
        start_response("200 OK", self._headers(
            "text/html; charset=utf-8",
            [("Content-Length", str(len(body))),
             ("Content-Security-Policy", csp + "; frame-ancestors 'none'")]))
        return [body]

    def _url(self, environ, sub):
        """Absolute path of an inspector URL, keeping ?token= when the
        client authenticated that way."""
        url = quote(environ.get("SCRIPT_NAME", "") + self.path + sub)
        qs = parse_qs(environ.get("QUERY_STRING", ""))
        if self._token is not None and "token" in qs:
            url += "?" + urlencode({"token": qs["token"][0]})
        return url

    def _query_url(self, environ, sub, **query):
        url = self._url(environ, sub)
        return url + ("&" if "?" in url else "?") + urlencode(query)

    def _routes_page(self, environ, start_response):
        """Every route of the middleware since it started, sorted by
        ?sort= (cpu: estimated total CPU, p99, waiting: estimated total
        waiting, blocking: seconds blocked, requests)."""
        def esc(text, quote=True):
            return html.escape(clean(text), quote)
        qs = parse_qs(environ.get("QUERY_STRING", ""))
        sort = qs.get("sort", ["cpu"])[0]
        # ?window=recent: about the last 5 minutes (routes.RECENT_S)
        recent = qs.get("window", [None])[0] == "recent"
        win = {"window": "recent"} if recent else {}
        keys = {
            "cpu": lambda r: r["cpu_total"] or 0.0,
            "p99": lambda r: r["wall_p99"] or 0.0,
            "waiting": lambda r: (r["waiting"] or 0.0) * r["requests"],
            "blocking": lambda r: (r["blocked"], r["blocking"]),
            "requests": lambda r: r["requests"]}
        if sort not in keys:
            sort = "cpu"
        records = sorted(self.routes.to_records(
            "recent" if recent else None), key=keys[sort],
                         reverse=True)

        def stack_links(route):
            # (the route's flame graph and pprof from the stack samples)
            if not self.stack_hz:
                return ""
            kw = {} if route is None else {"route": route}
            return ('<a href="%s">flame graph</a> <a href="%s">speedscope'
                    '</a> <a href="%s">pprof</a>' % (
                        esc(self._query_url(environ, "/routes/flame", **kw)),
                        esc(self._query_url(environ, "/routes/speedscope",
                                            **kw)),
                        esc(self._query_url(environ, "/routes/pprof",
                                            **kw))))
        rows = []
        for r in records:
            waiting_total = (r["waiting"] * r["requests"]
                             if r["waiting"] is not None else None)
            rows.append(
                '<tr class="gq-route-row"><td class="gq-path">'
                '<a href="%s">%s</a></td>%s%s</tr>' % (
                    esc(self._query_url(environ, "/", route=r["route"])),
                    esc(r["route"]), '<td class="gq-stacks">%s</td>'
                    % stack_links(r["route"]) if self.stack_hz else "",
                    "".join(
                        '<td class="gq-num">%s</td>' % v for v in (
                            r["requests"], r["errors"], r["sampled"],
                            _ms(r["wall_p50"]), _ms(r["wall_p99"]),
                            _ms(r["cpu"]), _ms(r["cpu_total"]),
                            _ms(r["waiting"]), _ms(waiting_total),
                            r["blocking"], _ms(r["blocked"])))))
        heads = [("route", None)] + (
            [("stack samples", None)] if self.stack_hz else []) + [
                 ("requests", "requests"),
                 ("errors", None), ("sampled", None), ("p50", None),
                 ("p99", "p99"), ("CPU/req", None), ("total CPU", "cpu"),
                 ("waiting/req", None), ("total waiting", "waiting"),
                 ("blocking", "blocking"), ("blocked", None)]
        head = "".join(
            '<th%s>%s</th>' % (
                "" if name in ("route", "stack samples")
                else ' class="gq-num"',
                '<a href="%s">%s%s</a>' % (
                    esc(self._query_url(environ, "/routes", sort=key,
                                        **win)),
                    name, " \u25bc" if key == sort else "")
                if key else name)
            for i, (name, key) in enumerate(heads))
        table = ('<table class="gq-table gq-routes"><thead><tr>%s</tr>'
                 '</thead><tbody>%s</tbody></table>' % (head, "".join(rows))
                 if rows else '<p class="gq-note gq-empty">No requests '
                 'yet.</p>')
        return self._page(
            start_response, "greqprof routes",
            'every request of this process %s, by route; CPU and waiting '
            'are estimated from the sampled requests'
            % ("in about the last %d minutes" % (RECENT_S // 60)
               if recent else "since it started"),
            '<h1>Routes (%d)</h1><div class="gq-list-actions"><a href="%s">'
            '\u2190 profiles</a> <a href="%s">%s</a>%s</div>%s' % (
                len(rows), esc(self._url(environ, "/")),
                esc(self._query_url(environ, "/routes", sort=sort,
                                    **({} if recent else
                                       {"window": "recent"}))),
                "since start" if recent else
                "last %d minutes" % (RECENT_S // 60),
                (' <span class="gq-note">stack samples of every route:'
                 '</span> '
                 + stack_links(None) if self.stack_hz else ""), table))

    def _stacks(self, environ, start_response, fmt):
        """The stack samples (stack_hz) of ?route= (every route without
        it) as a gzipped pprof profile or a speedscope document."""
        if not self.stack_hz:
            return self._plain(start_response, "404 Not Found",
                               "stack sampling is off (stack_hz)\n")
        from . import sampler
        route = parse_qs(environ.get("QUERY_STRING", "")).get(
            "route", [None])[0]
        period = sampler.period_ns() or sampler.period_of(self.stack_hz)
        if fmt == "pprof":
            data = sampler.pprof_bytes(period, route)[0]
            ctype, name = "application/octet-stream", "greqprof-stacks.pb.gz"
        else:
            import json
            data = json.dumps(sampler.speedscope(period, route),
                              separators=(",", ":")).encode("utf-8")
            ctype = "application/json"
            name = "greqprof-stacks.speedscope.json"
        start_response("200 OK", self._headers(ctype, [
            ("Content-Length", str(len(data))),
            ("Content-Disposition", 'attachment; filename="%s"' % name)]))
        return [data]

    def _flame_page(self, environ, start_response):
        """A flame graph (an SVG drawn here, no script) of the stack
        samples of ?route= (every route without it), with links to the
        same samples as pprof and speedscope."""
        if not self.stack_hz:
            return self._plain(start_response, "404 Not Found",
                               "stack sampling is off (stack_hz)\n")
        from . import sampler

        def esc(text, quote=True):
            return html.escape(clean(text), quote)
        route = parse_qs(environ.get("QUERY_STRING", "")).get(
            "route", [None])[0]
        root = sampler.flame(route)
        width, row = 1200.0, 18
        rects, depth = [], [0]
        total = root[2] or 1

        def draw(node, x, level):
            w = node[2] / total * width
            depth[0] = max(depth[0], level + 1)
            hue = zlib.crc32(node[0].encode("utf-8", "replace")) % 55
            label = node[0] if w >= 40 else ""
            if len(label) * 7 > w - 6:
                label = label[:max(int((w - 6) / 7) - 2, 0)] + ".."
            rects.append(
                '<g><title>%s%s: %d samples (%.1f %%)</title>'
                '<rect x="%.2f" y="%d" width="%.2f" height="%d" '
                'fill="hsl(%d,85%%,62%%)" stroke="#fff" stroke-width="0.5"/>'
                '<text x="%.2f" y="%d" font-size="12">%s</text></g>' % (
                    esc(node[0]), esc(" (%s)" % node[1]) if node[1] else "",
                    node[2], 100.0 * node[2] / total, x, level * row,
                    max(w, 0.1), row, hue, x + 3, level * row + 13,
                    esc(label)))
            for c in sorted(node[3].values(), key=lambda c: c[0]):
                draw(c, x, level + 1)
                x += c[2] / total * width
        draw(root, 0.0, 0)
        kw = {} if route is None else {"route": route}
        svg = ('<svg class="gq-flame" xmlns="http://www.w3.org/2000/svg" '
               'viewBox="0 0 %d %d" width="100%%" font-family="monospace">'
               '%s</svg>' % (width, depth[0] * row, "".join(rects))
               if root[2] else '<p class="gq-note gq-empty">No stack '
               'samples of this route yet.</p>')
        return self._page(
            start_response, "greqprof flame graph",
            "stack samples (stack_hz) of this process since it started: "
            "where the route's requests ran Python, by function; hover a "
            "frame for its share",
            '<h1>Flame graph: %s (%d samples)</h1>'
            '<div class="gq-list-actions"><a href="%s">\u2190 routes</a> '
            '<a href="%s">speedscope</a> <a href="%s">pprof</a></div>%s' % (
                esc(route if route is not None else "every route"),
                root[2], esc(self._url(environ, "/routes")),
                esc(self._query_url(environ, "/routes/speedscope", **kw)),
                esc(self._query_url(environ, "/routes/pprof", **kw)), svg))

    def _page(self, start_response, title, subtitle, main):
        """A page of the Routes views: the list's stylesheet, its header
        (subtitle: plain text), main (HTML)."""
        css = asset("timeline.css")
        page = (
            '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            '<meta name="referrer" content="no-referrer">'
            '<meta name="viewport" content="width=device-width, '
            'initial-scale=1"><title>%s</title><style>%s</style></head>'
            '<body><header class="gq-top"><span class="gq-brand">greqprof'
            '</span><span>%s</span></header><main>%s</main></body></html>'
            % (html.escape(title), css, html.escape(subtitle), main))
        return self._html_response(start_response, page,
                                   content_security_policy(styles=[css]))

    def _list(self, environ, start_response):
        def esc(text, quote=True):
            # (clean first: a profile a sink or test built by hand may
            # hold bytes or unpaired surrogates; one bad row must not
            # take the list down)
            return html.escape(clean(text), quote)
        rows = []
        route = parse_qs(environ.get("QUERY_STRING", "")).get(
            "route", [None])[0]
        for i, p in self.profiles():
            if route is not None and getattr(p, "route", None) != route:
                continue
            link = self._url(environ, "/p/%d" % i)
            blocked = len(p.blocking)
            rows.append(
                '<tr class="gq-profile-row%s" data-id="%d">'
                '<td class="gq-num">%d</td><td>%s</td><td>%s</td>'
                '<td class="gq-path"><a href="%s">%s</a></td><td>%s</td>'
                '<td class="gq-num">%s</td><td class="gq-num">%s</td>'
                '<td class="gq-num">%d</td><td class="gq-num">%d</td>'
                '<td class="gq-num">%s</td><td>%s</td></tr>' % (
                    " gq-blocked" if blocked else "", i, i,
                    esc(_when(p.start)), esc(p.method),
                    esc(link, quote=True), esc(p.path), esc(p.status or "-"),
                    _ms(p.wall), _ms(p.cpu), len(p.spans) + p.dropped_spans,
                    len(p.greenlets),
                    ('<span class="gq-yes">%d</span>' % blocked
                     if blocked else "0"),
                    esc(p.error or "")))
        if not rows:
            table = ('<p class="gq-note gq-empty">No profiles yet. Requests '
                     'the middleware samples (pct, or the trigger header) '
                     'appear here; the last %d are kept.</p>' % self.keep)
        else:
            table = (
                '<table class="gq-table gq-profiles"><thead><tr>'
                '<th class="gq-num">#</th><th>time</th><th>method</th>'
                '<th>path</th><th>status</th><th class="gq-num">wall</th>'
                '<th class="gq-num">CPU</th><th class="gq-num">spans</th>'
                '<th class="gq-num">greenlets</th>'
                '<th class="gq-num">blocked</th><th>error</th></tr></thead>'
                '<tbody>%s</tbody></table>' % "".join(rows))
        css = asset("timeline.css")
        csp = content_security_policy(styles=[css])
        page = (
            '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            '<meta name="referrer" content="no-referrer">'
            '<meta name="viewport" content="width=device-width, '
            'initial-scale=1"><title>greqprof inspector</title>'
            '<style>%s</style></head><body>'
            '<header class="gq-top"><span class="gq-brand">greqprof</span>'
            '<span>development inspector: the last %d sampled requests of '
            'this process, newest first</span></header><main>'
            '<h1>Profiles (%d)</h1>'
            '<div class="gq-list-actions"><a href="%s">Refresh</a>%s'
            '<form method="post" action="%s">'
            '<input type="hidden" name="key" value="%s">'
            '<button type="submit" class="gq-clear">Clear</button></form>'
            '</div>%s</main></body></html>' % (
                css, self.keep, len(rows),
                esc(self._url(environ, "/"), quote=True),
                (' <a href="%s">Routes</a>' % esc(self._url(
                    environ, "/routes")) if self.routes is not None
                 else "") + (' <span class="gq-note">route: %s</span>'
                             % esc(route) if route is not None else ""),
                esc(self._url(environ, "/clear"), quote=True),
                esc(self._form_key, quote=True), table))
        return self._html_response(start_response, page, csp)

    def _profile_page(self, environ, start_response, profile, pid):
        nav = [("\u2190 all profiles", self._url(environ, "/")),
               ("download:", None)]
        nav.append(("json", self._url(environ, "/p/%d.json" % pid)))
        for name in ("trace", "speedscope", "offcpu", "pstats", "callgrind",
                     "pprof", "html", "text"):
            r = RENDERERS.get(name)
            if r is None or (r.needs_calls and not profile.calls):
                continue
            nav.append((name, self._url(environ, "/p/%d/%s" % (pid, name))))
        text, csp = self._html.page(profile, nav=nav)
        return self._html_response(start_response, text, csp)

    def _export(self, start_response, profile, fmt, pid, inline=False):
        r = get_renderer(fmt)
        try:
            data = r.render(profile)
        except RenderError as e:
            return self._plain(start_response, "404 Not Found",
                               "%s\n" % e)
        if isinstance(data, str):
            data = data.encode("utf-8")
        ctype = {"json": "application/json", "trace": "application/json",
                 "speedscope": "application/json",
                 "offcpu": "application/json",
                 "html": "text/html; charset=utf-8",
                 "text": "text/plain; charset=utf-8"}.get(
                     fmt, "application/octet-stream")
        extra = [("Content-Length", str(len(data)))]
        if not inline:
            extra.append(("Content-Disposition", 'attachment; filename="%s"'
                          % r.filename("greqprof-%d" % pid)))
        if fmt == "html":
            # Served as a download; still sandboxed if a browser shows it.
            extra.append(("Content-Security-Policy", "sandbox"))
        start_response("200 OK", self._headers(ctype, extra))
        return [data]

    def _clear(self, environ, start_response):
        try:
            length = min(int(environ.get("CONTENT_LENGTH") or 0), MAX_BODY)
        except ValueError:
            length = 0
        body = environ["wsgi.input"].read(length) if length > 0 else b""
        key = parse_qs(body.decode("latin-1")).get("key", [""])[0]
        if not hmac.compare_digest(key.encode("latin-1", "replace"),
                                   self._form_key.encode("ascii")):
            return self._plain(start_response, "403 Forbidden",
                               "greqprof inspector: missing or wrong form "
                               "key\n")
        self.clear()
        start_response("303 See Other", self._headers(
            "text/plain; charset=utf-8",
            [("Location", self._url(environ, "/")),
             ("Content-Length", "0")]))
        return [b""]


class ProfileOutputs:
    """What ProfilingMiddleware does with each finished profile besides
    logging it: write it to ``profile_dir`` and keep it for the inspector.

    ``ui`` is the :class:`Inspector` (None when ``ui_path`` is not set),
    ``writer`` the :class:`~greqprof.renderers.files.ProfileWriter` (None
    without ``profile_dir``)."""

    def __init__(self, calls, profile_dir=None, formats=None, ui_path=None,
                 ui_allow=None, ui_token=None, ui_keep=50, ui_hosts=None):
        self.writer = None
        self.ui = None
        if formats is not None and profile_dir is None:
            raise ConfigError("formats needs profile_dir")
        if ui_path is None and (ui_allow is not None or
                                ui_token is not None or
                                ui_hosts is not None):
            raise ConfigError("ui_allow, ui_hosts and ui_token need ui_path")
        if profile_dir is not None:
            from .renderers.files import ProfileWriter
            self.writer = ProfileWriter(profile_dir, formats or ("json",),
                                        calls=calls)
        if ui_path is not None:
            self.ui = Inspector(ui_path, ui_allow=ui_allow, ui_token=ui_token,
                                ui_keep=ui_keep, ui_hosts=ui_hosts)

    @classmethod
    def create(cls, calls, **options):
        """None when no option asks for anything (the default)."""
        if all(options.get(k) is None for k in
               ("profile_dir", "formats", "ui_path", "ui_allow", "ui_token",
                "ui_hosts")):
            return None
        return cls(calls, **options)

    def deliver(self, profile, on_error):
        """Keeps and writes ``profile``; failures go to ``on_error(where,
        exc)`` and never reach the app."""
        if self.ui is not None:
            try:
                self.ui.add(profile)
            except Exception as e:
                on_error("inspector", e)
        if self.writer is not None:
            try:
                self.writer.write(profile)
            except Exception as e:
                on_error("profile_dir", e)
