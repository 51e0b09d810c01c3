/*
 * harness.h -- a tiny test harness for libgreqprof (libuv/cmark style).
 *
 *   TEST(name) { ... }        defines and registers a test (any test_*.c)
 *   TEST_FIRST(name) { ... }  same, but sorted before every TEST
 *
 * Tests register themselves from a constructor, so adding a test_*.c file to
 * the build is enough.  main.c sorts them (TEST_FIRST first, then by file
 * name and line) and runs each one in its own forked child, so a crash or a
 * failed assertion in one test cannot hide the others.
 *
 * Every assertion prints the expression and both values, then ends the test.
 * Event functions return flags >= 0; wrap them in EV(...) to assert success
 * and keep the flags.
 */
#ifndef GQP_TEST_HARNESS_H
#define GQP_TEST_HARNESS_H

#include <inttypes.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "greqprof.h"

typedef void (*harness_test_fn)(void);

void harness_register(const char *name, harness_test_fn fn, const char *file,
                      int line, int prio);
#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 3, 4)))
#endif
_Noreturn void harness_fail(const char *file, int line, const char *fmt, ...);
/* Prints a note (prefixed with the test location) without failing. */
#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 3, 4)))
#endif
void harness_note(const char *file, int line, const char *fmt, ...);

#define TEST_PRIO_(name, prio)                                              \
    static void test_##name(void);                                          \
    __attribute__((constructor)) static void harness_reg_##name(void)       \
    {                                                                       \
        harness_register(#name, test_##name, __FILE__, __LINE__, (prio));   \
    }                                                                       \
    static void test_##name(void)

#define TEST(name) TEST_PRIO_(name, 100)
#define TEST_FIRST(name) TEST_PRIO_(name, 0)

#define FAIL(...) harness_fail(__FILE__, __LINE__, __VA_ARGS__)
#define NOTE(...) harness_note(__FILE__, __LINE__, __VA_ARGS__)

#define ASSERT_TRUE(x)                                                      \
    do {                                                                    \
        if (!(x))                                                           \
            FAIL("ASSERT_TRUE(%s) failed", #x);                             \
    } while (0)

#define ASSERT_FALSE(x)                                                     \
    do {                                                                    \
        if (x)                                                              \
            FAIL("ASSERT_FALSE(%s) failed", #x);                            \
    } while (0)

#define ASSERT_CMP_I64_(a, op, b, name)                                     \
    do {                                                                    \
        int64_t ha_ = (int64_t)(a), hb_ = (int64_t)(b);                     \
        if (!(ha_ op hb_))                                                  \
            FAIL(name "(%s, %s): %" PRId64 " vs %" PRId64, #a, #b, ha_,     \
                 hb_);                                                      \
    } while (0)

#define ASSERT_CMP_U64_(a, op, b, name)                                     \
    do {                                                                    \
        uint64_t ha_ = (uint64_t)(a), hb_ = (uint64_t)(b);                  \
        if (!(ha_ op hb_))                                                  \
            FAIL(name "(%s, %s): %" PRIu64 " (0x%" PRIx64 ") vs %" PRIu64   \
                      " (0x%" PRIx64 ")",                                   \
                 #a, #b, ha_, ha_, hb_, hb_);                               \
    } while (0)

#define ASSERT_EQ_I64(a, b) ASSERT_CMP_I64_(a, ==, b, "ASSERT_EQ_I64")
#define ASSERT_NE_I64(a, b) ASSERT_CMP_I64_(a, !=, b, "ASSERT_NE_I64")
#define ASSERT_LT_I64(a, b) ASSERT_CMP_I64_(a, <, b, "ASSERT_LT_I64")
#define ASSERT_LE_I64(a, b) ASSERT_CMP_I64_(a, <=, b, "ASSERT_LE_I64")
#define ASSERT_GT_I64(a, b) ASSERT_CMP_I64_(a, >, b, "ASSERT_GT_I64")
#define ASSERT_GE_I64(a, b) ASSERT_CMP_I64_(a, >=, b, "ASSERT_GE_I64")
#define ASSERT_EQ_U64(a, b) ASSERT_CMP_U64_(a, ==, b, "ASSERT_EQ_U64")
#define ASSERT_NE_U64(a, b) ASSERT_CMP_U64_(a, !=, b, "ASSERT_NE_U64")
#define ASSERT_LE_U64(a, b) ASSERT_CMP_U64_(a, <=, b, "ASSERT_LE_U64")
#define ASSERT_GE_U64(a, b) ASSERT_CMP_U64_(a, >=, b, "ASSERT_GE_U64")
#define ASSERT_EQ_SIZE(a, b) ASSERT_EQ_U64(a, b)

/* |a - b| <= tol */
#define ASSERT_NEAR_I64(a, b, tol)                                          \
    do {                                                                    \
        int64_t ha_ = (int64_t)(a), hb_ = (int64_t)(b),                     \
                ht_ = (int64_t)(tol);                                       \
        int64_t hd_ = ha_ > hb_ ? ha_ - hb_ : hb_ - ha_;                    \
        if (hd_ > ht_)                                                      \
            FAIL("ASSERT_NEAR_I64(%s, %s, %s): %" PRId64 " vs %" PRId64     \
                 " differ by %" PRId64 " > %" PRId64,                       \
                 #a, #b, #tol, ha_, hb_, hd_, ht_);                         \
    } while (0)

#define ASSERT_STREQ(a, b)                                                  \
    do {                                                                    \
        const char *ha_ = (a), *hb_ = (b);                                  \
        if (ha_ == NULL || hb_ == NULL || strcmp(ha_, hb_) != 0)            \
            FAIL("ASSERT_STREQ(%s, %s): \"%s\" vs \"%s\"", #a, #b,          \
                 ha_ ? ha_ : "(NULL)", hb_ ? hb_ : "(NULL)");               \
    } while (0)

#define ASSERT_STRNE(a, b)                                                  \
    do {                                                                    \
        const char *ha_ = (a), *hb_ = (b);                                  \
        if (ha_ == NULL || hb_ == NULL || strcmp(ha_, hb_) == 0)            \
            FAIL("ASSERT_STRNE(%s, %s): \"%s\" vs \"%s\"", #a, #b,          \
                 ha_ ? ha_ : "(NULL)", hb_ ? hb_ : "(NULL)");               \
    } while (0)

#define ASSERT_NULL(x)                                                      \
    do {                                                                    \
        const void *hp_ = (const void *)(x);                                \
        if (hp_ != NULL)                                                    \
            FAIL("ASSERT_NULL(%s): %p", #x, hp_);                           \
    } while (0)

#define ASSERT_NOT_NULL(x)                                                  \
    do {                                                                    \
        if ((const void *)(x) == NULL)                                      \
            FAIL("ASSERT_NOT_NULL(%s): NULL", #x);                          \
    } while (0)

#define ASSERT_EQ_PTR(a, b)                                                 \
    do {                                                                    \
        const void *ha_ = (const void *)(a), *hb_ = (const void *)(b);      \
        if (ha_ != hb_)                                                     \
            FAIL("ASSERT_EQ_PTR(%s, %s): %p vs %p", #a, #b, ha_, hb_);      \
    } while (0)

/* rc == GQP_OK, printing the error's name otherwise. */
#define ASSERT_OK(rc)                                                       \
    do {                                                                    \
        int hr_ = (rc);                                                     \
        if (hr_ != GQP_OK)                                                  \
            FAIL("ASSERT_OK(%s): %d %s (%s)", #rc, hr_, gqp_err_name(hr_),  \
                 gqp_strerror(hr_));                                        \
    } while (0)

/* rc == expected error code, both printed by name. */
#define ASSERT_RC(rc, expected)                                             \
    do {                                                                    \
        int hr_ = (rc), he_ = (expected);                                   \
        if (hr_ != he_)                                                     \
            FAIL("ASSERT_RC(%s, %s): got %d %s, expected %d %s", #rc,       \
                 #expected, hr_, gqp_err_name(hr_), he_,                    \
                 gqp_err_name(he_));                                        \
    } while (0)

/* rc is one of two codes (used where the header allows either). */
#define ASSERT_RC2(rc, e1, e2)                                              \
    do {                                                                    \
        int hr_ = (rc), h1_ = (e1), h2_ = (e2);                             \
        if (hr_ != h1_ && hr_ != h2_)                                       \
            FAIL("ASSERT_RC2(%s, %s, %s): got %d %s", #rc, #e1, #e2, hr_,   \
                 gqp_err_name(hr_));                                        \
    } while (0)

#define ASSERT_HAS_FLAG(v, flag)                                            \
    do {                                                                    \
        long long hv_ = (long long)(v), hf_ = (long long)(flag);            \
        if (hv_ < 0 || (hv_ & hf_) != hf_)                                  \
            FAIL("ASSERT_HAS_FLAG(%s, %s): value 0x%llx lacks 0x%llx", #v,  \
                 #flag, hv_, hf_);                                          \
    } while (0)

#define ASSERT_NO_FLAG(v, flag)                                             \
    do {                                                                    \
        long long hv_ = (long long)(v), hf_ = (long long)(flag);            \
        if (hv_ < 0 || (hv_ & hf_) != 0)                                    \
            FAIL("ASSERT_NO_FLAG(%s, %s): value 0x%llx has 0x%llx", #v,     \
                 #flag, hv_, hf_);                                          \
    } while (0)

static inline int harness_ev_(int rc, const char *expr, const char *file,
                              int line)
{
    if (rc < 0)
        harness_fail(file, line, "EV(%s): %d %s (%s)", expr, rc,
                     gqp_err_name(rc), gqp_strerror(rc));
    return rc;
}

/* Asserts an event function succeeded (result >= 0) and yields its flags. */
#define EV(expr) harness_ev_((expr), #expr, __FILE__, __LINE__)

#endif /* GQP_TEST_HARNESS_H */
