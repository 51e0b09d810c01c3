/*
 * main.c -- runner of the libgreqprof C test suite (see harness.h, README.md).
 *
 *   ./gqp_tests [FILTER]   run every test whose name contains FILTER
 *   ./gqp_tests --list     list the tests
 *
 * Each test runs in a forked child; the parent reports "ok"/"FAIL" per test
 * and finishes with the line "N passed, N failed".  The exit status is 0 only
 * when no test failed (and at least one ran).
 *
 * Environment:
 *   GQP_TEST_NOFORK=1    run tests in-process (for debuggers); a failed
 *                        assertion longjmps back to the runner.
 *   GQP_TEST_TIMEOUT=S   per-test timeout in seconds (default 120; 0 = none).
 */
#define _POSIX_C_SOURCE 200809L

#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

typedef struct harness_test {
    const char *name;
    harness_test_fn fn;
    const char *file;
    int line;
    int prio;
} harness_test;

static harness_test *g_tests;
static size_t g_ntests, g_cap;
static int g_nofork;
static jmp_buf g_jmp;
static const char *g_current;

void harness_register(const char *name, harness_test_fn fn, const char *file,
                      int line, int prio)
{
    for (size_t i = 0; i < g_ntests; i++) {
        if (strcmp(g_tests[i].name, name) == 0) {
            fprintf(stderr, "harness: duplicate test name %s (%s:%d, %s:%d)\n",
                    name, g_tests[i].file, g_tests[i].line, file, line);
            abort();
        }
    }
    if (g_ntests == g_cap) {
        size_t cap = g_cap ? g_cap * 2 : 64;
        harness_test *n = realloc(g_tests, cap * sizeof *n);
        if (n == NULL) {
            fprintf(stderr, "harness: out of memory\n");
            abort();
        }
        g_tests = n;
        g_cap = cap;
    }
    g_tests[g_ntests].name = name;
    g_tests[g_ntests].fn = fn;
    g_tests[g_ntests].file = file;
    g_tests[g_ntests].line = line;
    g_tests[g_ntests].prio = prio;
    g_ntests++;
}

static const char *base_name(const char *path)
{
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

void harness_fail(const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    fprintf(stdout, "  %s:%d: [%s] ", base_name(file), line,
            g_current ? g_current : "?");
    va_start(ap, fmt);
    vfprintf(stdout, fmt, ap);
    va_end(ap);
    fputc('\n', stdout);
    fflush(stdout);
    if (g_nofork)
        longjmp(g_jmp, 1);
    exit(1);
}

void harness_note(const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    fprintf(stdout, "  note %s:%d: [%s] ", base_name(file), line,
            g_current ? g_current : "?");
    va_start(ap, fmt);
    vfprintf(stdout, fmt, ap);
    va_end(ap);
    fputc('\n', stdout);
    fflush(stdout);
}

static int cmp_tests(const void *a, const void *b)
{
    const harness_test *x = a, *y = b;
    int c;
    if (x->prio != y->prio)
        return x->prio < y->prio ? -1 : 1;
    c = strcmp(base_name(x->file), base_name(y->file));
    if (c != 0)
        return c;
    return (x->line > y->line) - (x->line < y->line);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Returns 1 on success. */
static int run_forked(const harness_test *t, unsigned timeout, char *why,
                      size_t whylen)
{
    pid_t pid, w;
    int status;

    fflush(stdout);
    fflush(stderr);
    pid = fork();
    if (pid < 0) {
        snprintf(why, whylen, "fork failed");
        return 0;
    }
    if (pid == 0) {
        signal(SIGALRM, SIG_DFL);
        if (timeout)
            alarm(timeout);
        g_current = t->name;
        t->fn();
        fflush(stdout);
        exit(0); /* exit, not _exit: lets LeakSanitizer/valgrind check */
    }
    do {
        w = waitpid(pid, &status, 0);
    } while (w < 0);
    if (WIFEXITED(status)) {
        if (WEXITSTATUS(status) == 0)
            return 1;
        snprintf(why, whylen, "exit status %d", WEXITSTATUS(status));
        return 0;
    }
    if (WIFSIGNALED(status)) {
        int sig = WTERMSIG(status);
        snprintf(why, whylen, "killed by signal %d (%s)%s", sig,
                 strsignal(sig), sig == SIGALRM ? " -- timeout" : "");
        return 0;
    }
    snprintf(why, whylen, "unexpected wait status 0x%x", status);
    return 0;
}

static int run_inproc(const harness_test *t, char *why, size_t whylen)
{
    g_current = t->name;
    if (setjmp(g_jmp) != 0) {
        snprintf(why, whylen, "assertion failed");
        gqp_set_allocator(NULL); /* process-wide: don't leak into others */
        return 0;
    }
    t->fn();
    gqp_set_allocator(NULL);
    return 1;
}

int main(int argc, char **argv)
{
    const char *filter = NULL;
    const char *env;
    unsigned timeout = 120;
    int passed = 0, failed = 0, list = 0;

    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--list") == 0)
            list = 1;
        else if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            printf("usage: %s [--list] [FILTER]\n", argv[0]);
            return 0;
        } else
            filter = argv[i];
    }
    env = getenv("GQP_TEST_NOFORK");
    g_nofork = env != NULL && *env != '\0' && strcmp(env, "0") != 0;
    env = getenv("GQP_TEST_TIMEOUT");
    if (env != NULL && *env != '\0')
        timeout = (unsigned)strtoul(env, NULL, 10);

    if (g_ntests > 1)
        qsort(g_tests, g_ntests, sizeof *g_tests, cmp_tests);

    if (list) {
        for (size_t i = 0; i < g_ntests; i++)
            printf("%s\t%s:%d\n", g_tests[i].name, base_name(g_tests[i].file),
                   g_tests[i].line);
        free(g_tests);
        return 0;
    }

    printf("libgreqprof %s tests\n", gqp_version_string());
    for (size_t i = 0; i < g_ntests; i++) {
        const harness_test *t = &g_tests[i];
        char why[160] = "";
        double t0;
        int ok;

        if (filter != NULL && strstr(t->name, filter) == NULL)
            continue;
        t0 = now_s();
        ok = g_nofork ? run_inproc(t, why, sizeof why)
                      : run_forked(t, timeout, why, sizeof why);
        if (ok) {
            passed++;
            printf("ok   %-48s %7.3fs\n", t->name, now_s() - t0);
        } else {
            failed++;
            printf("FAIL %-48s %s (%s:%d)\n", t->name, why,
                   base_name(t->file), t->line);
        }
        fflush(stdout);
    }
    g_current = NULL;
    free(g_tests); /* valgrind runs with --show-leak-kinds=all */
    g_tests = NULL;
    g_ntests = g_cap = 0;
    if (passed + failed == 0)
        fprintf(stderr, "no test matches \"%s\"\n", filter ? filter : "");
    printf("%d passed, %d failed\n", passed, failed);
    fflush(stdout);
    return (failed == 0 && passed > 0) ? 0 : 1;
}
