/* The text report's common part, rendered in C (issue 16: rendering and
 * logging a sampled request's report must cost microseconds, and Python
 * string formatting of ~40 lines costs ~50-100 us).
 *
 * _registry.render_rows(fields, raw, n_spans, n_greenlets, safe, stack,
 * end, name_safe)
 * renders a deferred RequestProfile from read_profile's packed rows
 * (_hooks.c; fields: the profile's __dict__, raw: its loader's argument)
 * from ">>> Begin RequestProfile" through the waiting lines (and the end
 * line when `end` is true: the report has no later section), exactly as
 * greqprof/report.py's Python path does (tests/test_report.py compares
 * them).  n_spans/n_greenlets: how many to show (None: all).  safe,
 * name_safe and stack: report.safe (the header's fields), its version
 * for greenlet names and report's stack indenter, called only for text
 * that is not plain printable ASCII and for stacks.  Returns the text, or None
 * when raw is not a layout this code knows (the caller then renders in
 * Python).  Included by _ffi_build.py after _sampled.c. */

#include <math.h>
#include <stdarg.h>
#include <string.h>
#include <time.h>

typedef struct {
    char *p;
    size_t n, cap;
    int failed;
    int nonascii;   /* UTF-8 beyond ASCII was appended */
    int heap;       /* p is PyMem memory (else the caller's array) */
} gqp_buf;

/* A buffer that starts in the caller's array (a report's text fits in a
 * few KB: no allocation in the common case) */
static void buf_init(gqp_buf *b, char *array, size_t size)
{
    memset(b, 0, sizeof *b);
    b->p = array;
    b->cap = size;
}

static void buf_free(gqp_buf *b)
{
    if (b->heap) {
        PyMem_Free(b->p);
    }
}

static void buf_grow(gqp_buf *b, size_t more)
{
    if (b->failed || b->n + more <= b->cap) {
        return;
    }
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->n + more) {
        cap *= 2;
    }
    char *p = b->heap ? PyMem_Realloc(b->p, cap) : PyMem_Malloc(cap);
    if (!p) {
        b->failed = 1;
        return;
    }
    if (!b->heap && b->n) {
        memcpy(p, b->p, b->n);
    }
    b->p = p;
    b->cap = cap;
    b->heap = 1;
}

/* (always inlined: a literal's memcpy then compiles to a few moves) */
static inline __attribute__((always_inline)) void buf_put(gqp_buf *b,
                                                          const char *s,
                                                          size_t n)
{
    if (b->n + n > b->cap) {
        buf_grow(b, n);
        if (b->failed) {
            return;
        }
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
}

/* n spaces (n <= 0: none) */
static void buf_pad_slow(gqp_buf *b, int n)
{
    static const char spaces[] = "                                ";
    while (n > 0) {
        int k = n < (int)sizeof spaces - 1 ? n : (int)sizeof spaces - 1;
        buf_put(b, spaces, (size_t)k);
        n -= k;
    }
}

static inline __attribute__((always_inline)) void buf_pad(gqp_buf *b, int n)
{
    if (n > 0) {
        buf_pad_slow(b, n);
    }
}

static void buf_puts(gqp_buf *b, const char *s)
{
    buf_put(b, s, strlen(s));
}

/* a string literal, without strlen */
#define BUF_LIT(b, lit) buf_put((b), "" lit, sizeof(lit) - 1)

static void buf_printf(gqp_buf *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void buf_printf(gqp_buf *b, const char *fmt, ...)
{
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->failed = 1;
    } else {
        buf_put(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
    }
}

static const char digit_pairs[201] =
    "00010203040506070809101112131415161718192021222324252627282930313233"
    "34353637383940414243444546474849505152535455565758596061626364656667"
    "6869707172737475767778798081828384858687888990919293949596979899";

/* Decimal digits of v into the end of tmp; returns where they start.
 * (two digits per division: epoch milliseconds have 13) */
static char *u64_digits(char *end, unsigned long long v)
{
    char *p = end;
    while (v >= 100) {
        unsigned r = (unsigned)(v % 100);
        v /= 100;
        p -= 2;
        memcpy(p, digit_pairs + 2 * r, 2);
    }
    if (v >= 10) {
        p -= 2;
        memcpy(p, digit_pairs + 2 * v, 2);
    } else {
        *--p = (char)('0' + v);
    }
    return p;
}

/* v in decimal, right-aligned in width (printf's "%*llu"; vfprintf costs
 * ~10x this per number) */
static void buf_u64(gqp_buf *b, unsigned long long v, int width)
{
    char tmp[32];
    char *p = u64_digits(tmp + sizeof tmp, v);
    buf_pad(b, width - (int)(tmp + sizeof tmp - p));
    buf_put(b, p, (size_t)(tmp + sizeof tmp - p));
}

/* "%.1f" % v, as Python (and printf) print it: the exact binary value
 * rounded half-even, written backwards so that it ends at `end` (>= 40
 * bytes of room before it); returns where it starts.  10*v is rounded
 * once by the multiplication; TwoSum recovers that error, which decides
 * the cases the rounding moved onto or across .5. */
static char *fmt_1f(char *end, double v)
{
    if (!(fabs(v) < 1e14)) {   /* (huge or NaN: printf) */
        char tmp[48];
        int n = snprintf(tmp, sizeof tmp, "%.1f", v);
        n = n < 0 ? 0 : n > 40 ? 40 : n;
        memcpy(end - n, tmp, (size_t)n);
        return end - n;
    }
    int neg = signbit(v) != 0;
    double x = fabs(v);
    /* 10x = 8x + 2x, both exact; TwoSum gives the sum's rounding error
     * exactly (fma would too, but is a slow library call without -mfma) */
    double a8 = x * 8.0, a2 = x * 2.0;
    double y = a8 + a2;
    double bv = y - a8;
    double e = (a8 - (y - bv)) + (a2 - bv);   /* 10x == y + e exactly */
    unsigned long long n = (unsigned long long)y;   /* floor (y >= 0) */
    double frac = y - (double)n;        /* exact: y < 2^53 */
    /* (frac != 0.5: |e| < |frac - 0.5|, so frac alone decides) */
    if (frac > 0.5 || (frac == 0.5 && (e > 0 || (e == 0 && (n & 1))))) {
        n++;
    }
    char *p = end;
    *--p = (char)('0' + n % 10);
    *--p = '.';
    p = u64_digits(p, n / 10);
    if (neg) {
        *--p = '-';
    }
    return p;
}

/* report._ms(seconds) ("-" for none) right-aligned in width (0: none) */
static void buf_ms(gqp_buf *b, int have, double seconds, int width)
{
    char tmp[48];
    char *end = tmp + sizeof tmp, *p;
    if (have) {
        memcpy(end - 3, " ms", 3);
        p = fmt_1f(end - 3, seconds * 1000.0);
    } else {
        p = end - 1;
        *p = '-';
    }
    buf_pad(b, width - (int)(end - p));
    buf_put(b, p, (size_t)(end - p));
}

/* "%.1f" % v, appended */
static void buf_1f(gqp_buf *b, double v)
{
    char tmp[48];
    char *p = fmt_1f(tmp + sizeof tmp, v);
    buf_put(b, p, (size_t)(tmp + sizeof tmp - p));
}

/* 1 when s is plain printable ASCII (0x20..0x7e): clean() keeps it.
 * Eight bytes at a time: bytes are < 0x80 (IS_ASCII), so a byte < 0x20
 * or == 0x7f sets its high bit in the masks below. */
static int plain_ascii(PyObject *s)
{
    if (!PyUnicode_CheckExact(s) || !PyUnicode_IS_ASCII(s)) {
        return 0;
    }
    const unsigned char *c = PyUnicode_1BYTE_DATA(s);
    Py_ssize_t n = PyUnicode_GET_LENGTH(s), i = 0;
    const uint64_t ones = 0x0101010101010101ull, high = 0x8080808080808080ull;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, c + i, 8);
        uint64_t del = w ^ (0x7f * ones);
        if (((w - 0x20 * ones) | (del - ones)) & ~w & high) {
            return 0;
        }
    }
    if (i < n && n >= 8) {
        /* the tail: the last 8 bytes (overlapping the words checked) */
        uint64_t w;
        memcpy(&w, c + n - 8, 8);
        uint64_t del = w ^ (0x7f * ones);
        return !(((w - 0x20 * ones) | (del - ones)) & ~w & high);
    }
    for (; i < n; i++) {
        if (c[i] < 0x20 || c[i] == 0x7f) {
            return 0;
        }
    }
    return 1;
}

/* report.safe(obj, limit), appended.  0 or -1 (exception set). */
static int buf_safe(gqp_buf *b, PyObject *obj, Py_ssize_t limit,
                    PyObject *safe)
{
    if (obj == NULL || obj == Py_None) {
        BUF_LIT(b, "-");
        return 0;
    }
    if (plain_ascii(obj)) {
        Py_ssize_t n = PyUnicode_GET_LENGTH(obj);
        const char *c = (const char *)PyUnicode_1BYTE_DATA(obj);
        if (n <= limit) {
            buf_put(b, c, (size_t)n);
        } else {
            buf_put(b, c, (size_t)limit);
            buf_printf(b, "...[%zd more]", n - limit);
        }
        return 0;
    }
    PyObject *lim = PyLong_FromSsize_t(limit);
    PyObject *r = lim ? PyObject_CallFunctionObjArgs(safe, obj, lim, NULL)
                      : NULL;
    Py_XDECREF(lim);
    if (!r) {
        return -1;
    }
    Py_ssize_t n;
    const char *u = PyUnicode_Check(r) ? PyUnicode_AsUTF8AndSize(r, &n)
                                       : NULL;
    if (u) {
        buf_put(b, u, (size_t)n);
        b->nonascii |= !PyUnicode_IS_ASCII(r);
    }
    Py_DECREF(r);
    return u ? 0 : -1;
}

/* report._utc(ts) */
static void buf_utc(gqp_buf *b, double ts)
{
    if (!(fabs(ts) < 2.5e11)) {   /* (beyond year 9999, or NaN) */
        BUF_LIT(b, "-");
        return;
    }
    double us_f = nearbyint(ts * 1e6);   /* round() of Python: half-even */
    long long us = (long long)us_f;
    long long secs = us / 1000000, rest = us % 1000000;
    if (rest < 0) {
        rest += 1000000;
        secs -= 1;
    }
    time_t t = (time_t)secs;
    struct tm tm;
    if (!gmtime_r(&t, &tm) ||
        tm.tm_year + 1900 < 1 || tm.tm_year + 1900 > 9999) {
        BUF_LIT(b, "-");   /* (as report._utc: an impossible time) */
        return;
    }
    /* "%Y-%m-%d %H:%M:%S.%06d UTC" without printf's cost */
    char tmp[32];
    int year = tm.tm_year + 1900;
    int fields[] = {tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                    tm.tm_sec};
    const char seps[] = "-- ::";
    tmp[0] = (char)('0' + year / 1000);
    tmp[1] = (char)('0' + year / 100 % 10);
    tmp[2] = (char)('0' + year / 10 % 10);
    tmp[3] = (char)('0' + year % 10);
    for (int i = 0; i < 5; i++) {
        tmp[4 + 3 * i] = seps[i];
        tmp[5 + 3 * i] = (char)('0' + fields[i] / 10);
        tmp[6 + 3 * i] = (char)('0' + fields[i] % 10);
    }
    tmp[19] = '.';
    for (int i = 25; i >= 20; i--) {
        tmp[i] = (char)('0' + rest % 10);
        rest /= 10;
    }
    memcpy(tmp + 26, " UTC", 4);
    buf_put(b, tmp, 30);
}

static PyObject *str_greqprof_prefix;
/* interned keys of the profile's dict (gqp_render_init) */
static PyObject *k_path, *k_method, *k_status, *k_request_id, *k_error,
    *k_pid, *k_dropped_spans, *k_start, *k_end, *k_wall;

static int generic_name(PyObject *name)
{
    if (!name || !PyUnicode_Check(name)) {
        return 1;   /* (None: "", as `name or ""`) */
    }
    Py_ssize_t n = PyUnicode_GET_LENGTH(name);
    if (n == 0) {
        return 1;
    }
    if (n < 8 || !PyUnicode_IS_ASCII(name)) {
        return 0;
    }
    const char *c = (const char *)PyUnicode_1BYTE_DATA(name);
    if (c[0] != 'G' && c[0] != 'g') {
        return 0;
    }
    if (memcmp(c + 1, "reenlet", 7) != 0) {
        return 0;
    }
    return n == 8 || c[8] == '-';   /* "Greenlet", "greenlet", "...-N" */
}

static int nonempty(PyObject *s)
{
    return s && PyUnicode_Check(s) && PyUnicode_GET_LENGTH(s) > 0;
}

/* 1 for a row of the waiting top that is not shown: not a row, or one
 * of greqprof's own greenlets (as request_records leaves them out). */
static int own_top_row(PyObject *t)
{
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 3) {
        return 1;
    }
    PyObject *n = PyTuple_GET_ITEM(t, 2);
    PyObject *fn = PyTuple_Check(n) && PyTuple_GET_SIZE(n) == 2
                       ? PyTuple_GET_ITEM(n, 1) : NULL;
    return nonempty(fn) &&
           PyUnicode_Tailmatch(fn, str_greqprof_prefix, 0, PY_SSIZE_T_MAX,
                               -1) == 1;
}

/* report.label(name, fn): borrowed (may be NULL or None: "") */
static PyObject *label_of(PyObject *name, PyObject *fn)
{
    return nonempty(fn) && generic_name(name) ? fn : name;
}

/* names.get(gid): 1 and the pair's items (borrowed), 0 when unknown. */
static int lookup_names(PyObject *names, uint64_t gid, PyObject **name,
                        PyObject **fn)
{
    *name = *fn = NULL;
    PyObject *key = PyLong_FromUnsignedLongLong(gid);
    if (!key) {
        return -1;
    }
    PyObject *pair = PyDict_GetItemWithError(names, key);
    Py_DECREF(key);
    if (!pair) {
        return PyErr_Occurred() ? -1 : 0;
    }
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        return 0;
    }
    *name = PyTuple_GET_ITEM(pair, 0);
    *fn = PyTuple_GET_ITEM(pair, 1);
    if (nonempty(*fn) && generic_name(*name)) {
        *name = *fn;   /* (_collect.request_names) */
    }
    return 1;
}

/* lab == "greenlet-<gid>" (a greenlet's default name: shown as its id) */
static int default_name(PyObject *lab, uint64_t gid)
{
    Py_ssize_t n = PyUnicode_GET_LENGTH(lab);
    if (!PyUnicode_IS_ASCII(lab) || n <= 9 ||
        memcmp(PyUnicode_1BYTE_DATA(lab), "greenlet-", 9) != 0) {
        return 0;
    }
    char tmp[24];
    char *d = u64_digits(tmp + sizeof tmp, gid);
    size_t nd = (size_t)(tmp + sizeof tmp - d);
    return (size_t)n == 9 + nd &&
           memcmp(PyUnicode_1BYTE_DATA(lab) + 9, d, nd) == 0;
}

/* a and b are equal strings (b may be NULL or not a str): 1, 0, or -1 */
static int same_text(PyObject *a, PyObject *b)
{
    if (a == b) {
        return 1;
    }
    if (!nonempty(b)) {
        return 0;
    }
    int r = PyUnicode_Compare(a, b);
    if (r == -1 && PyErr_Occurred()) {
        return -1;
    }
    return r == 0;
}

/* report._who(gid, name, fn): "greenlet 3 name (function)" */
static int buf_who(gqp_buf *b, uint64_t gid, PyObject *name, PyObject *fn,
                   PyObject *safe)
{
    BUF_LIT(b, "greenlet ");
    buf_u64(b, gid, 0);
    PyObject *lab = label_of(name, fn);
    if (nonempty(lab) && !default_name(lab, gid)) {
        BUF_LIT(b, " ");
        if (buf_safe(b, lab, 200, safe) < 0) {
            return -1;
        }
    }
    if (nonempty(fn)) {
        int same = same_text(fn, lab);
        if (same < 0) {
            return -1;
        }
        if (!same) {
            BUF_LIT(b, " (");
            if (buf_safe(b, fn, 300, safe) < 0) {
                return -1;
            }
            BUF_LIT(b, ")");
        }
    }
    return 0;
}

/* Per greenlet id, its texts rendered once per report (a greenlet has
 * many spans): for greenlet lines (buf_who), and a span's greenlet_name
 * and fn_name.  Offsets into the cache's own buffer; open addressing. */
typedef struct {
    uint64_t gid;   /* 0: empty slot (greenlet ids are never 0) */
    size_t who_off, who_len, lab_off, lab_len, fn_off, fn_len;
} gqp_name_ent;

typedef struct {
    gqp_name_ent *ent;
    size_t mask;
    gqp_buf text;
    PyObject *names, *safe;
} gqp_names_cache;

static gqp_name_ent *names_get(gqp_names_cache *c, uint64_t gid)
{
    size_t i = (size_t)((gid * 0x9E3779B97F4A7C15ull) >> 7) & c->mask;
    while (c->ent[i].gid && c->ent[i].gid != gid) {
        i = (i + 1) & c->mask;
    }
    gqp_name_ent *e = &c->ent[i];
    if (e->gid) {
        return e;
    }
    PyObject *name, *fn;
    int known = lookup_names(c->names, gid, &name, &fn);
    if (known < 0) {
        return NULL;
    }
    gqp_buf *t = &c->text;
    size_t at = t->n;
    int empty = !known || (!nonempty(name) && !nonempty(fn));
    PyObject *lab = known ? label_of(name, fn) : NULL;
    /* a span's greenlet_name and fn_name */
    if (known) {
        if (nonempty(lab) && buf_safe(t, lab, 200, c->safe) < 0) {
            return NULL;
        }
    } else {
        BUF_LIT(t, "greenlet-");
        buf_u64(t, gid, 0);
    }
    e->lab_off = at;
    e->lab_len = t->n - at;
    at = t->n;
    if (known && (fn == Py_None || nonempty(fn)) &&
        buf_safe(t, fn, 300, c->safe) < 0) {
        return NULL;
    }
    e->fn_off = at;
    e->fn_len = t->n - at;
    /* a greenlet line's text (report._who), from those two: room first,
     * so that the copies from t to t do not move */
    buf_grow(t, 32 + e->lab_len + e->fn_len);
    if (t->failed) {
        PyErr_NoMemory();
        return NULL;
    }
    at = t->n;
    BUF_LIT(t, "greenlet ");
    buf_u64(t, gid, 0);
    if (!empty) {
        if (nonempty(lab) && !default_name(lab, gid)) {
            BUF_LIT(t, " ");
            buf_put(t, t->p + e->lab_off, e->lab_len);
        }
        if (nonempty(fn)) {
            int same = same_text(fn, lab);
            if (same < 0) {
                return NULL;
            }
            if (!same) {
                BUF_LIT(t, " (");
                buf_put(t, t->p + e->fn_off, e->fn_len);
                BUF_LIT(t, ")");
            }
        }
    }
    e->who_off = at;
    e->who_len = t->n - at;
    if (t->failed) {
        PyErr_NoMemory();
        return NULL;
    }
    e->gid = gid;
    return e;
}

typedef struct {
    uint64_t greenlet_id;
    int64_t wall_ns, cpu_ns;
    uint64_t switches;
    int64_t first_ns, last_ns;
    uint64_t finished;
} gqp_render_grow;

_Static_assert(sizeof(gqp_render_grow) == 56, "_collect.GREENLET_ROW");

/* sort helpers: indexes into a row array, ties by index (stable) */
static const gqp_span *sort_spans;
static const gqp_render_grow *sort_grows;

static int by_start(const void *a, const void *b)
{
    size_t i = *(const size_t *)a, j = *(const size_t *)b;
    int64_t x = sort_spans[i].start_ns, y = sort_spans[j].start_ns;
    return x < y ? -1 : x > y ? 1 : (i > j) - (i < j);
}

static int by_wall_desc(const void *a, const void *b)
{
    size_t i = *(const size_t *)a, j = *(const size_t *)b;
    int64_t x = sort_spans[i].end_ns - sort_spans[i].start_ns;
    int64_t y = sort_spans[j].end_ns - sort_spans[j].start_ns;
    return x > y ? -1 : x < y ? 1 : (i > j) - (i < j);
}

static int by_gid(const void *a, const void *b)
{
    size_t i = *(const size_t *)a, j = *(const size_t *)b;
    uint64_t x = sort_grows[i].greenlet_id, y = sort_grows[j].greenlet_id;
    return x < y ? -1 : x > y ? 1 : (i > j) - (i < j);
}

static int by_cpu_wall_desc(const void *a, const void *b)
{
    size_t i = *(const size_t *)a, j = *(const size_t *)b;
    int64_t xc = sort_grows[i].cpu_ns < 0 ? 0 : sort_grows[i].cpu_ns;
    int64_t yc = sort_grows[j].cpu_ns < 0 ? 0 : sort_grows[j].cpu_ns;
    if (xc != yc) {
        return xc > yc ? -1 : 1;
    }
    int64_t xw = sort_grows[i].wall_ns, yw = sort_grows[j].wall_ns;
    return xw > yw ? -1 : xw < yw ? 1 : (i > j) - (i < j);
}

/* a dict field as a double; 0 (and no exception) when missing */
static int field_double(PyObject *d, PyObject *key, double *out)
{
    PyObject *v = PyDict_GetItem(d, key);
    if (!v || !PyFloat_Check(v)) {
        return 0;
    }
    *out = PyFloat_AS_DOUBLE(v);
    return 1;
}

static int64_t limit_arg(PyObject *o, int64_t all)
{
    if (o == Py_None) {
        return all;
    }
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    return v < 0 ? 0 : v;
}

static PyObject *render_rows_py(PyObject *self, PyObject *const *args,
                                Py_ssize_t nargs)
{
    (void)self;
    if (nargs < 6 || nargs > 8 || !PyDict_Check(args[0]) ||
        !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "render_rows(fields, raw, n_spans, "
                        "n_greenlets, safe, stack[, end[, name_safe]])");
        return NULL;
    }
    int end_marker = nargs >= 7 ? PyObject_IsTrue(args[6]) : 0;
    /* names and stacks are cleaned when records are built (_collect): the
     * caller's name_safe does the same for the text it is given */
    PyObject *name_safe = nargs == 8 ? args[7] : args[4];
    if (end_marker < 0) {
        return NULL;
    }
    PyObject *d = args[0], *raw = args[1], *safe = args[4],
             *stack_fn = args[5];
    if (PyTuple_GET_SIZE(raw) < 13) {
        Py_RETURN_NONE;
    }
    PyObject *span_rows = PyTuple_GET_ITEM(raw, 0);
    PyObject *grow_rows = PyTuple_GET_ITEM(raw, 1);
    PyObject *top = PyTuple_GET_ITEM(raw, 5);
    PyObject *names = PyTuple_GET_ITEM(raw, 11);
    PyObject *stacks = PyTuple_GET_ITEM(raw, 12);
    if (!PyBytes_Check(span_rows) || !PyBytes_Check(grow_rows) ||
        !PyDict_Check(names) || !PyTuple_Check(top) ||
        PyBytes_GET_SIZE(span_rows) % sizeof(gqp_span) ||
        PyBytes_GET_SIZE(grow_rows) % sizeof(gqp_render_grow)) {
        Py_RETURN_NONE;
    }
    long long wait_ns = PyLong_AsLongLong(PyTuple_GET_ITEM(raw, 4));
    int complete = PyObject_IsTrue(PyTuple_GET_ITEM(raw, 6));
    long long epoch0 = PyLong_AsLongLong(PyTuple_GET_ITEM(raw, 9));
    long long wall0 = PyLong_AsLongLong(PyTuple_GET_ITEM(raw, 10));
    PyObject *dropped_o = PyDict_GetItem(d, k_dropped_spans);
    long long dropped = dropped_o ? PyLong_AsLongLong(dropped_o) : 0;
    PyObject *pid_o = PyDict_GetItem(d, k_pid);
    long long pid = pid_o ? PyLong_AsLongLong(pid_o) : 0;
    double start_s = 0, end_s = 0, wall_s = 0;
    if (PyErr_Occurred() || complete < 0 ||
        !field_double(d, k_start, &start_s) ||
        !field_double(d, k_end, &end_s) || !field_double(d, k_wall, &wall_s)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }

    /* wait sites, when read_profile gave them (item 13: read_waits'
     * (records, stats, dropped, events, events dropped), read here as it
     * is, without a Python row per site): checked here, so that the text
     * is not half written when they are not as expected (None: the caller
     * renders in Python) */
    PyObject *wait_recs = NULL;
    const char *wait_stats = NULL;
    Py_ssize_t nw = 0;
    long long wait_dropped = 0;
    if (PyTuple_GET_SIZE(raw) > 13) {
        PyObject *w = PyTuple_GET_ITEM(raw, 13);
        if (!PyTuple_Check(w) || PyTuple_GET_SIZE(w) != 5 ||
            !(PyList_Check(PyTuple_GET_ITEM(w, 0)) ||
              PyTuple_Check(PyTuple_GET_ITEM(w, 0))) ||
            !PyBytes_Check(PyTuple_GET_ITEM(w, 1)) ||
            PyBytes_GET_SIZE(PyTuple_GET_ITEM(w, 1)) %
                sizeof(gqp_wait_stat) ||
            !PyLong_Check(PyTuple_GET_ITEM(w, 2))) {
            Py_RETURN_NONE;
        }
        wait_recs = PyTuple_GET_ITEM(w, 0);
        wait_stats = PyBytes_AS_STRING(PyTuple_GET_ITEM(w, 1));
        wait_dropped = PyLong_AsLongLong(PyTuple_GET_ITEM(w, 2));
        if (wait_dropped < 0) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        /* (zip(records, stats): the shorter decides) */
        nw = PyBytes_GET_SIZE(PyTuple_GET_ITEM(w, 1)) /
             (Py_ssize_t)sizeof(gqp_wait_stat);
        if (PySequence_Fast_GET_SIZE(wait_recs) < nw) {
            nw = PySequence_Fast_GET_SIZE(wait_recs);
        }
        for (Py_ssize_t i = 0; i < nw; i++) {
            /* a record: (code, fn, filename, line, stack), or None (the
             * registry dropped it) */
            PyObject *r = PySequence_Fast_GET_ITEM(wait_recs, i);
            if (r != Py_None &&
                (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 5 ||
                 !PyLong_Check(PyTuple_GET_ITEM(r, 3)))) {
                Py_RETURN_NONE;
            }
        }
    }

    /* rows, copied out aligned (one allocation for everything) */
    size_t ns = (size_t)PyBytes_GET_SIZE(span_rows) / sizeof(gqp_span);
    size_t ng = (size_t)PyBytes_GET_SIZE(grow_rows) /
                sizeof(gqp_render_grow);
    size_t bytes = ns * (sizeof(gqp_span) + 2 * sizeof(size_t) + 1) +
                   ng * (sizeof(gqp_render_grow) + 2 * sizeof(size_t) + 1) +
                   16;
    /* (the text and the names' texts start on the stack; the name table
     * too, up to 64 slots) */
    char text_array[8192], names_array[2048];
    gqp_name_ent ent_array[64];
    gqp_buf b;
    buf_init(&b, text_array, sizeof text_array);
    gqp_names_cache nc = {0};
    buf_init(&nc.text, names_array, sizeof names_array);
    PyObject *res = NULL;
    uint64_t block_array[1024];   /* (8 KB: ~100 spans and greenlets) */
    char *block = bytes <= sizeof block_array ? (char *)block_array
                                              : PyMem_Malloc(bytes);
    if (!block) {
        PyErr_NoMemory();
        goto done;
    }
    gqp_span *sp = (gqp_span *)block;
    gqp_render_grow *gr = (gqp_render_grow *)(sp + ns);
    size_t *order = (size_t *)(gr + ng);
    size_t *pick = order + ns;
    size_t *gorder = pick + ns;
    size_t *gpick = gorder + ng;
    char *shown = (char *)(gpick + ng);
    char *gshown = shown + ns;
    memset(shown, 0, ns + ng);
    memcpy(sp, PyBytes_AS_STRING(span_rows), ns * sizeof *sp);
    memcpy(gr, PyBytes_AS_STRING(grow_rows), ng * sizeof *gr);
    int64_t n_show = limit_arg(args[2], (int64_t)ns);
    int64_t g_show = limit_arg(args[3], (int64_t)ng);
    if (n_show < 0 || g_show < 0) {
        goto done;
    }
    /* (distinct ids among the lines shown: at most ng + the spans shown) */
    size_t ids = ng + ((size_t)n_show < ns ? (size_t)n_show : ns) + 1;
    size_t slots = 16;
    while (slots < 2 * ids && slots < ((size_t)1 << 24)) {
        slots *= 2;
    }
    if (slots <= sizeof ent_array / sizeof ent_array[0]) {
        for (size_t i = 0; i < slots; i++) {
            ent_array[i].gid = 0;
        }
        nc.ent = ent_array;
    } else {
        nc.ent = PyMem_Calloc(slots, sizeof *nc.ent);
    }
    nc.mask = slots - 1;
    nc.names = names;
    nc.safe = name_safe;
    if (!nc.ent) {
        PyErr_NoMemory();
        goto done;
    }
    buf_grow(&b, 1024 + 192 * (ids < 64 ? ids : 64));   /* (one growth) */

    /* spans in start order (as recorded, normally: then no sort); the
     * n_show longest of them shown */
    int sorted = 1;
    int64_t cpu_max = -1;
    for (size_t i = 0; i < ns; i++) {
        order[i] = i;
        sorted &= i == 0 || sp[i - 1].start_ns <= sp[i].start_ns;
        cpu_max = i == 0 || sp[i].cpu_ns > cpu_max ? sp[i].cpu_ns : cpu_max;
    }
    int any_span = ns > 0;
    if (!sorted) {
        sort_spans = sp;
        qsort(order, ns, sizeof *order, by_start);
    }
    if ((size_t)n_show >= ns) {
        memset(shown, 1, ns);
    } else if (n_show <= 64) {
        /* the n_show largest walls, ties to the earlier span: kept in a
         * small array sorted by (wall desc, position) */
        size_t m = 0;
        for (size_t k = 0; k < ns; k++) {
            const gqp_span *x = &sp[order[k]];
            int64_t w = x->end_ns - x->start_ns;
            size_t at = m;
            while (at > 0) {
                const gqp_span *y = &sp[order[pick[at - 1]]];
                if (y->end_ns - y->start_ns >= w) {
                    break;
                }
                at--;
            }
            if (at >= (size_t)n_show) {
                continue;
            }
            size_t last = m < (size_t)n_show ? m : (size_t)n_show - 1;
            memmove(pick + at + 1, pick + at, (last - at) * sizeof *pick);
            pick[at] = k;
            if (m < (size_t)n_show) {
                m++;
            }
        }
        for (size_t k = 0; k < m; k++) {
            shown[pick[k]] = 1;
        }
    } else {
        gqp_span *by_pos = PyMem_Malloc(ns * sizeof *by_pos);
        if (!by_pos) {
            PyErr_NoMemory();
            goto done;
        }
        for (size_t k = 0; k < ns; k++) {
            by_pos[k] = sp[order[k]];
            pick[k] = k;
        }
        sort_spans = by_pos;
        qsort(pick, ns, sizeof *pick, by_wall_desc);
        PyMem_Free(by_pos);
        for (int64_t k = 0; k < n_show; k++) {
            shown[pick[k]] = 1;
        }
    }

    /* greenlets by id; the g_show busiest of them shown */
    sorted = 1;
    long long total_cpu = 0;
    int any_cpu = 0;
    for (size_t i = 0; i < ng; i++) {
        gorder[i] = i;
        sorted &= i == 0 || gr[i - 1].greenlet_id <= gr[i].greenlet_id;
        if (gr[i].cpu_ns >= 0) {
            total_cpu += gr[i].cpu_ns;
            any_cpu = 1;
        }
    }
    if (!sorted) {
        sort_grows = gr;
        qsort(gorder, ng, sizeof *gorder, by_gid);
    }
    if ((size_t)g_show >= ng) {
        memset(gshown, 1, ng);
    } else {
        gqp_render_grow *by_pos = PyMem_Malloc(ng * sizeof *by_pos);
        if (!by_pos) {
            PyErr_NoMemory();
            goto done;
        }
        for (size_t k = 0; k < ng; k++) {
            by_pos[k] = gr[gorder[k]];
            gpick[k] = k;
        }
        sort_grows = by_pos;
        qsort(gpick, ng, sizeof *gpick, by_cpu_wall_desc);
        PyMem_Free(by_pos);
        for (int64_t k = 0; k < g_show; k++) {
            gshown[gpick[k]] = 1;
        }
    }

    /* the header */
    BUF_LIT(&b, ">>> Begin RequestProfile\n  Path: ");
    if (buf_safe(&b, PyDict_GetItem(d, k_path), 1024, safe) < 0) {
        goto done;
    }
    BUF_LIT(&b, "\n  Method: ");
    if (buf_safe(&b, PyDict_GetItem(d, k_method), 32, safe) < 0) {
        goto done;
    }
    BUF_LIT(&b, "\n  Status: ");
    if (buf_safe(&b, PyDict_GetItem(d, k_status), 64, safe) < 0) {
        goto done;
    }
    PyObject *rid = PyDict_GetItem(d, k_request_id);
    int has_rid = rid ? PyObject_IsTrue(rid) : 0;
    if (has_rid < 0) {
        goto done;
    }
    if (has_rid) {
        BUF_LIT(&b, "\n  Request id: ");
        if (buf_safe(&b, rid, 128, safe) < 0) {
            goto done;
        }
    }
    BUF_LIT(&b, "\n  Pid: ");
    if (pid < 0) {
        BUF_LIT(&b, "-");
        pid = -pid;
    }
    buf_u64(&b, (unsigned long long)pid, 0);
    BUF_LIT(&b, "\n  Start time: ");
    buf_utc(&b, start_s);
    BUF_LIT(&b, "\n  End time: ");
    buf_utc(&b, end_s);
    BUF_LIT(&b, "\n  Elapsed wall time: ");
    buf_ms(&b, 1, wall_s, 0);
    BUF_LIT(&b, "\n  Elapsed CPU time: ");
    buf_ms(&b, any_cpu, (double)total_cpu * 1e-9, 0);
    BUF_LIT(&b, "\n  Number of spans: ");
    buf_u64(&b, (unsigned long long)ns + (unsigned long long)dropped, 0);
    BUF_LIT(&b, "\n  Longest span CPU time: ");
    buf_ms(&b, any_span && cpu_max >= 0, (double)cpu_max * 1e-9, 0);
    BUF_LIT(&b, "\n  Greenlets: ");
    buf_u64(&b, ng, 0);
    if (dropped) {
        buf_printf(&b, "\n  Spans dropped (max_spans reached): %lld",
                   dropped);
    }
    PyObject *err = PyDict_GetItem(d, k_error);
    int has_err = err ? PyObject_IsTrue(err) : 0;
    if (has_err < 0) {
        goto done;
    }
    if (has_err) {
        BUF_LIT(&b, "\n  Error: ");
        if (buf_safe(&b, err, 300, safe) < 0) {
            goto done;
        }
    }

    /* one line per greenlet */
    if (ng && g_show > 0) {
        BUF_LIT(&b, "\nGreenlets (CPU, wall, switches):");
        for (size_t k = 0; k < ng; k++) {
            if (!gshown[k]) {
                continue;
            }
            const gqp_render_grow *g = &gr[gorder[k]];
            gqp_name_ent *e = g->greenlet_id ? names_get(&nc, g->greenlet_id)
                                             : NULL;
            if (!e) {
                goto done;
            }
            BUF_LIT(&b, "\n  ");
            buf_ms(&b, g->cpu_ns >= 0, (double)g->cpu_ns * 1e-9, 10);
            BUF_LIT(&b, " ");
            buf_ms(&b, 1, (double)g->wall_ns * 1e-9, 10);
            BUF_LIT(&b, " ");
            buf_u64(&b, g->switches, 6);
            BUF_LIT(&b, "  ");
            buf_put(&b, nc.text.p + e->who_off, e->who_len);
        }
        if ((size_t)g_show < ng) {
            buf_printf(&b, "\n  ... %lld more greenlets",
                       (long long)ng - (long long)g_show);
        }
    }

    /* the spans shown, in start order */
    long long shift = epoch0 - wall0;
    size_t n_shown = 0;
    for (size_t k = 0; k < ns; k++) {
        if (!shown[k]) {
            continue;
        }
        n_shown++;
        const gqp_span *s = &sp[order[k]];
        gqp_name_ent *e = s->greenlet_id ? names_get(&nc, s->greenlet_id)
                                         : NULL;
        if (!e) {
            goto done;
        }
        BUF_LIT(&b, "\nSpan(greenlet_id=");
        buf_u64(&b, s->greenlet_id, 0);
        BUF_LIT(&b, ", greenlet_name=");
        buf_put(&b, nc.text.p + e->lab_off, e->lab_len);
        double st = (double)(s->start_ns + shift) * 1e-9;
        double en = (double)(s->end_ns + shift) * 1e-9;
        double wall = (double)(s->end_ns - s->start_ns) * 1e-9;
        BUF_LIT(&b, ", start_time=");
        buf_1f(&b, st * 1000.0);
        BUF_LIT(&b, ", end_time=");
        buf_1f(&b, en * 1000.0);
        BUF_LIT(&b, ", duration=");
        buf_1f(&b, wall * 1000.0);
        BUF_LIT(&b, " ms, cpu=");
        buf_ms(&b, s->cpu_ns >= 0, (double)s->cpu_ns * 1e-9, 0);
        buf_puts(&b, (s->flags & GQP_SPAN_FINISHED)
                         ? ", finished=True, fn_name="
                         : ", finished=False, fn_name=");
        buf_put(&b, nc.text.p + e->fn_off, e->fn_len);
        BUF_LIT(&b, ", stack_trace=");
        PyObject *text = NULL;
        if (s->tag && stacks != Py_None && PyDict_Check(stacks)) {
            PyObject *key = PyLong_FromUnsignedLong(s->tag);
            text = key ? PyDict_GetItemWithError(stacks, key) : NULL;
            Py_XDECREF(key);
            if (!text && PyErr_Occurred()) {
                goto done;
            }
        }
        int has_stack = text ? PyObject_IsTrue(text) : 0;
        if (has_stack < 0) {
            goto done;
        }
        if (has_stack) {
            PyObject *r = PyObject_CallOneArg(stack_fn, text);
            Py_ssize_t n;
            const char *u = r && PyUnicode_Check(r)
                                ? PyUnicode_AsUTF8AndSize(r, &n) : NULL;
            if (u) {
                BUF_LIT(&b, "\n");
                buf_put(&b, u, (size_t)n);
                b.nonascii |= !PyUnicode_IS_ASCII(r);
            }
            Py_XDECREF(r);
            if (!u) {
                goto done;
            }
        } else {
            BUF_LIT(&b, "None");
        }
        BUF_LIT(&b, ")");
    }
    if (ns > n_shown) {
        buf_printf(&b, "\n... %zu more spans not shown (the %zu longest are "
                   "shown, in start order; report(spans=None) shows all)",
                   ns - n_shown, n_shown);
    }

    /* waiting (report._WAITING) */
    BUF_LIT(&b, "\nWaiting: ");
    buf_ms(&b, 1, (double)wait_ns * 1e-9, 0);
    BUF_LIT(&b, " with none of the request's greenlets running");
    if (!complete) {
        BUF_LIT(&b, " (history incomplete)");
    }
    int shown_top = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(top) && !shown_top; i++) {
        shown_top = !own_top_row(PyTuple_GET_ITEM(top, i));
    }
    if (shown_top) {
        BUF_LIT(&b, ", while these ran:");
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(top); i++) {
        PyObject *t = PyTuple_GET_ITEM(top, i);
        if (own_top_row(t)) {
            continue;
        }
        unsigned long long gid =
            PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 0));
        long long wns = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 1));
        if (PyErr_Occurred()) {
            goto done;
        }
        PyObject *n = PyTuple_GET_ITEM(t, 2);
        PyObject *name = NULL, *fn = NULL;
        if (PyTuple_Check(n) && PyTuple_GET_SIZE(n) == 2) {
            name = PyTuple_GET_ITEM(n, 0);
            fn = PyTuple_GET_ITEM(n, 1);
        }
        BUF_LIT(&b, "\n  ");
        buf_ms(&b, 1, (double)wns * 1e-9, 10);
        BUF_LIT(&b, "  ");
        if (buf_who(&b, gid, name, fn, name_safe) < 0) {
            goto done;
        }
    }
    /* wait sites, as report.render_waits prints them: the 5 largest,
     * ties in order */
    if (wait_recs) {
        Py_ssize_t top5[5];
        long long top5_ns[5];
        int m = 0;
        for (Py_ssize_t i = 0; i < nw; i++) {
            gqp_wait_stat st;
            memcpy(&st, wait_stats + i * sizeof st, sizeof st);
            long long wns = st.wait_ns;
            int at = m;
            while (at > 0 && top5_ns[at - 1] < wns) {
                at--;
            }
            if (at >= 5) {
                continue;
            }
            int last = m < 5 ? m : 4;
            for (int k = last; k > at; k--) {
                top5[k] = top5[k - 1];
                top5_ns[k] = top5_ns[k - 1];
            }
            top5[at] = i;
            top5_ns[at] = wns;
            if (m < 5) {
                m++;
            }
        }
        if (nw || wait_dropped) {
            BUF_LIT(&b, "\nWaited at: (top ");
            buf_u64(&b, (unsigned long long)m, 0);
            BUF_LIT(&b, " of ");
            buf_u64(&b, (unsigned long long)nw, 0);
            BUF_LIT(&b, " sites; time each greenlet of the request was "
                        "switched out there, summed)");
        }
        for (int k = 0; k < m; k++) {
            gqp_wait_stat st;
            memcpy(&st, wait_stats + top5[k] * sizeof st, sizeof st);
            PyObject *r = PySequence_Fast_GET_ITEM(wait_recs, top5[k]);
            PyObject *fn = NULL, *filename = NULL;
            long long line = 0;
            if (r != Py_None) {
                fn = PyTuple_GET_ITEM(r, 1);
                filename = PyTuple_GET_ITEM(r, 2);
                line = PyLong_AsLongLong(PyTuple_GET_ITEM(r, 3));
                if (line == -1 && PyErr_Occurred()) {
                    goto done;
                }
            }
            BUF_LIT(&b, "\n  ");
            buf_ms(&b, 1, (double)top5_ns[k] * 1e-9, 10);
            BUF_LIT(&b, " ");
            buf_u64(&b, (unsigned long long)st.count, 6);
            if (st.count == 1) {
                BUF_LIT(&b, " wait  ");
            } else {
                BUF_LIT(&b, " waits ");
            }
            buf_u64(&b, (unsigned long long)st.greenlets, 4);
            if (st.greenlets == 1) {
                BUF_LIT(&b, " greenlet   ");
            } else {
                BUF_LIT(&b, " greenlets  ");
            }
            /* (a dropped record: "?" and no file, as _collect.wait_sites) */
            if (fn == NULL) {
                BUF_LIT(&b, "?");
            } else if (buf_safe(&b, fn, 200, safe) < 0) {
                goto done;
            }
            BUF_LIT(&b, " (");
            if (filename != NULL &&
                buf_safe(&b, filename, 300, safe) < 0) {
                goto done;
            }
            BUF_LIT(&b, ":");
            if (line < 0) {
                BUF_LIT(&b, "-");
                line = -line;
            }
            buf_u64(&b, (unsigned long long)line, 0);
            BUF_LIT(&b, ")");
        }
        if (wait_dropped) {
            BUF_LIT(&b, "\n  (");
            buf_u64(&b, (unsigned long long)wait_dropped, 0);
            BUF_LIT(&b, " waits at further sites not recorded: the table of "
                        "sites was full)");
        }
    }
    if (end_marker) {
        BUF_LIT(&b, "\n<<< End RequestProfile");
    }
    if (b.failed) {
        PyErr_NoMemory();
        goto done;
    }
    if (b.nonascii || nc.text.nonascii) {
        res = PyUnicode_DecodeUTF8(b.p, (Py_ssize_t)b.n, "strict");
    } else {
        /* (the common case: plain ASCII, copied as it is) */
        res = PyUnicode_New((Py_ssize_t)b.n, 127);
        if (res) {
            memcpy(PyUnicode_1BYTE_DATA(res), b.p, b.n);
        }
    }
done:
    if (block != (char *)block_array) {
        PyMem_Free(block);
    }
    buf_free(&b);
    if (nc.ent != ent_array) {
        PyMem_Free(nc.ent);
    }
    buf_free(&nc.text);
    return res;
}

static PyMethodDef render_rows_def = {
    "render_rows", (PyCFunction)(void (*)(void))render_rows_py,
    METH_FASTCALL, "render_rows(fields, raw, n_spans, n_greenlets, safe, "
    "stack) (internal: greqprof.report)."};

/* Puts render_rows in _registry.  0 or -1.  Called from Python (cffi), so
 * it takes the GIL itself. */
static int gqp_render_init(void)
{
    PyGILState_STATE gs = PyGILState_Ensure();
    int rc = -1;
    struct { PyObject **s; const char *v; } strs[] = {
        {&str_greqprof_prefix, "greqprof."}, {&k_path, "path"},
        {&k_method, "method"}, {&k_status, "status"},
        {&k_request_id, "request_id"}, {&k_error, "error"}, {&k_pid, "pid"},
        {&k_dropped_spans, "dropped_spans"}, {&k_start, "start"},
        {&k_end, "end"}, {&k_wall, "wall"},
    };
    int ok = 1;
    for (size_t i = 0; i < sizeof strs / sizeof strs[0]; i++) {
        if (!*strs[i].s &&
            !(*strs[i].s = PyUnicode_InternFromString(strs[i].v))) {
            ok = 0;
        }
    }
    PyObject *reg = PyImport_ImportModule("greqprof._registry");
    PyObject *fn = PyCFunction_New(&render_rows_def, NULL);
    if (reg && fn && ok &&
        PyObject_SetAttrString(reg, "render_rows", fn) == 0) {
        rc = 0;
    }
    Py_XDECREF(reg);
    Py_XDECREF(fn);
    PyErr_Clear();
    PyGILState_Release(gs);
    return rc;
}
