/* _hooks/faults.c -- allocation failure injection (tests only).
 * A part of _hooks.c (one translation unit, see there). */
#include "hooks.h"

/* ---- fault injection (tests only) ------------------------------------ */
/* After `after` more successful allocations, the next `count` fail.  The
 * failing allocator frees with free(), so memory from before stays valid. */
static long gqp__fail_after = -1;
static long gqp__fail_count = 0;

static void *failing_malloc(void *ctx, size_t n)
{
    (void)ctx;
    if (gqp__fail_after == 0 && gqp__fail_count > 0) {
        gqp__fail_count--;
        return NULL;
    }
    if (gqp__fail_after > 0) {
        gqp__fail_after--;
    }
    return malloc(n);
}

static void *failing_realloc(void *ctx, void *p, size_t n)
{
    (void)ctx;
    if (gqp__fail_after == 0 && gqp__fail_count > 0) {
        gqp__fail_count--;
        return NULL;
    }
    if (gqp__fail_after > 0) {
        gqp__fail_after--;
    }
    return realloc(p, n);
}

static void plain_free(void *ctx, void *p)
{
    (void)ctx;
    free(p);
}

static int gqp_py_inject_alloc_failures(long after, long count)
{
    PyGILState_STATE gs = PyGILState_Ensure();
    int rc;
    if (count <= 0) {
        rc = gqp_set_allocator(NULL);
        gqp__fail_after = -1;
        gqp__fail_count = 0;
    } else {
        static const gqp_allocator failing = {failing_malloc, failing_realloc,
                                              plain_free, NULL};
        gqp__fail_after = after;
        gqp__fail_count = count;
        rc = gqp_set_allocator(&failing);
    }
    PyGILState_Release(gs);
    return rc;
}

static long gqp_py_alloc_failures_left(void)
{
    return gqp__fail_count;
}
