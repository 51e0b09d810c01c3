/* test_version.c -- version macros against the loaded library. */
#include <stdio.h>

#include "harness.h"

/* Deliberately the first test run: a header/library mismatch makes every
 * other result meaningless. */
TEST_FIRST(version_macros_match_library)
{
    char buf[64];

    ASSERT_EQ_U64(gqp_version(), GQP_VERSION_NUMBER);
    ASSERT_NOT_NULL(gqp_version_string());
    ASSERT_STREQ(gqp_version_string(), GQP_VERSION_STRING);

    ASSERT_EQ_U64(GQP_VERSION_NUMBER, GQP_VERSION_MAJOR * 10000 +
                                          GQP_VERSION_MINOR * 100 +
                                          GQP_VERSION_PATCH);
    snprintf(buf, sizeof buf, "%d.%d.%d", GQP_VERSION_MAJOR,
             GQP_VERSION_MINOR, GQP_VERSION_PATCH);
    ASSERT_STREQ(GQP_VERSION_STRING, buf);
    ASSERT_EQ_U64(gqp_version() / 10000, GQP_VERSION_MAJOR);
    ASSERT_EQ_U64(gqp_version() / 100 % 100, GQP_VERSION_MINOR);
    ASSERT_EQ_U64(gqp_version() % 100, GQP_VERSION_PATCH);
}

TEST(version_string_is_stable)
{
    const char *a = gqp_version_string();
    const char *b = gqp_version_string();
    ASSERT_EQ_PTR(a, b);
    ASSERT_EQ_U64(gqp_version(), gqp_version());
}
