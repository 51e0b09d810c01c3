/* test_errors.c -- gqp_strerror / gqp_err_name for every code. */
#include <limits.h>

#include "harness.h"

static const struct {
    int code;
    const char *name;
} k_codes[] = {
    {GQP_OK, "GQP_OK"},           {GQP_EINVAL, "GQP_EINVAL"},
    {GQP_ENOMEM, "GQP_ENOMEM"},   {GQP_ESTATE, "GQP_ESTATE"},
    {GQP_ERANGE, "GQP_ERANGE"},   {GQP_EHANDLE, "GQP_EHANDLE"},
    {GQP_ENOTFOUND, "GQP_ENOTFOUND"}, {GQP_ELIMIT, "GQP_ELIMIT"},
};
#define NCODES (sizeof k_codes / sizeof k_codes[0])

static const int k_unknown[] = {1, 2, 42, -8, GQP__ELAST - 1, -100, -1000,
                                INT_MIN, INT_MAX, INT_MIN + 1};
#define NUNKNOWN (sizeof k_unknown / sizeof k_unknown[0])

TEST(error_codes_have_fixed_numbers)
{
    /* "Fixed numbers: part of the ABI." */
    ASSERT_EQ_I64(GQP_OK, 0);
    ASSERT_EQ_I64(GQP_EINVAL, -1);
    ASSERT_EQ_I64(GQP_ENOMEM, -2);
    ASSERT_EQ_I64(GQP_ESTATE, -3);
    ASSERT_EQ_I64(GQP_ERANGE, -4);
    ASSERT_EQ_I64(GQP_EHANDLE, -5);
    ASSERT_EQ_I64(GQP_ENOTFOUND, -6);
    ASSERT_EQ_I64(GQP_ELIMIT, -7);
    ASSERT_EQ_I64(GQP__ELAST, -7);
    ASSERT_EQ_U64(NCODES, 1 - GQP__ELAST);
}

TEST(err_name_every_code)
{
    for (size_t i = 0; i < NCODES; i++)
        ASSERT_STREQ(gqp_err_name(k_codes[i].code), k_codes[i].name);
}

TEST(strerror_every_code)
{
    for (size_t i = 0; i < NCODES; i++) {
        const char *s = gqp_strerror(k_codes[i].code);
        ASSERT_NOT_NULL(s);
        ASSERT_TRUE(s[0] != '\0');
        ASSERT_STRNE(s, "unknown error");
        /* static: the same pointer every time */
        ASSERT_EQ_PTR(s, gqp_strerror(k_codes[i].code));
        for (size_t j = 0; j < i; j++)
            ASSERT_STRNE(s, gqp_strerror(k_codes[j].code));
    }
}

TEST(strerror_unknown_codes)
{
    for (size_t i = 0; i < NUNKNOWN; i++)
        ASSERT_STREQ(gqp_strerror(k_unknown[i]), "unknown error");
}

TEST(err_name_unknown_codes)
{
    /* The header only documents names of known codes; an unknown code must
     * still give a usable, non-empty string that names no real code. */
    for (size_t i = 0; i < NUNKNOWN; i++) {
        const char *s = gqp_err_name(k_unknown[i]);
        ASSERT_NOT_NULL(s);
        ASSERT_TRUE(s[0] != '\0');
        for (size_t j = 0; j < NCODES; j++)
            ASSERT_STRNE(s, k_codes[j].name);
    }
}
