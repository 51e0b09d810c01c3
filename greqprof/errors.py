"""Exceptions raised by greqprof (all derive from GreqprofError)."""


class GreqprofError(Exception):
    """Base class of every greqprof exception."""


class ConfigError(GreqprofError, ValueError):
    """An option has an invalid value; the message names the option."""


class ProfilerStateError(GreqprofError, RuntimeError):
    """The operation is not allowed in the profiler's current state."""


class LibraryError(GreqprofError):
    """libgreqprof returned an error code.

    ``code`` is the negative GQP_E* number, ``name`` its symbolic name.
    """

    def __init__(self, code, name, message):
        super().__init__(message)
        self.code = code
        self.name = name
