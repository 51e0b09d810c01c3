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
        """Writes ``profile`` in every format; returns the paths written."""
        outputs = [(r, r.render(profile)) for r in self.renderers]
        while True:
            with self._lock:
                n = next(self._counter)
            base = self.base_name(profile, n)
            paths = [os.path.join(self.directory, r.filename(base))
                     for r, _ in outputs]
            try:
                written = []
                for path, (r, data) in zip(paths, outputs):
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                 0o600)
                    written.append(path)
                    with os.fdopen(fd, "wb") as f:
                        f.write(data if isinstance(data, bytes)
                                else data.encode("utf-8"))
                return written
            except FileExistsError:
                for path in written:  # another writer took this name
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
