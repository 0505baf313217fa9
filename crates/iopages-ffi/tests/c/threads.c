/* threads.c — several threads allocate and free at once (shared calls,
 * bulk calls, per-thread handles, a shared mempool) and bump one per-CPU
 * counter; at the end nothing leaked and the counter is exact. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "iopages.h"

#define THREADS 8
#define ROUNDS 2000

#define CHECK(cond)                                                                                    \
    do {                                                                                               \
        if (!(cond)) {                                                                                 \
            fprintf(stderr, "%s:%d: check failed: %s (%s)\n", __FILE__, __LINE__, #cond, iopages_last_error()); \
            exit(1);                                                                                   \
        }                                                                                              \
    } while (0)

static iopages_allocator *a;
static iopages_mempool *pool;
static iopages_counter *counter;
static iopages_counter *limited;

static void *worker(void *arg) {
    unsigned id = (unsigned)(uintptr_t)arg;
    iopages_local *l;
    CHECK(iopages_local_create(a, &l) == 0);
    iopages_page v[32];
    void *ptrs[16];
    for (int r = 0; r < ROUNDS; r++) {
        iopages_page p;
        CHECK(iopages_alloc_pages(a, r % 3, IOPAGES_GFP_KERNEL, &p) == 0);
        char *addr = iopages_page_address(a, p);
        addr[0] = (char)id;
        CHECK(iopages_free_pages(a, p, r % 3) == 0);
        ptrdiff_t n = iopages_alloc_pages_bulk(a, IOPAGES_GFP_KERNEL, v, 32);
        CHECK(n == 32);
        CHECK(iopages_free_pages_bulk(a, v, 32) == 0);
        n = iopages_local_alloc_bulk_ptrs(l, IOPAGES_GFP_KERNEL, ptrs, 16);
        CHECK(n == 16);
        for (int i = 0; i < 16; i++) *(volatile char *)ptrs[i] = 1;
        CHECK(iopages_local_free_bulk_ptrs(l, ptrs, 16) == 0);
        void *e;
        CHECK(iopages_mempool_alloc(pool, IOPAGES_GFP_NOIO, &e) == 0);
        CHECK(iopages_mempool_free(pool, e) == 0);
        CHECK(iopages_counter_add(counter, 1) == 0);
        iopages_counter_limited_add(limited, 5000, 1);
    }
    CHECK(iopages_local_destroy(l) == 0);
    return NULL;
}

int main(void) {
    iopages_config cfg;
    iopages_config_default(&cfg);
    cfg.size_bytes = 64 << 20;
    cfg.huge_pages = IOPAGES_HUGE_NEVER;
    cfg.checks = 1;
    CHECK(iopages_allocator_create(&cfg, &a) == 0);
    CHECK(iopages_mempool_create_pages(a, 0, 8, &pool) == 0);
    CHECK(iopages_counter_create(0, 0, 0, &counter) == 0);
    CHECK(iopages_counter_create(0, 0, 0, &limited) == 0);
    pthread_t t[THREADS];
    for (unsigned i = 0; i < THREADS; i++) pthread_create(&t[i], NULL, worker, (void *)(uintptr_t)i);
    for (unsigned i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
    CHECK(iopages_counter_sum(counter) == THREADS * ROUNDS);
    CHECK(iopages_counter_sum(limited) == 5000);
    CHECK(iopages_mempool_destroy(pool) == 0);
    iopages_accounting acc;
    int rc = iopages_leak_check(a, &acc);
    CHECK(rc == 0 && acc.in_use_pages == 0);
    CHECK(iopages_allocator_destroy(a) == 0);
    iopages_counter_destroy(counter);
    iopages_counter_destroy(limited);
    printf("threads: ok (%d threads x %d rounds)\n", THREADS, ROUNDS);
    return 0;
}
