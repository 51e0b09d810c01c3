/* spans.c -- bounded span storage.
 * KEEP_FIRST stores the first `cap` spans (a request's timeline from its
 * start); KEEP_LAST is a ring of the most recent ones (long-running
 * profiles).  Either way overflow is only counted, and the longest spans are
 * remembered separately so they survive being dropped. */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

void gqp__spans_init(gqp__spans *s, size_t cap, int policy)
{
    memset(s, 0, sizeof *s);
    s->cap = cap;
    s->policy = policy;
}

void gqp__spans_free(gqp__spans *s)
{
    gqp__free(s->buf);
    s->buf = NULL;
    s->alloc = 0;
    gqp__spans_clear(s);
}

void gqp__spans_clear(gqp__spans *s)
{
    s->len = 0;
    s->head = 0;
    s->dropped = 0;
    s->have_longest = false;
}

static void note_longest(gqp__spans *s, const gqp_span *span)
{
    int64_t wall = span->end_ns - span->start_ns;
    if (!s->have_longest) {
        s->longest = *span;
        s->longest_cpu = *span;
        s->have_longest = true;
        return;
    }
    if (wall > s->longest.end_ns - s->longest.start_ns) {
        s->longest = *span;
    }
    if (span->cpu_ns > s->longest_cpu.cpu_ns) {
        s->longest_cpu = *span;
    }
}

static bool reserve(gqp__spans *s)
{
    if (s->len < s->alloc) {
        return true;
    }
    size_t n = s->alloc ? s->alloc * 2 : 64;
    if (n > s->cap) {
        n = s->cap;
    }
    gqp_span *nb = gqp__realloc(s->buf, n * sizeof *nb);
    if (!nb) {
        return false;
    }
    s->buf = nb;
    s->alloc = n;
    return true;
}

size_t gqp__spans_push(gqp__spans *s, const gqp_span *span)
{
    note_longest(s, span);
    if (s->len < s->cap) {
        if (!reserve(s)) {
            s->dropped++;
            return SIZE_MAX;
        }
        /* Until the ring is full, head stays 0 and slots are in order. */
        s->buf[s->len] = *span;
        return s->len++;
    }
    s->dropped++;
    if (s->policy != GQP_KEEP_LAST || s->cap == 0) {
        return SIZE_MAX;
    }
    s->buf[s->head] = *span;
    s->head = (s->head + 1) % s->cap;
    return s->len - 1;
}

gqp_span *gqp__spans_at(const gqp__spans *s, size_t i)
{
    if (i >= s->len) {
        return NULL;
    }
    /* Writes wrap at cap (alloc may be larger after caps were lowered by a
     * clear); before the ring is full head is 0. */
    return &s->buf[(s->head + i) % s->cap];
}
