"""What the app attaches to the profile of the request it serves:
current_profile() and its ProfileHandle (notes, an error)."""
from greenlet import getcurrent

from . import _registry
from . import engine as _engine
from ._text import clean


#: notes kept per request, and characters per note
MAX_NOTES = 50
MAX_NOTE = 1000
MAX_ERROR = 1000


class ProfileHandle:
    """What the app may attach to the request being profiled (see
    :func:`current_profile`).  False (and its methods do nothing) when
    the request is not sampled."""

    __slots__ = ("_req",)

    def __init__(self, req):
        self._req = req

    @property
    def sampled(self):
        """True when the request is being profiled."""
        req = self._req
        return req is not None and req.profile is not None

    def __bool__(self):
        return self.sampled

    def _open(self):
        # (once finalized, what is attached reaches no profile)
        req = self._req
        return req is not None and req.greenlet is not None and \
            not req.finalizing

    def note(self, text):
        """Adds a note (any text; cleaned, cut to 1000 characters; 50 at
        most per request) to the request's profile."""
        if self._open():
            notes = self._req.notes
            if notes is None:
                notes = self._req.notes = []
            if len(notes) < MAX_NOTES:
                notes.append(clean(text, MAX_NOTE))

    def set_error(self, error):
        """Records an exception (``"Type: message"``) or a text as the
        request's ``error``, e.g. one the framework handled itself."""
        if not self._open():
            return
        if isinstance(error, BaseException):
            try:
                msg = str(error)
            except Exception:
                msg = "<unprintable>"
            error = "%s: %s" % (type(error).__name__, msg)
        self._req.error = clean(error, MAX_ERROR)

    def __repr__(self):
        return "<greqprof.ProfileHandle %s>" % (
            "sampled" if self.sampled else "not sampled")


_NO_PROFILE = ProfileHandle(None)


def current_profile():
    """The :class:`ProfileHandle` of the request the calling greenlet
    serves (or was spawned by, directly or not), for the app to attach an
    exception or a note to its profile; a handle that does nothing (and
    is false) when the request is not sampled.  Never raises."""
    try:
        eng = _engine.current_engine()
        if eng is None or not eng.profile_requests:
            return _NO_PROFILE
        # The profile the greenlet is in (its request's, or inherited from
        # the request that spawned it): not its spawner's current request,
        # which on a keep-alive connection may be a later one.
        addr = _registry.greenlet_profile(eng.tracer.addr, getcurrent())
        req = eng.profile_requests.get(addr) if addr else None
        return ProfileHandle(req) if req is not None else _NO_PROFILE
    except Exception:
        return _NO_PROFILE
