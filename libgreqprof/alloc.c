/* alloc.c -- the library's allocator indirection (see gqp_set_allocator). */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

static void *libc_malloc(void *ctx, size_t n)
{
    (void)ctx;
    return malloc(n);
}

static void *libc_realloc(void *ctx, void *p, size_t n)
{
    (void)ctx;
    return realloc(p, n);
}

static void libc_free(void *ctx, void *p)
{
    (void)ctx;
    free(p);
}

static gqp_allocator current = {libc_malloc, libc_realloc, libc_free, NULL};

GQP_API int gqp_set_allocator(const gqp_allocator *a)
{
    if (!a) {
        current.malloc_fn = libc_malloc;
        current.realloc_fn = libc_realloc;
        current.free_fn = libc_free;
        current.ctx = NULL;
        return GQP_OK;
    }
    if (!a->malloc_fn || !a->realloc_fn || !a->free_fn) {
        return GQP_EINVAL;
    }
    current = *a;
    return GQP_OK;
}

void *gqp__malloc(size_t n)
{
    return current.malloc_fn(current.ctx, n ? n : 1);
}

void *gqp__calloc(size_t count, size_t size)
{
    if (size && count > SIZE_MAX / size) {
        return NULL;
    }
    size_t n = count * size;
    void *p = gqp__malloc(n);
    if (p) {
        memset(p, 0, n ? n : 1);
    }
    return p;
}

void *gqp__realloc(void *p, size_t n)
{
    return current.realloc_fn(current.ctx, p, n ? n : 1);
}

void gqp__free(void *p)
{
    if (p) {
        current.free_fn(current.ctx, p);
    }
}
