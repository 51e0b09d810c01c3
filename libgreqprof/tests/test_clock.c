/* test_clock.c -- the real clocks, and the tracer's use of them. */
#define _POSIX_C_SOURCE 200809L

#include <time.h>

#include "harness.h"
#include "testutil.h"

static void sleep_ns(int64_t ns)
{
    struct timespec ts;
    ts.tv_sec = (time_t)(ns / 1000000000);
    ts.tv_nsec = (long)(ns % 1000000000);
    while (nanosleep(&ts, &ts) != 0) {
    }
}

/* Burns CPU until the thread CPU clock advanced by `ns` (or 10 s of wall
 * time passed).  Returns the CPU time consumed. */
static int64_t spin_cpu(int64_t ns)
{
    int64_t c0 = gqp_clock_thread_cpu_ns(), w0 = gqp_clock_wall_ns();
    volatile uint64_t x = 1;
    for (;;) {
        for (int i = 0; i < 10000; i++)
            x = x * 6364136223846793005u + 1;
        if (gqp_clock_thread_cpu_ns() - c0 >= ns)
            break;
        if (gqp_clock_wall_ns() - w0 > INT64_C(10000000000))
            break;
    }
    return gqp_clock_thread_cpu_ns() - c0;
}

TEST(clock_wall_monotonic)
{
    int64_t prev = gqp_clock_wall_ns();
    ASSERT_GT_I64(prev, 0);
    for (int i = 0; i < 10000; i++) {
        int64_t now = gqp_clock_wall_ns();
        ASSERT_GE_I64(now, prev);
        prev = now;
    }
}

TEST(clock_wall_advances_with_sleep)
{
    int64_t a = gqp_clock_wall_ns();
    sleep_ns(5000000);
    int64_t b = gqp_clock_wall_ns();
    ASSERT_GE_I64(b - a, 5000000);
    ASSERT_LT_I64(b - a, INT64_C(5000000000));
}

TEST(clock_epoch_matches_time)
{
    int64_t e = gqp_clock_epoch_ns();
    time_t now = time(NULL);
    ASSERT_NEAR_I64(e / 1000000000, (int64_t)now, 2);
    /* the real time clock also moves forward */
    sleep_ns(5000000);
    ASSERT_GE_I64(gqp_clock_epoch_ns() - e, 4000000);
}

TEST(clock_thread_cpu_advances_only_on_cpu)
{
    int64_t c0 = gqp_clock_thread_cpu_ns();
    ASSERT_GE_I64(c0, 0);
    int64_t w0 = gqp_clock_wall_ns();
    int64_t used = spin_cpu(20000000);
    int64_t w1 = gqp_clock_wall_ns();
    ASSERT_GE_I64(used, 20000000);
    /* one thread cannot use more CPU than elapsed wall time (small slack
     * for the clocks' different granularity) */
    ASSERT_LE_I64(used, (w1 - w0) + 2000000);

    int64_t c1 = gqp_clock_thread_cpu_ns();
    sleep_ns(50000000);
    int64_t c2 = gqp_clock_thread_cpu_ns();
    ASSERT_GE_I64(c2, c1);
    ASSERT_LT_I64(c2 - c1, 25000000);
}

TEST(clock_thread_cpu_monotonic)
{
    int64_t prev = gqp_clock_thread_cpu_ns();
    for (int i = 0; i < 2000; i++) {
        int64_t now = gqp_clock_thread_cpu_ns();
        ASSERT_GE_I64(now, prev);
        prev = now;
    }
}

/* A tracer without set_clocks uses gqp_clock_wall_ns for span times. */
TEST(tracer_uses_real_clocks_by_default)
{
    gqp_tracer *t = NULL;
    gqp_profile *p = new_profile();
    gqp_span s;
    ASSERT_OK(gqp_tracer_new(&t));
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_MODE, GQP_CPU_EXACT));
    ASSERT_OK(gqp_tracer_set_default(t, p));

    int64_t before = gqp_clock_wall_ns();
    EV(gqp_tracer_switch(t, 0, KG, 0));
    int64_t mid = gqp_clock_wall_ns();
    spin_cpu(3000000);
    sleep_ns(2000000);
    int64_t mid2 = gqp_clock_wall_ns();
    EV(gqp_tracer_switch(t, KG, KH, 0));
    int64_t after = gqp_clock_wall_ns();

    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 1);
    s = get_span(p, 0);
    ASSERT_GE_I64(s.start_ns, before);
    ASSERT_LE_I64(s.start_ns, mid);
    ASSERT_GE_I64(s.end_ns, mid2);
    ASSERT_LE_I64(s.end_ns, after);
    ASSERT_GE_I64(s.cpu_ns, 3000000);
    ASSERT_LE_I64(s.cpu_ns, s.end_ns - s.start_ns + 2000000);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* set_clocks(NULL, NULL) restores the real clocks. */
TEST(tracer_set_clocks_null_restores_real)
{
    fake_clock c;
    gqp_profile *p;
    gqp_span s;
    fc_init(&c);
    c.wall = 42; /* far from the real monotonic clock */
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_OFF, GQP_CLOCK_WALL, &p);
    ASSERT_OK(gqp_tracer_set_clocks(t, NULL, NULL, NULL));

    int64_t before = gqp_clock_wall_ns();
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_switch(t, KG, KH, 0));
    int64_t after = gqp_clock_wall_ns();
    s = get_span(p, 0);
    ASSERT_GE_I64(s.start_ns, before);
    ASSERT_LE_I64(s.end_ns, after);
    ASSERT_EQ_U64(c.wall_reads, 0);
    ASSERT_EQ_U64(c.cpu_reads, 0);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* Profile origins: epoch_origin - wall_origin converts the wall domain of
 * spans to epoch time. */
TEST(profile_origins_convert_to_epoch)
{
    int64_t w_before = gqp_clock_wall_ns();
    gqp_profile *p = new_profile();
    int64_t w_after = gqp_clock_wall_ns();
    int64_t wo = gqp_profile_wall_origin(p);
    int64_t eo = gqp_profile_epoch_origin(p);

    ASSERT_GE_I64(wo, w_before);
    ASSERT_LE_I64(wo, w_after);
    ASSERT_NEAR_I64(eo, gqp_clock_epoch_ns(), INT64_C(2000000000));

    /* converting "now" in the wall domain must land close to epoch now */
    int64_t wnow = gqp_clock_wall_ns();
    int64_t enow = gqp_clock_epoch_ns();
    ASSERT_NEAR_I64(eo + wnow - wo, enow, INT64_C(50000000));
    /* stable */
    ASSERT_EQ_I64(gqp_profile_wall_origin(p), wo);
    ASSERT_EQ_I64(gqp_profile_epoch_origin(p), eo);
    gqp_profile_free(p);
}
