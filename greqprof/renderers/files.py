"""Writes profiles to a directory in chosen formats (the middleware's
``profile_dir=`` / ``formats=``)."""
import datetime
import itertools
import os
import re
import threading

from ..errors import ConfigError
from . import get_renderer

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
MAX_NAME = 60


def sanitize_path(path):
    """A request path as a file-name fragment: only ``[A-Za-z0-9._-]``, no
    leading dots, at most 60 characters, ``root`` for ``/``."""
    text = _UNSAFE.sub("_", str(path or "")).strip("._-")
    return text[:MAX_NAME].rstrip("._-") or "root"


class FormatError(Exception):
    """Some formats of a profile could not be written: ``errors`` is
    [(format name, exception)], ``paths`` the files the other formats
    were written to."""

    def __init__(self, paths, errors):
        self.paths = list(paths)
        self.errors = list(errors)
        super().__init__("; ".join(
            "format %s not written (%s: %s)" % (name, type(e).__name__, e)
            for name, e in self.errors) + (
            "; written: %s" % ", ".join(os.path.basename(p)
                                        for p in self.paths)
            if self.paths else ""))


class ProfileWriter:
    """Writes every profile it gets as ``<time>-<pid>-<path>-<n>.<ext>``
    (UTC start time to the microsecond, process id, sanitised path, a
    per-writer counter), one file per format.  Files are created with
    O_EXCL, so names never collide, even between processes."""

    def __init__(self, directory, formats=("json",), calls=True):
        if isinstance(formats, str):
            formats = [f.strip() for f in formats.split(",") if f.strip()]
        formats = list(formats or ())
        if not formats:
            raise ConfigError("formats must name at least one format")
        renderers = []
        for name in formats:
            try:
                r = get_renderer(name)
            except ValueError as e:
                raise ConfigError("formats: %s" % e) from None
            if r.needs_calls and not calls:
                raise ConfigError("formats: %r needs function statistics; "
                                  "enable calls=True" % name)
            if r not in renderers:
                renderers.append(r)
        if not isinstance(directory, (str, os.PathLike)):
            raise ConfigError("profile_dir must be a directory path, got %r"
                              % (directory,))
        directory = os.fspath(directory)
        try:
            os.makedirs(directory, exist_ok=True)
        except (OSError, ValueError) as e:   # (ValueError: a NUL byte)
            raise ConfigError("profile_dir %r cannot be created: %s"
                              % (directory, e)) from None
        if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
            raise ConfigError("profile_dir %r is not a writable directory"
                              % directory)
        self.directory = directory
        self.renderers = renderers
        self._counter = itertools.count(1)
        self._lock = threading.Lock()

    def base_name(self, profile, n):
        try:
            when = datetime.datetime.fromtimestamp(
                profile.start, datetime.timezone.utc)
        except (OverflowError, OSError, ValueError, TypeError):
            when = datetime.datetime.now(datetime.timezone.utc)
        return "%s-%d-%s-%d" % (when.strftime("%Y%m%dT%H%M%S.%fZ"),
                                profile.pid or os.getpid(),
                                sanitize_path(profile.path), n)

    def write(self, profile):
        """Writes ``profile`` in every format; returns the paths written.

        Each format is rendered and written on its own: one that fails
        (a renderer's error, disk full, a size limit) does not keep the
        others from being written; its error is raised afterwards, as a
        FormatError naming it (the caller logs and counts it).  Each file
        is written under a hidden temporary name first and only then
        linked to its final name, so a failed write never leaves a
        truncated file under a final name.  When no format could be
        written, the first error is raised as it is."""
        with self._lock:
            n = next(self._counter)
        temps, outputs, failed = [], [], []
        try:
            for r in self.renderers:
                try:
                    data = r.render(profile)
                    temps.append(self._write_temp(
                        data if isinstance(data, bytes)
                        else data.encode("utf-8"), n, len(temps)))
                except Exception as e:
                    failed.append((r.name, e))
                    continue
                outputs.append((r, None))
            if not outputs:
                raise failed[0][1]   # (nothing written: the first error)
            while True:
                base = self.base_name(profile, n)
                paths = [os.path.join(self.directory, r.filename(base))
                         for r, _ in outputs]
                linked = []
                try:
                    for tmp, path in zip(temps, paths):
                        # (link, not rename: an existing name is never
                        # replaced, even one another process wrote)
                        os.link(tmp, path)
                        linked.append(path)
                    if failed:
                        raise FormatError(linked, failed)
                    return linked
                except FileExistsError:
                    _unlink_all(linked)   # another writer took this name
                    with self._lock:
                        n = next(self._counter)
                except FormatError:
                    raise   # (the others stay written)
                except BaseException:
                    _unlink_all(linked)
                    raise
        finally:
            _unlink_all(temps)

    def _write_temp(self, data, n, i):
        """data in a new hidden file of the directory; its path."""
        path = os.path.join(self.directory, ".greqprof-%d-%d-%d-%d.tmp" % (
            os.getpid(), id(self), n, i))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        except BaseException:
            _unlink_all([path])
            raise
        return path


def _unlink_all(paths):
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass
