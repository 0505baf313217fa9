/* bulk_alloc.c — a bulk allocation loop through the C ABI: a worker takes
 * batches of 4 KiB pages from its per-thread handle, writes them, and gives
 * them back; then small batches through the header's inline fast paths
 * (iopages_fast_*, no library call while the handle's cache can serve);
 * then it checks that nothing leaked.
 *
 * Build: cc bulk_alloc.c $(pkg-config --cflags --libs iopages) -o bulk_alloc
 */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <iopages.h>

#define BATCH 64
#define ROUNDS 20000

int main(void) {
    iopages_config cfg;
    iopages_config_default(&cfg);
    cfg.size_bytes = 32 << 20;
    iopages_allocator *a;
    int rc = iopages_allocator_create(&cfg, &a);
    if (rc) {
        fprintf(stderr, "iopages_allocator_create: %d %s\n", rc, iopages_last_error());
        return 1;
    }
    iopages_local *l;
    if (iopages_local_create(a, &l)) return 1;

    void *pages[BATCH];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int r = 0; r < ROUNDS; r++) {
        ptrdiff_t n = iopages_local_alloc_bulk_ptrs(l, IOPAGES_GFP_KERNEL, pages, BATCH);
        if (n != BATCH) {
            fprintf(stderr, "short batch: %td (%s)\n", n, iopages_last_error());
            return 1;
        }
        for (int i = 0; i < BATCH; i++) memset(pages[i], r & 0xff, 64);
        if (iopages_local_free_bulk_ptrs(l, pages, BATCH)) {
            fprintf(stderr, "free: %s\n", iopages_last_error());
            return 1;
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ns = (double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec);
    printf("bulk_alloc: %d pages in batches of %d, %.1f ns per page\n", ROUNDS * BATCH, BATCH,
           ns / (ROUNDS * BATCH));

    /* Small batches: the inline fast paths over the handle's cache view. */
    const iopages_local_fast *f = iopages_local_fast_path(l);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int r = 0; r < ROUNDS; r++) {
        if (iopages_fast_alloc_bulk_ptrs(f, IOPAGES_GFP_KERNEL, pages, 8) != 8) {
            fprintf(stderr, "short batch (%s)\n", iopages_last_error());
            return 1;
        }
        for (int i = 0; i < 8; i++) memset(pages[i], r & 0xff, 64);
        if (iopages_fast_free_bulk_ptrs(f, pages, 8)) {
            fprintf(stderr, "free: %s\n", iopages_last_error());
            return 1;
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    ns = (double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec);
    printf("bulk_alloc: %d pages in batches of 8 inline, %.1f ns per page\n", ROUNDS * 8, ns / (ROUNDS * 8));

    iopages_local_destroy(l);
    iopages_accounting acc;
    if (iopages_leak_check(a, &acc)) {
        fprintf(stderr, "leak: %s\n", iopages_last_error());
        return 1;
    }
    printf("bulk_alloc: no leaks (%llu pages free)\n", (unsigned long long)acc.total_pages);
    return iopages_allocator_destroy(a) ? 1 : 0;
}
