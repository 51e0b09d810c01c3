"""A small writer of pprof's ``profile.proto`` (gzip-compressed), with no
dependency beyond the standard library.

    b = ProfileBuilder([("calls", "count"), ("cpu", "nanoseconds")])
    fn = b.function("app.views.index", "app/views.py", 12)
    b.sample([b.location(fn, 12)], [3, 1500000], labels={"route": "/"})
    data = b.to_bytes()          # gzipped, what `go tool pprof` reads

Field numbers are those of google/pprof's proto/profile.proto (package
``perftools.profiles``): only the fields greqprof writes are encoded.
Every name goes through greqprof's clean-text rule (:mod:`greqprof._text`),
so a reader never meets a control character or a lone surrogate."""
import gzip

from ._text import clean

__all__ = ["ProfileBuilder", "MAX_NAME", "encode_varint"]

#: longest function, file or label text (characters, after cleaning)
MAX_NAME = 1000

_I64_MIN, _I64_MAX = -2 ** 63, 2 ** 63 - 1
_U64_MAX = 2 ** 64 - 1

# Profile
_P_SAMPLE_TYPE, _P_SAMPLE, _P_LOCATION, _P_FUNCTION = 1, 2, 4, 5
_P_STRING_TABLE, _P_TIME_NANOS, _P_DURATION_NANOS = 6, 9, 10
_P_PERIOD_TYPE, _P_PERIOD, _P_COMMENT, _P_DEFAULT_SAMPLE_TYPE = 11, 12, 13, 14
# ValueType
_VT_TYPE, _VT_UNIT = 1, 2
# Sample
_S_LOCATION_ID, _S_VALUE, _S_LABEL = 1, 2, 3
# Label
_L_KEY, _L_STR, _L_NUM, _L_NUM_UNIT = 1, 2, 3, 4
# Location, Line
_LOC_ID, _LOC_LINE = 1, 4
_LINE_FUNCTION_ID, _LINE_LINE = 1, 2
# Function
_F_ID, _F_NAME, _F_SYSTEM_NAME, _F_FILENAME, _F_START_LINE = 1, 2, 3, 4, 5

_VARINT, _LEN = 0, 2


def encode_varint(n, out):
    """Appends ``n`` as a protobuf varint to bytearray ``out``; negative
    int64 values take their 64-bit two's complement (10 bytes), as
    protobuf encodes them."""
    if 0 <= n < 0x80:
        out.append(n)
        return
    if n < 0:
        n += 1 << 64
    while n > 0x7f:
        out.append((n & 0x7f) | 0x80)
        n >>= 7
    out.append(n)


# (every field number used is below 16: a field's key is one byte)

def _int(field, n, out):
    """A varint field; proto3 leaves zero values out."""
    if n:
        out.append(field << 3 | _VARINT)
        encode_varint(n, out)


def _bytes(field, data, out):
    out.append(field << 3 | _LEN)
    encode_varint(len(data), out)
    out += data


def _packed(field, values, out):
    if values:
        body = bytearray()
        for v in values:
            encode_varint(v, body)
        _bytes(field, body, out)


def _check_int(what, n, lo=_I64_MIN, hi=_I64_MAX):
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError("%s must be an int, got %r" % (what, n))
    if not lo <= n <= hi:
        raise ValueError("%s must be in %d..%d, got %d" % (what, lo, hi, n))
    return n


def _text(what, value):
    if value is None:
        return ""
    if not isinstance(value, (str, bytes, bytearray)):
        raise ValueError("%s must be text, got %s" % (what,
                                                      type(value).__name__))
    return clean(value, MAX_NAME)


class ProfileBuilder:
    """Collects one pprof profile.

    ``sample_types`` is a list of (type, unit) pairs such as
    ``("cpu", "nanoseconds")``; every sample carries one value per pair.
    ``default_type`` names the type pprof shows first (the last one when
    not given, pprof's own default).  ``period_type``/``period`` describe
    the sampling interval, ``time_nanos``/``duration_nanos`` when the
    profile started (nanoseconds since the epoch) and how long it lasted."""

    def __init__(self, sample_types, default_type=None, period_type=None,
                 period=0, time_nanos=0, duration_nanos=0, comments=()):
        self._strings = {"": 0}  # clean text -> index
        self._raw = {}           # text as given -> index
        self._functions = {}     # (name, system name, file, line) -> id
        self._function_rows = []
        self._locations = {}     # (function id, line) -> id
        self._location_rows = []
        self._samples = []
        self._label_sets = {}    # labels items -> encoded Label fields
        types = list(sample_types or ())
        if not types:
            raise ValueError("sample_types must name at least one "
                             "(type, unit) pair")
        self._types = []
        for i, pair in enumerate(types):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError("sample_types[%d] must be a (type, unit) "
                                 "pair, got %r" % (i, pair))
            self._types.append((self._string(pair[0], "sample type"),
                                self._string(pair[1], "sample unit")))
        names = [clean(t, MAX_NAME) for t, _ in types]
        if default_type is None:
            self._default = 0
        else:
            if default_type not in names:
                raise ValueError("default_type %r is not one of the sample "
                                 "types %s" % (default_type, names))
            self._default = self._string(default_type, "default type")
        if period_type is None:
            self._period_type = None
        else:
            if not isinstance(period_type, (tuple, list)) or \
                    len(period_type) != 2:
                raise ValueError("period_type must be a (type, unit) pair, "
                                 "got %r" % (period_type,))
            self._period_type = (self._string(period_type[0], "period type"),
                                 self._string(period_type[1], "period unit"))
        self._period = _check_int("period", period)
        self._time_nanos = _check_int("time_nanos", time_nanos)
        self._duration_nanos = _check_int("duration_nanos", duration_nanos,
                                          lo=0)
        self._comments = [self._string(c, "comment") for c in comments]

    @property
    def n_values(self):
        return len(self._types)

    def _string(self, value, what="a name"):
        if type(value) is str:
            i = self._raw.get(value)
            if i is not None:
                return i
        text = _text(what, value)
        i = self._strings.get(text)
        if i is None:
            i = self._strings[text] = len(self._strings)
        if type(value) is str:
            self._raw[value] = i   # (the next time: no cleaning)
        return i

    def function(self, name, filename="", start_line=0, system_name=None):
        """The id of the function ``name`` defined in ``filename`` at
        ``start_line`` (the same id for the same four values).

        ``system_name`` stays empty unless given: pprof demangles a system
        name equal to the name, and its demangler garbles Python names
        such as ``<module>``."""
        if not isinstance(name, (str, bytes, bytearray)) or not name:
            raise ValueError("a function needs a non-empty name, got %r"
                             % (name,))
        _check_int("start_line", start_line, lo=0)
        key = (self._string(name, "function name"),
               self._string(system_name, "function system name"),
               self._string(filename, "file name"), start_line)
        fid = self._functions.get(key)
        if fid is None:
            fid = self._functions[key] = len(self._function_rows) + 1
            self._function_rows.append(key)
        return fid

    def location(self, function_id, line=0):
        """The id of a location made of one line of ``function_id``."""
        _check_int("function_id", function_id, lo=1,
                   hi=len(self._function_rows))
        _check_int("line", line, lo=0)
        key = (function_id, line)
        lid = self._locations.get(key)
        if lid is None:
            lid = self._locations[key] = len(self._location_rows) + 1
            self._location_rows.append(key)
        return lid

    def sample(self, location_ids, values, labels=None, num_labels=None):
        """Adds a sample: ``location_ids`` leaf first, one int per sample
        type in ``values``; ``labels`` maps label keys to text,
        ``num_labels`` maps keys to ints or to (int, unit) pairs."""
        locs = list(location_ids)
        n = len(self._location_rows)
        for i, lid in enumerate(locs):
            if type(lid) is not int or not 0 < lid <= n:
                _check_int("location_ids[%d]" % i, lid, lo=1, hi=n)
        vals = list(values)
        if len(vals) != len(self._types):
            raise ValueError("a sample needs %d values (one per sample "
                             "type), got %d" % (len(self._types), len(vals)))
        for i, v in enumerate(vals):
            if type(v) is not int or not _I64_MIN <= v <= _I64_MAX:
                _check_int("values[%d]" % i, v)
        encoded = b""
        if labels:
            # (a profile's samples share few label sets: each is
            # checked and encoded once)
            try:
                key = tuple(labels.items())
                encoded = self._label_sets.get(key)
            except TypeError:   # (unhashable values: refused below)
                key = encoded = None
            if encoded is None:
                encoded = self._labels(labels, {})
                if key is not None:
                    self._label_sets[key] = encoded
        if num_labels:
            encoded += self._labels({}, num_labels)
        self._samples.append((locs, vals, encoded))

    def _labels(self, labels, num_labels):
        """Label fields of a Sample, encoded."""
        out = []
        for k, v in labels.items():
            out.append((self._string(k, "label key"),
                        self._string(v, "label %r" % (k,)), 0, 0))
        for k, v in num_labels.items():
            unit = 0
            if isinstance(v, (tuple, list)):
                if len(v) != 2:
                    raise ValueError("numeric label %r must be an int or an "
                                     "(int, unit) pair, got %r" % (k, v))
                v, unit = v[0], self._string(v[1], "label unit")
            out.append((self._string(k, "label key"), 0,
                        _check_int("label %r" % (k,), v), unit))
        encoded = bytearray()
        for key, text, num, unit in out:
            lab = bytearray()
            _int(_L_KEY, key, lab)
            _int(_L_STR, text, lab)
            _int(_L_NUM, num, lab)
            _int(_L_NUM_UNIT, unit, lab)
            _bytes(_S_LABEL, lab, encoded)
        return bytes(encoded)

    def serialize(self):
        """The profile as uncompressed protobuf bytes."""
        out = bytearray()
        for t, u in self._types:
            vt = bytearray()
            _int(_VT_TYPE, t, vt)
            _int(_VT_UNIT, u, vt)
            _bytes(_P_SAMPLE_TYPE, vt, out)
        for locs, vals, labels in self._samples:
            s = bytearray()
            _packed(_S_LOCATION_ID, locs, s)
            _packed(_S_VALUE, vals, s)
            s += labels
            _bytes(_P_SAMPLE, s, out)
        for lid, (fid, line) in enumerate(self._location_rows, 1):
            ln = bytearray()
            _int(_LINE_FUNCTION_ID, fid, ln)
            _int(_LINE_LINE, line, ln)
            loc = bytearray()
            _int(_LOC_ID, lid, loc)
            _bytes(_LOC_LINE, ln, loc)
            _bytes(_P_LOCATION, loc, out)
        for fid, (name, system, filename, start) in \
                enumerate(self._function_rows, 1):
            f = bytearray()
            _int(_F_ID, fid, f)
            _int(_F_NAME, name, f)
            _int(_F_SYSTEM_NAME, system, f)
            _int(_F_FILENAME, filename, f)
            _int(_F_START_LINE, start, f)
            _bytes(_P_FUNCTION, f, out)
        # (dicts keep insertion order: the table is in index order)
        for text in self._strings:
            _bytes(_P_STRING_TABLE,
                   text.encode("utf-8"), out)
        _int(_P_TIME_NANOS, self._time_nanos, out)
        _int(_P_DURATION_NANOS, self._duration_nanos, out)
        if self._period_type is not None:
            vt = bytearray()
            _int(_VT_TYPE, self._period_type[0], vt)
            _int(_VT_UNIT, self._period_type[1], vt)
            _bytes(_P_PERIOD_TYPE, vt, out)
        _int(_P_PERIOD, self._period, out)
        _packed(_P_COMMENT, self._comments, out)
        _int(_P_DEFAULT_SAMPLE_TYPE, self._default, out)
        return bytes(out)

    def to_bytes(self):
        """The profile gzip-compressed: what pprof files hold.  (mtime 0:
        the same profile always gives the same bytes.)"""
        return gzip.compress(self.serialize(), compresslevel=6, mtime=0)
