"""greqprof's log output visible by default: a stderr handler on its
logger while the application configures none, and whether a record would
be printed at all (issue 16, item 4)."""
import logging
import sys
import threading


#: the level greqprof gives its logger when the logger has none: lets INFO
#: through like INFO, and tells greqprof's setting from a level the
#: application sets later (INFO too, say), which is then left alone
OWN_LEVEL = logging.INFO - 1


class DefaultHandler(logging.StreamHandler):
    """The handler greqprof adds to its logger when nothing in the logger's
    hierarchy has one (werkzeug does the same for its own logger): reports
    and WARNINGs go to stderr.  It steps aside as soon as any other handler
    appears in the hierarchy, so the application's logging configuration,
    made before or after, wins: from then on greqprof's records go where
    they would have gone had it been made before the first request."""

    def __init__(self, logger, json=False):
        super().__init__()
        self._logger = logger
        # (json_logs: each line one JSON object, for a log shipper)
        self.setFormatter(logging.Formatter(
            "%(message)s" if json else
            "%(asctime)s %(levelname)s [%(name)s] %(message)s"))

    @property
    def stream(self):
        return sys.stderr   # (the current one: it may be replaced)

    @stream.setter
    def stream(self, value):
        pass

    def emit(self, record):
        # Another handler now: the record is theirs.  (Not removed from
        # here: Logger.callHandlers is going through the list, removing
        # from it would skip the next handler.  greqprof removes it before
        # its next record, ensure_visible.)
        if not self.others():
            super().emit(record)

    def others(self):
        c = self._logger
        while c is not None:
            for h in c.handlers:
                if h is not self:
                    return True
            if not c.propagate:
                return False
            c = c.parent
        return False

    def retire(self):
        self._logger.removeHandler(self)
        if self._logger.level == OWN_LEVEL:   # (else the application's)
            self._logger.setLevel(logging.NOTSET)


def ensure_visible(logger, json=False):
    """Before greqprof logs to a logger: on its first use, when no handler
    anywhere in its hierarchy would print (logging.lastResort does not
    count: it prints WARNINGs only, and only the message), adds a
    DefaultHandler (printing the bare message when json: json_logs);
    later, once the application has a handler of its own
    in the hierarchy, takes it away (and the level it set), so that
    whether the record is logged at all is the application's
    configuration's call."""
    own = _defaults.get(logger.name)
    if own is not None:
        if not own.others() and own in logger.handlers:
            return
        with _checked_lock:
            if _defaults.get(logger.name) is own:
                del _defaults[logger.name]
                own.retire()
                # (looked at again as on first use: a configuration that
                # took greqprof's handler away and left none gets it back)
                _checked_loggers.discard(logger.name)
    if logger.name in _checked_loggers:
        return
    with _checked_lock:   # (threads: one handler, not one each)
        if logger.name in _checked_loggers:
            return
        if len(_checked_loggers) >= 1000:   # (logger names a user passes)
            _checked_loggers.clear()
        if not logger.hasHandlers() and len(_defaults) < 100:
            own = DefaultHandler(logger, json)
            logger.addHandler(own)
            _defaults[logger.name] = own
            if logger.level == logging.NOTSET:
                logger.setLevel(OWN_LEVEL)
        _checked_loggers.add(logger.name)


_checked_loggers = set()
#: logger name -> the DefaultHandler greqprof gave it, while it is there
_defaults = {}
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
