/* map.c -- a u64 -> u64 hash map with linear probing.
 * Deletion shifts entries back instead of leaving tombstones, so lookups
 * stay short in tables with heavy churn (greenlets come and go). */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

static inline size_t slot_of(uint64_t key, size_t mask)
{
    /* Fibonacci hashing: object addresses have zero low bits. */
    return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 17) & mask;
}

void gqp__map_init(gqp__map *m)
{
    memset(m, 0, sizeof *m);
}

void gqp__map_init_buf(gqp__map *m, uint64_t *keys, uint64_t *vals,
                       size_t cap)
{
    memset(keys, 0, cap * sizeof *keys);
    m->keys = keys;
    m->vals = vals;
    m->cap = cap;
    m->len = 0;
    m->borrowed = true;
}

void gqp__map_free(gqp__map *m)
{
    if (!m->borrowed) {
        gqp__free(m->keys);
        gqp__free(m->vals);
    }
    gqp__map_init(m);
}

void gqp__map_clear(gqp__map *m)
{
    if (m->cap) {
        memset(m->keys, 0, m->cap * sizeof *m->keys);
    }
    m->len = 0;
}

static bool grow(gqp__map *m)
{
    size_t ncap = m->cap ? m->cap * 2 : 16;
    uint64_t *nk = gqp__calloc(ncap, sizeof *nk);
    uint64_t *nv = gqp__malloc(ncap * sizeof *nv);
    if (!nk || !nv) {
        gqp__free(nk);
        gqp__free(nv);
        return false;
    }
    size_t mask = ncap - 1;
    for (size_t i = 0; i < m->cap; i++) {
        if (m->keys[i]) {
            size_t j = slot_of(m->keys[i], mask);
            while (nk[j]) {
                j = (j + 1) & mask;
            }
            nk[j] = m->keys[i];
            nv[j] = m->vals[i];
        }
    }
    if (!m->borrowed) {
        gqp__free(m->keys);
        gqp__free(m->vals);
    }
    m->keys = nk;
    m->vals = nv;
    m->cap = ncap;
    m->borrowed = false;
    return true;
}

uint64_t *gqp__map_put(gqp__map *m, uint64_t key, bool *added)
{
    *added = false;
    if (key == 0) {
        return NULL;
    }
    uint64_t *v = gqp__map_get(m, key);
    if (v) {
        return v;
    }
    /* Keep the load factor under 1/2. */
    if ((m->len + 1) * 2 > m->cap && !grow(m)) {
        return NULL;
    }
    size_t mask = m->cap - 1;
    size_t i = slot_of(key, mask);
    while (m->keys[i]) {
        i = (i + 1) & mask;
    }
    m->keys[i] = key;
    m->vals[i] = 0;
    m->len++;
    *added = true;
    return &m->vals[i];
}

bool gqp__map_del(gqp__map *m, uint64_t key)
{
    if (m->cap == 0 || key == 0) {
        return false;
    }
    size_t mask = m->cap - 1;
    size_t i = slot_of(key, mask);
    while (m->keys[i] != key) {
        if (m->keys[i] == 0) {
            return false;
        }
        i = (i + 1) & mask;
    }
    /* Backward-shift: move later members of the cluster into the hole when
     * their home slot does not lie cyclically in (hole, j]. */
    size_t hole = i;
    for (size_t j = (i + 1) & mask; m->keys[j]; j = (j + 1) & mask) {
        size_t home = slot_of(m->keys[j], mask);
        bool in_range = hole <= j ? (hole < home && home <= j)
                                  : (hole < home || home <= j);
        if (!in_range) {
            m->keys[hole] = m->keys[j];
            m->vals[hole] = m->vals[j];
            hole = j;
        }
    }
    m->keys[hole] = 0;
    m->len--;
    return true;
}
