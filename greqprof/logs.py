"""greqprof's log output visible by default: a stderr handler on its
logger while the application configures none, and whether a record would
be printed at all (issue 16, item 4)."""
import logging
import sys
import threading


class DefaultHandler(logging.StreamHandler):
    """The handler greqprof adds to its logger when nothing in the logger's
    hierarchy has one (werkzeug does the same for its own logger): reports
    and WARNINGs go to stderr.  It steps aside as soon as any other handler
    appears in the hierarchy, so the application's logging configuration,
    made before or after, wins."""

    def __init__(self, logger, set_level):
        super().__init__()
        self._logger = logger
        self._set_level = set_level   # we set the logger's level to INFO
        self.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s [%(name)s] %(message)s"))

    @property
    def stream(self):
        return sys.stderr   # (the current one: it may be replaced)

    @stream.setter
    def stream(self, value):
        pass

    def emit(self, record):
        if self._others():
            self._retire()
            return   # (the record goes on to the application's handlers)
        super().emit(record)

    def _others(self):
        c = self._logger
        while c is not None:
            for h in c.handlers:
                if h is not self:
                    return True
            if not c.propagate:
                return False
            c = c.parent
        return False

    def _retire(self):
        self._logger.removeHandler(self)
        if self._set_level and self._logger.level == logging.INFO:
            self._logger.setLevel(logging.NOTSET)


def ensure_visible(logger):
    """On a logger's first use by greqprof: when no handler anywhere in its
    hierarchy would print (logging.lastResort does not count: it prints
    WARNINGs only, and only the message), adds a DefaultHandler."""
    if logger.name in _checked_loggers:
        return
    with _checked_lock:   # (threads: one handler, not one each)
        if logger.name in _checked_loggers:
            return
        if len(_checked_loggers) >= 1000:   # (logger names a user passes)
            _checked_loggers.clear()
        if not logger.hasHandlers():
            set_level = logger.level == logging.NOTSET
            logger.addHandler(DefaultHandler(logger, set_level))
            if set_level:
                logger.setLevel(logging.INFO)
        _checked_loggers.add(logger.name)


_checked_loggers = set()
_checked_lock = threading.Lock()


def would_emit(logger, level=logging.INFO):
    """Some handler the record would reach takes ``level`` (levels only;
    filters are the handlers' business).  A report nobody would print is
    not rendered."""
    c = logger
    found = False
    while c is not None:
        for h in c.handlers:
            found = True
            if level >= h.level:
                return True
        if not c.propagate:
            break
        c = c.parent
    # (no handler at all: logging.lastResort, which takes WARNING and up)
    return not found and level >= logging.lastResort.level \
        if logging.lastResort is not None else False
