"""Command line: serve a WSGI app with the profiler, or render a saved
profile.

    python -m greqprof serve MODULE:APP [--host 127.0.0.1] [--port 8000]
        [--pct 1.0] [--calls] [--blocking-ms 100] [--ui]
        [--profile-dir DIR] [--formats json,trace] [--patch] [--quiet]
    python -m greqprof view PROFILE.json [--format text] [-o FILE]

Exit status 2 with a message on stderr for a usage or input error."""
import argparse
import importlib
import logging
import os
import re
import sys

UI_PATH = "/_greqprof"
#: middleware option -> the serve flag that sets it (errors name the flag)
FLAGS = {"pct": "--pct", "calls": "--calls", "blocking_ms": "--blocking-ms",
         "profile_dir": "--profile-dir", "formats": "--formats"}
#: seconds requests in flight get to end on SIGTERM/SIGINT
STOP_GRACE_S = 5.0
#: seconds the profiles still waiting may take to be delivered then
FLUSH_S = 5.0


class CliError(Exception):
    """A problem with the command line or its inputs (exit status 2)."""


def _formats():
    from .renderers import RENDERERS
    return sorted(RENDERERS)


def load_app(spec):
    """The WSGI callable named by ``MODULE[:ATTR]`` (ATTR may be dotted;
    default ``application``, then ``app``)."""
    module_name, _, attr = spec.partition(":")
    if not module_name:
        raise CliError("expected MODULE:APP, got %r" % spec)
    if module_name.endswith(".py") or os.sep in module_name:
        # (a file path: say what to type instead)
        mod = os.path.splitext(os.path.basename(module_name))[0]
        raise CliError(
            "expected MODULE:APP, got the file %r: run it from the file's "
            "directory as `python -m greqprof serve %s:%s` (or put that "
            "directory on PYTHONPATH)" % (spec, mod, attr or "app"))
    if module_name.startswith("."):
        raise CliError("expected MODULE:APP with an absolute module name "
                       "(no leading dot), got %r" % spec)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except (ImportError, SyntaxError) as e:   # (also in a module it imports)
        raise CliError("cannot import module %r: %s"
                       % (module_name, _import_error(e)))
    names = [attr] if attr else ["application", "app"]
    for name in names:
        obj = module
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        except (ImportError, SyntaxError) as e:   # (a lazy __getattr__)
            raise CliError("cannot import %s:%s: %s"
                           % (module_name, name, _import_error(e)))
        if not callable(obj):
            raise CliError("%s:%s is not callable" % (module_name, name))
        return obj
    raise CliError("module %r has no attribute %s" % (
        module_name, " or ".join(repr(n) for n in names)))


def _import_error(e):
    """An ImportError or SyntaxError in one line, with what it says of
    where."""
    from ._text import clean
    if not isinstance(e, SyntaxError):
        return clean(str(e), 600)
    where = " in %s" % clean(str(e.filename), 300) if e.filename else ""
    if e.lineno is not None:
        where += "%s line %s" % ("," if where else " at", clean(e.lineno))
    return "%s%s%s" % (type(e).__name__, where, ": %s" % clean(str(
        e.msg), 300) if e.msg is not None else "")


def cmd_serve(args):
    from gevent import pywsgi

    from . import config
    from .errors import ConfigError
    from .middleware import ProfilingMiddleware, find_middleware

    if args.patch:
        from gevent import monkey
        monkey.patch_all()
    app = load_app(args.app)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    mw = find_middleware(app)
    try:
        if mw is None:
            mw = app = ProfilingMiddleware(
                app, pct=1.0 if args.pct is None else args.pct,
                calls=args.calls,
                # (only 0 is off: a negative or NaN value is refused)
                blocking_ms=_blocking_ms(args),
                ui_path=UI_PATH if args.ui else None,
                profile_dir=args.profile_dir,
                formats=_formats_arg(args),
                report=not args.quiet)
            inspector = mw.inspector
        else:
            app, inspector = _adopt(mw, app, args)
    except ConfigError as e:
        raise CliError(config.name_flags(e, FLAGS, off={"blocking_ms": "0"}))
    try:
        server = pywsgi.WSGIServer((args.host, args.port), app,
                                   log=None if args.quiet else "default")
        server.start()
    except (OSError, OverflowError) as e:
        raise CliError("cannot listen on %s:%d: %s"
                       % (args.host, args.port, e))
    url = _url(server.server_host, server.server_port)
    # (a wrapped app's own inspector is shown too, when it would answer)
    note = inspector is not None and _unreachable(inspector, url)
    if note and args.ui:
        server.stop()
        raise CliError(note)
    print("greqprof: serving %s on %s" % (args.app, url), flush=True)
    if inspector is not None and not note:
        print("greqprof: inspector at %s%s/%s" % (
            url, inspector.path, " (it asks for its ui_token: ?token=...)"
            if inspector.token_required else ""), flush=True)
    # SIGTERM and SIGINT stop the server (the requests in flight get
    # STOP_GRACE_S to end), then the profiles still lingering or queued
    # are delivered (bounded by FLUSH_S) before the process exits.
    import signal
    import gevent
    from gevent.event import Event
    stopping = Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        gevent.signal_handler(sig, stopping.set)
    try:
        stopping.wait()
    except KeyboardInterrupt:
        pass
    server.stop(timeout=STOP_GRACE_S)
    mw.flush(timeout=FLUSH_S)
    return 0


def _formats_arg(args):
    """--formats as the middleware's option: the comma-separated text as
    typed (errors show it), None when not given ("" names no format)."""
    if args.formats is None:
        return None
    if not args.formats.replace(",", "").strip():
        raise CliError("--formats names no format: give some of %s, "
                       "e.g. --formats json,trace (default json)"
                       % ", ".join(_formats()))
    return args.formats


def _blocking_ms(args):
    """--blocking-ms as the middleware's option (0: off, None)."""
    if args.blocking_ms is None:
        return 100.0
    return None if args.blocking_ms == 0 else args.blocking_ms


def _adopt(mw, app, args):
    """Serves an app that carries its own ProfilingMiddleware ``mw`` (not
    profiled twice): the options it leaves unset are applied (--ui,
    --profile-dir, --quiet); those that would change how it profiles
    (--pct, --calls, --blocking-ms) are refused with a CliError saying
    where to set them.  Returns (the WSGI app to serve, the inspector or
    None)."""
    from . import config
    from .inspector import Inspector, ProfileOutputs
    from .renderers.files import ProfileWriter
    cfg = mw.config
    refused = []
    if args.pct is not None and config.check("pct", args.pct) != cfg.pct:
        refused.append(("--pct", "pct=%r" % args.pct))
    if args.calls and not cfg.calls:
        refused.append(("--calls", "calls=True"))
    if args.blocking_ms is not None:
        ms = config.check("blocking_ms", _blocking_ms(args))
        if (int(ms * 1e6) if ms else 0) != cfg.blocking_ns:
            refused.append(("--blocking-ms", "blocking_ms=%r" % ms))
    outputs = mw._outputs or ProfileOutputs(cfg.calls)
    if args.profile_dir is not None or args.formats is not None:
        if outputs.writer is not None:
            refused.append(("--profile-dir", "profile_dir=%r"
                            % args.profile_dir))
        elif args.profile_dir is None:
            raise CliError("--formats needs --profile-dir")
    if refused:
        raise CliError(
            "%s is already wrapped in %r, which %s cannot change: pass %s "
            "to ProfilingMiddleware where the app is wrapped, or serve the "
            "app without it" % (
                args.app, mw, " and ".join(o for o, _ in refused),
                ", ".join(k for _, k in refused)))
    if args.profile_dir is not None:
        outputs.writer = ProfileWriter(
            args.profile_dir, config.check("formats", _formats_arg(args))
            or ("json",), calls=cfg.calls)
    added = ["--profile-dir"] if args.profile_dir is not None else []
    inspector = mw.inspector
    if args.ui and inspector is None:
        # Served in front of the app (its requests never reach the
        # middleware), fed by the middleware's deliveries.
        inspector = outputs.ui = Inspector(UI_PATH)
        app = _Front(inspector, app)
        added.append("--ui")
    if outputs.writer is not None or outputs.ui is not None:
        mw._outputs = outputs
    if args.quiet:
        mw.report = False
        added.append("--quiet")
    print("greqprof: %s is already wrapped in %r: served with its options"
          "%s" % (args.app, mw, " and " + " ".join(added) if added else ""),
          file=sys.stderr, flush=True)
    return app, inspector


class _Front:
    """Sends the inspector's paths to it, the rest to the app."""

    def __init__(self, inspector, app):
        self.inspector, self.app = inspector, app

    def __call__(self, environ, start_response):
        if self.inspector.matches(environ):
            return self.inspector(environ, start_response)
        return self.app(environ, start_response)


def _url(host, port):
    """The URL a browser on this machine reaches a server listening on
    host:port by (loopback for the wildcard addresses: some browsers
    refuse 0.0.0.0)."""
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(
        host, host)
    return "http://%s:%d" % ("[%s]" % host if ":" in host else host, port)


def _unreachable(inspector, url):
    """Why the inspector would refuse a browser on this machine opening
    its page under url, or None (a token is the user's to add)."""
    netloc = url.split("//", 1)[1]
    addr = url.rsplit(":", 1)[0].split("//", 1)[1].strip("[]")
    probe = {"HTTP_HOST": netloc, "REMOTE_ADDR": addr}
    if inspector.host_allowed(probe) and (
            inspector.token_required or inspector.allowed(probe)):
        return None
    return ("--ui: the inspector would refuse a browser opening %s%s/ "
            "(it answers loopback addresses, and those its ui_hosts and "
            "ui_allow name): serve on --host 127.0.0.1 (or 0.0.0.0), or "
            "wrap the app with ProfilingMiddleware(app, ui_path=..., "
            "ui_hosts=..., ui_allow=...) (docs/viewing.md)"
            % (url, inspector.path))


_NO_MEMORY = "%s is too large for the memory this process may use"


def cmd_view(args):
    """Renders a saved profile.  Any bad input file ends in one line on
    stderr and exit status 2 (never a traceback): the file is read with a
    size cap and strict JSON (read_json), every field is checked
    (RequestProfile.from_dict), and text is cleaned on load."""
    from ._text import clean
    from .renderers import RenderError, get_renderer
    from .request_profile import RequestProfile, parse_json

    renderer = get_renderer(args.format)
    name = clean(args.profile, 200)
    data = None
    try:
        data = _read_bytes(args.profile)
        raw = parse_json(data)
    except FileNotFoundError:
        raise CliError("no such file: %s" % name)
    except IsADirectoryError:
        raise CliError("%s is a directory, not a profile file" % name)
    except OSError as e:
        raise CliError("cannot read %s: %s" % (name, e.strerror))
    except ValueError as e:   # (also a NUL in the name)
        raise CliError(_several(name, str(e), data) or "%s is not a JSON "
                       "profile (%s)" % (name, clean(str(e), 300)))
    except MemoryError:
        raise CliError(_NO_MEMORY % name) from None
    data = None   # (the document is parsed)
    try:
        profile = RequestProfile.from_dict(raw)
    except (ValueError, RecursionError) as e:
        raise CliError("%s is not a greqprof profile: %s"
                       % (name, clean(str(e), 300)))
    except MemoryError:
        raise CliError(_NO_MEMORY % name) from None
    except Exception as e:  # (a bug of the loader: still one line)
        raise CliError("cannot load %s: %s: %s (please report this)"
                       % (name, type(e).__name__, clean(str(e), 300)))
    finally:
        raw = None   # (the document is not needed any more)
    try:
        out = renderer.render(profile)
        if not renderer.binary:
            out = out.encode("utf-8")
    except RenderError as e:
        raise CliError(clean(str(e), 300))
    except MemoryError:
        raise CliError(_NO_MEMORY % name) from None
    except Exception as e:  # (a renderer bug: still one line)
        raise CliError("cannot render %s as %s: %s: %s (please report "
                       "this)" % (name, args.format, type(e).__name__,
                                  clean(str(e), 300)))
    if args.output in (None, "-"):
        if renderer.binary:
            raise CliError("format %s is binary: write it to a file with "
                           "-o FILE" % args.format)
        _write_stdout(out)
        return 0
    try:
        with open(args.output, "wb") as f:
            f.write(out)
    except OSError as e:
        raise CliError("cannot write %s: %s" % (clean(args.output, 200),
                                                 e.strerror))
    except ValueError as e:
        raise CliError("cannot write %s: %s" % (clean(args.output, 200),
                                                 clean(str(e), 200)))
    # (a note only: sys.stderr may be None, where print() would fall back
    # to stdout, or unwritable; the file is written either way)
    if sys.stderr is not None:
        try:
            print("greqprof: wrote %s (%s)" % (clean(args.output, 200),
                                               args.format),
                  file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
    return 0


_BOM = b"\xef\xbb\xbf"


def _read_bytes(path):
    """The file at ``path`` as read_json reads it (the same size cap),
    less a UTF-8 BOM at its start (view reads it as utf-8-sig: some
    Windows editors write one)."""
    from .request_profile import read_bytes
    data = read_bytes(path)
    return data[len(_BOM):] if data.startswith(_BOM) else data


def _several(name, error, data):
    """The message for a file of several JSON objects, each starting a
    line (json's "Extra data" at column 1 of a line after the first,
    where another object starts), or None."""
    import json
    m = re.search(r"Extra data: line (\d+) column 1 \(char (\d+)\)", error)
    if m is None or m.group(1) == "1" or data is None:
        return None   # (e.g. a log line's "2026-..." prefix: not JSON)
    text, at = data.decode("utf-8"), int(m.group(2))
    end = text.find("\n", at)
    # (JSON lines: that line is an object; else an object starts there,
    # not trailing junk: a number, a lone "}", text)
    lines = m.group(1) == "2" and _is_object(
        json.loads, text[at:end if end >= 0 else len(text)])
    if not lines and not _is_object(
            lambda t: json.JSONDecoder().raw_decode(t, at)[0], text):
        return None
    return ("%s holds several JSON documents%s: view takes one profile "
            "file, like the .json files profile_dir writes (formats="
            "[\"json\"]); save one %s to a file of its own to view it" % (
                name, ", one per line (JSON lines, as json_logs logs them)"
                if lines else "", "line (schema greqprof."
                "request_profile/1)" if lines else "of them"))


def _is_object(decode, text):
    try:
        return isinstance(decode(text), dict)
    except (ValueError, RecursionError, MemoryError):
        return False


def _write_stdout(data):
    """``data`` to standard output, bytes as they are (UTF-8 whatever the
    locale says: the text is clean, any terminal encoding could still
    refuse part of it).  CliError when stdout is closed or the write
    fails (a full disk, EIO); a reader that went away (``view ... |
    head``) is not an error."""
    from ._text import clean
    if sys.stdout is None:   # (started with fd 1 closed: `view ... >&-`)
        raise CliError("standard output is closed: write to a file with "
                       "-o FILE")
    try:
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    except BrokenPipeError:
        _drop_stdout()
    except (OSError, ValueError) as e:
        # What stays in the buffer must not fail again when the
        # interpreter flushes stdout at exit (a second traceback).
        _drop_stdout()
        raise CliError("cannot write to standard output: %s"
                       % clean(getattr(e, "strerror", None) or str(e), 200))


def _drop_stdout():
    """Points fd 1 at /dev/null, so the final flush at exit succeeds."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def _port(text):
    """argparse type of --port: 0 to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("not a port number: %r" % text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError("a port is 0 to 65535, got %d"
                                         % port)
    return port


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m greqprof",
        description="greqprof: request profiler for gevent WSGI servers")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    s = sub.add_parser("serve", help="serve a WSGI app on gevent.pywsgi "
                       "with ProfilingMiddleware")
    s.add_argument("app", metavar="MODULE:APP",
                   help="the WSGI app, e.g. myproject.wsgi:application")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_port, default=8000,
                   help="0 picks a free port (default 8000)")
    s.add_argument("--pct", type=float,
                   help="share of requests to profile, 0.0-1.0 (default 1)")
    s.add_argument("--calls", action="store_true",
                   help="collect function statistics too")
    s.add_argument("--blocking-ms", type=float,
                   help="report spans at least this long as blocking "
                        "(0: off; default 100)")
    s.add_argument("--ui", action="store_true",
                   help="serve the inspector at %s/ (loopback clients "
                        "only)" % UI_PATH)
    s.add_argument("--profile-dir", metavar="DIR",
                   help="also write every profile to DIR")
    s.add_argument("--formats", metavar="F1,F2",
                   help="formats written to --profile-dir (default json; "
                        "any of: %s)" % ", ".join(_formats()))
    s.add_argument("--patch", action="store_true",
                   help="gevent.monkey.patch_all() before importing the app")
    s.add_argument("--quiet", action="store_true",
                   help="no text reports or access log on the console")
    s.set_defaults(func=cmd_serve)

    v = sub.add_parser("view", help="render a saved profile (JSON)")
    v.add_argument("profile", metavar="PROFILE.json")
    v.add_argument("--format", "-f", default="text", choices=_formats(),
                   help="default: text")
    v.add_argument("-o", "--output", metavar="FILE",
                   help="write to FILE (required for binary formats)")
    v.set_defaults(func=cmd_view)
    return p


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CliError as e:
        parser.exit(2, "%s %s: error: %s\n" % (parser.prog, args.command, e))
    except KeyboardInterrupt:
        # Ctrl-C: one line and the shell's status for SIGINT (128 + 2), not
        # a traceback from wherever the command happened to be.
        parser.exit(130, "%s %s: interrupted\n" % (parser.prog, args.command))


if __name__ == "__main__":
    sys.exit(main())
