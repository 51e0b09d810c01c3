/* clock.c -- the library's clocks, in nanoseconds. */
#define _POSIX_C_SOURCE 200809L
#include "internal.h"

#include <time.h>

static int64_t read_clock(clockid_t id)
{
    struct timespec ts;
    if (clock_gettime(id, &ts) != 0) {
        return -1;
    }
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

GQP_API int64_t gqp_clock_wall_ns(void)
{
#ifdef CLOCK_MONOTONIC
    return read_clock(CLOCK_MONOTONIC);
#else
    return read_clock(CLOCK_REALTIME);
#endif
}

GQP_API int64_t gqp_clock_epoch_ns(void)
{
    return read_clock(CLOCK_REALTIME);
}

GQP_API int64_t gqp_clock_thread_cpu_ns(void)
{
    int64_t v = -1;
#ifdef CLOCK_THREAD_CPUTIME_ID
    v = read_clock(CLOCK_THREAD_CPUTIME_ID);
#endif
#ifdef CLOCK_PROCESS_CPUTIME_ID
    if (v < 0) {
        v = read_clock(CLOCK_PROCESS_CPUTIME_ID);
    }
#endif
    if (v < 0) {
        /* Last resort, portable C: process CPU time at clock() resolution. */
        v = (int64_t)((double)clock() * (1e9 / CLOCKS_PER_SEC));
    }
    return v;
}
