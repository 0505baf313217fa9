/* api.c — every call of iopages.h once, and its error paths. Exit 0 and
 * "api: ok" when every check holds; the first failed check is printed. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "iopages.h"

#define CHECK(cond)                                                                              \
    do {                                                                                         \
        if (!(cond)) {                                                                           \
            fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
                    iopages_last_error());                                                       \
            exit(1);                                                                             \
        }                                                                                        \
    } while (0)

static iopages_allocator *make(int checks) {
    iopages_config cfg;
    CHECK(iopages_config_default(&cfg) == 0);
    cfg.size_bytes = 16 << 20;
    cfg.huge_pages = IOPAGES_HUGE_NEVER;
    cfg.checks = checks;
    iopages_allocator *a = NULL;
    CHECK(iopages_allocator_create(&cfg, &a) == 0 && a);
    return a;
}

static void allocator_calls(void) {
    iopages_config cfg;
    iopages_allocator *a = NULL;
    /* Bad settings and NULLs. */
    CHECK(iopages_config_default(NULL) == -EINVAL);
    CHECK(iopages_config_default(&cfg) == 0);
    cfg.size_bytes = 5 << 20; /* not a multiple of 4 MiB */
    CHECK(iopages_allocator_create(&cfg, &a) == -EINVAL && a == NULL);
    CHECK(strstr(iopages_last_error(), "arena size") != NULL);
    cfg.size_bytes = 8 << 20;
    cfg.huge_pages = 7;
    CHECK(iopages_allocator_create(&cfg, &a) == -EINVAL);
    CHECK(iopages_allocator_create(&cfg, NULL) == -EINVAL);
    CHECK(iopages_version()[0] != '\0');

    a = make(1);
    CHECK(iopages_allocator_checks(a) == 1);
    CHECK(iopages_allocator_nr_pages(a) == 4096);
    CHECK(iopages_allocator_nr_pages(NULL) == 0);

    /* Single pages and blocks. */
    iopages_page p = 0, q = 0;
    CHECK(iopages_alloc_pages(a, 0, IOPAGES_GFP_KERNEL | IOPAGES_GFP_ZERO, &p) == 0 && p != 0);
    char *addr = iopages_page_address(a, p);
    CHECK(addr != NULL && ((uintptr_t)addr & 4095) == 0);
    for (int i = 0; i < 4096; i++) CHECK(addr[i] == 0);
    memset(addr, 0xab, 4096);
    CHECK(iopages_address_page(a, addr + 100, &q) == 0 && q == p);
    CHECK(iopages_page_pfn(p) == p - 1);
    int on_stack;
    CHECK(iopages_address_page(a, &on_stack, &q) == -EINVAL); /* outside the arena */
    CHECK(iopages_address_page(a, addr, NULL) == -EINVAL);
    CHECK(iopages_page_address(a, 0) == NULL);
    CHECK(iopages_page_address(a, 999999) == NULL);
    CHECK(iopages_free_pages(a, p, 0) == 0);
    CHECK(iopages_free_pages(a, p, 0) == -EINVAL); /* double free, caught by checks */
    CHECK(strstr(iopages_last_error(), "double free") != NULL);
    CHECK(iopages_free_pages(a, 0, 0) == -EINVAL);
    CHECK(iopages_free_pages(a, 1u << 30, 0) == -EINVAL);
    CHECK(iopages_alloc_pages(a, 11, IOPAGES_GFP_KERNEL, &p) == -EINVAL);
    CHECK(iopages_alloc_pages(a, 0, 1u << 30, &p) == -EINVAL); /* unknown gfp bits */
    CHECK(iopages_alloc_pages(NULL, 0, IOPAGES_GFP_KERNEL, &p) == -EINVAL);
    CHECK(iopages_alloc_pages(a, 0, IOPAGES_GFP_KERNEL, NULL) == -EINVAL);
    CHECK(iopages_alloc_pages(a, 3, IOPAGES_GFP_KERNEL | IOPAGES_GFP_COMP, &p) == 0);
    CHECK(iopages_free_pages(a, p, 2) == -EINVAL); /* a folio freed with the wrong order */
    CHECK(iopages_free_pages(a, p + 1, 3) == -EINVAL); /* not aligned */
    CHECK(iopages_free_pages(a, p, 3) == 0);
    /* Exhaustion: a 4 MiB block at a time until none is left. */
    iopages_page big[8];
    int nbig = 0;
    while (nbig < 8 && iopages_alloc_pages(a, 10, IOPAGES_GFP_NOWAIT, &big[nbig]) == 0) nbig++;
    CHECK(nbig >= 1 && nbig < 8);
    CHECK(iopages_alloc_pages(a, 10, IOPAGES_GFP_NOWAIT, &p) == -ENOMEM);
    for (int i = 0; i < nbig; i++) CHECK(iopages_free_pages(a, big[i], 10) == 0);

    /* Bulk. */
    iopages_page v[64];
    memset(v, 0xff, sizeof v);
    CHECK(iopages_alloc_pages_bulk(a, IOPAGES_GFP_KERNEL, v, 64) == 64);
    for (int i = 0; i < 64; i++) CHECK(v[i] != 0 && iopages_page_address(a, v[i]) != NULL);
    iopages_page bad[2] = {v[0], 0};
    CHECK(iopages_free_pages_bulk(a, bad, 2) == -EINVAL); /* nothing freed */
    CHECK(iopages_free_pages_bulk(a, v, 64) == 0);
    CHECK(iopages_free_pages_bulk(a, v, 1) == -EINVAL); /* double free */
    CHECK(iopages_free_pages_bulk(a, NULL, 0) == 0);
    CHECK(iopages_free_pages_bulk(a, NULL, 3) == -EINVAL);
    CHECK(iopages_alloc_pages_bulk(a, IOPAGES_GFP_KERNEL, NULL, 3) == -EINVAL);

    /* Destroy with a page out: refused, the allocator stays usable. */
    iopages_accounting acc;
    CHECK(iopages_alloc_pages(a, 0, IOPAGES_GFP_KERNEL, &p) == 0);
    CHECK(iopages_leak_check(a, &acc) == -EBUSY && acc.in_use_pages == 1);
    CHECK(iopages_allocator_destroy(a) == -EBUSY);
    CHECK(strstr(iopages_last_error(), "still allocated") != NULL);
    CHECK(iopages_free_pages(a, p, 0) == 0);
    CHECK(iopages_leak_check(a, &acc) == 0 && acc.in_use_pages == 0 && acc.total_pages == 4096);

    /* Statistics. */
    iopages_stats st;
    CHECK(iopages_stats_get(a, &st) == 0 && st.total_pages == 4096 && st.bulk_alloc_calls >= 1);
    CHECK(iopages_stats_get(a, NULL) == -EINVAL);
    char small[8];
    ptrdiff_t need = iopages_stats_text(a, small, sizeof small);
    CHECK(need > 8 && strlen(small) == 7);
    char *text = malloc((size_t)need + 1);
    CHECK(iopages_stats_text(a, text, (size_t)need + 1) == need && strlen(text) == (size_t)need);
    free(text);
    CHECK(iopages_allocator_destroy(a) == 0);
    CHECK(iopages_allocator_destroy(NULL) == 0);

    /* Without checks: the fast setting; bounds are still checked. */
    a = make(0);
    CHECK(iopages_allocator_checks(a) == 0);
    CHECK(iopages_free_pages(a, 0, 0) == -EINVAL);
    CHECK(iopages_free_pages(a, 5000, 0) == -EINVAL);
    CHECK(iopages_allocator_destroy(a) == 0);
}

static void local_calls(void) {
    iopages_allocator *a = make(1);
    iopages_local *l = NULL;
    CHECK(iopages_local_create(a, &l) == 0 && l);
    CHECK(iopages_local_create(NULL, &l) == -EINVAL);
    iopages_page p;
    CHECK(iopages_local_alloc_pages(l, 0, IOPAGES_GFP_KERNEL, &p) == 0);
    CHECK(iopages_local_free_pages(l, p, 0) == 0);
    CHECK(iopages_local_free_pages(l, p, 0) == -EINVAL);
    CHECK(iopages_local_alloc_pages(l, 2, IOPAGES_GFP_KERNEL, &p) == 0);
    CHECK(iopages_local_free_pages(l, p, 2) == 0);
    iopages_page v[100];
    CHECK(iopages_local_alloc_bulk(l, IOPAGES_GFP_KERNEL, v, 100) == 100);
    CHECK(iopages_local_free_bulk(l, v, 100) == 0);
    CHECK(iopages_local_free_bulk(l, v, 1) == -EINVAL);
    char *one = iopages_local_alloc_page_ptr(l, IOPAGES_GFP_KERNEL);
    CHECK(one != NULL && ((uintptr_t)one & 4095) == 0);
    one[4095] = 1;
    CHECK(iopages_local_free_page_ptr(l, one + 1) == -EINVAL);
    CHECK(iopages_local_free_page_ptr(l, one) == 0);
    CHECK(iopages_local_free_page_ptr(l, one) == -EINVAL); /* double free */
    CHECK(iopages_local_free_page_ptr(l, NULL) == -EINVAL);
    CHECK(iopages_local_alloc_page_ptr(NULL, IOPAGES_GFP_KERNEL) == NULL);
    void *ptrs[32];
    CHECK(iopages_local_alloc_bulk_ptrs(l, IOPAGES_GFP_KERNEL, ptrs, 32) == 32);
    for (int i = 0; i < 32; i++) {
        CHECK(((uintptr_t)ptrs[i] & 4095) == 0);
        memset(ptrs[i], i, 4096);
    }
    void *saved = ptrs[3];
    ptrs[3] = (char *)ptrs[3] + 8; /* not a page start */
    CHECK(iopages_local_free_bulk_ptrs(l, ptrs, 32) == -EINVAL);
    ptrs[3] = saved;
    CHECK(iopages_local_free_bulk_ptrs(l, ptrs, 32) == 0);
    CHECK(iopages_local_free_bulk_ptrs(l, ptrs, 1) == -EINVAL); /* double free */
    CHECK(iopages_local_destroy(l) == 0);
    CHECK(iopages_local_destroy(NULL) == 0);
    CHECK(iopages_leak_check(a, NULL) == 0);
    CHECK(iopages_allocator_destroy(a) == 0);
}

static void mempool_calls(void) {
    iopages_allocator *a = make(1);
    iopages_mempool *pp = NULL, *op = NULL;
    CHECK(iopages_mempool_create_pages(a, 0, 16, &pp) == 0);
    CHECK(iopages_mempool_create_pages(a, 11, 16, &pp) == -EINVAL);
    CHECK(iopages_mempool_element_size(pp) == 4096);
    void *e = NULL;
    CHECK(iopages_mempool_alloc(pp, IOPAGES_GFP_NOIO, &e) == 0 && e);
    memset(e, 1, 4096);
    CHECK(iopages_mempool_destroy(pp) == -EBUSY); /* an element is out */
    CHECK(iopages_mempool_free(pp, (char *)e + 1) == -EINVAL);
    CHECK(iopages_mempool_free(pp, e) == 0);
    CHECK(iopages_mempool_free(pp, e) == -EINVAL); /* more frees than allocations */
    iopages_page pg;
    CHECK(iopages_mempool_alloc_page(pp, IOPAGES_GFP_NOIO, &pg) == 0);
    CHECK(iopages_mempool_free_page(pp, pg) == 0);
    void *v[40];
    CHECK(iopages_mempool_alloc_bulk(pp, IOPAGES_GFP_NOIO, v, 40) == -EINVAL); /* > min_nr, could wait for ever */
    CHECK(iopages_mempool_alloc_bulk(pp, IOPAGES_GFP_NOIO, v, 16) == 16);
    CHECK(iopages_mempool_free_bulk(pp, v, 16) == 0);
    CHECK(iopages_mempool_alloc_bulk(pp, IOPAGES_GFP_NOWAIT, v, 40) == 40);
    CHECK(iopages_mempool_free_bulk(pp, v, 40) == 0);
    iopages_mempool_stats ms;
    CHECK(iopages_mempool_stats_get(pp, &ms) == 0 && ms.min_nr == 16 && ms.reserve_len == 16 && ms.out == 0);

    /* Objects with a budget of 8 live objects, 4 of them in reserve. */
    CHECK(iopages_mempool_create_objects(0, 0, 4, 0, &op) == -EINVAL);
    CHECK(iopages_mempool_create_objects(100, 3, 4, 0, &op) == -EINVAL);
    CHECK(iopages_mempool_create_objects(100, 64, 4, 2, &op) == -EINVAL);
    CHECK(iopages_mempool_create_objects(100, 64, 4, 8, &op) == 0);
    CHECK(iopages_mempool_element_size(op) == 100);
    CHECK(iopages_mempool_alloc_page(op, IOPAGES_GFP_NOIO, &pg) == -EINVAL);
    void *o[16];
    int n = 0;
    while (n < 16 && iopages_mempool_alloc(op, IOPAGES_GFP_NOWAIT, &o[n]) == 0) {
        CHECK(((uintptr_t)o[n] & 63) == 0);
        memset(o[n], n, 100);
        n++;
    }
    CHECK(n == 8); /* the budget: 4 fresh + the 4 in reserve */
    CHECK(iopages_mempool_alloc(op, IOPAGES_GFP_NOWAIT, &o[8]) == -ENOMEM);
    CHECK(iopages_mempool_stats_get(op, &ms) == 0 && ms.failures >= 1 && ms.reserve_len == 0);
    CHECK(iopages_mempool_free_bulk(op, o, 8) == 0);
    /* Not blocking: what the source gives (4 under the budget); the
     * reserve (4) serves only if it can fill every missing element. */
    CHECK(iopages_mempool_alloc_bulk(op, IOPAGES_GFP_NOWAIT, o, 16) == 4);
    CHECK(iopages_mempool_free_bulk(op, o, 4) == 0);
    CHECK(iopages_mempool_alloc_bulk(op, IOPAGES_GFP_NOWAIT, o, 8) == 8); /* 4 + the whole reserve */
    CHECK(iopages_mempool_free_bulk(op, o, 8) == 0);
    CHECK(iopages_mempool_destroy(op) == 0);
    CHECK(iopages_allocator_destroy(a) == -EBUSY); /* the page pool's reserve */
    CHECK(iopages_mempool_destroy(pp) == 0);
    CHECK(iopages_allocator_destroy(a) == 0);
}

static void counter_calls(void) {
    iopages_counter *c = NULL;
    CHECK(iopages_counter_create(10, 0, 0, &c) == 0);
    CHECK(iopages_counter_add(c, 5) == 0);
    CHECK(iopages_counter_sum(c) == 15);
    int64_t bound;
    CHECK(iopages_counter_error_bound(c, &bound) == 0 && bound >= 0);
    int64_t r = iopages_counter_read(c);
    CHECK(r >= 15 - bound && r <= 15 + bound);
    CHECK(iopages_counter_compare(c, 15) == 0 && iopages_counter_compare(c, 100) == -1 &&
          iopages_counter_compare(c, -100) == 1);
    CHECK(iopages_counter_limited_add(c, 20, 5) == 1);
    CHECK(iopages_counter_limited_add(c, 20, 1) == 0);
    CHECK(iopages_counter_set(c, -3) == 0);
    CHECK(iopages_counter_sum(c) == -3 && iopages_counter_sum_positive(c) == 0 &&
          iopages_counter_read_positive(c) == 0);
    CHECK(iopages_counter_destroy(c) == 0);
    CHECK(iopages_counter_create(0, 4, 8, &c) == 0);
    CHECK(iopages_counter_destroy(c) == 0);
    CHECK(iopages_counter_create(0, 0, -5, &c) == -EINVAL);
    CHECK(iopages_counter_add(NULL, 1) == -EINVAL);
    CHECK(iopages_counter_compare(NULL, 1) == -EINVAL);
}

static void kvmalloc_calls(void) {
    iopages_allocator *a = make(1);
    iopages_kvmalloc *kv = NULL;
    CHECK(iopages_kvmalloc_create(a, &kv) == 0);
    void *small = NULL, *large = NULL;
    CHECK(iopages_kvmalloc_alloc(kv, 3 * 4096, IOPAGES_GFP_KERNEL | IOPAGES_GFP_ZERO, IOPAGES_KV_FAIL_FAST, &small) == 0);
    for (int i = 0; i < 3 * 4096; i++) CHECK(((char *)small)[i] == 0);
    CHECK(iopages_kvmalloc_is_contiguous(kv, small) == 1);
    CHECK(iopages_kvmalloc_alloc(kv, 6 << 20, IOPAGES_GFP_KERNEL, IOPAGES_KV_LEGACY, &large) == 0);
    memset(large, 7, 6 << 20);
    CHECK(iopages_kvmalloc_is_contiguous(kv, large) == 0);
    CHECK(iopages_kvmalloc_alloc(kv, 0, IOPAGES_GFP_KERNEL, 0, &small) == -EINVAL);
    CHECK(iopages_kvmalloc_alloc(kv, 4096, IOPAGES_GFP_KERNEL, 9, &small) == -EINVAL);
    CHECK(iopages_kvmalloc_destroy(kv) == -EBUSY);
    CHECK(iopages_kvfree(kv, large) == 0);
    CHECK(iopages_kvfree(kv, large) == -EINVAL); /* double free */
    CHECK(iopages_kvfree(kv, (char *)small + 1) == -EINVAL);
    CHECK(iopages_kvfree(kv, small) == 0);
    CHECK(iopages_kvfree(kv, NULL) == 0);
    CHECK(iopages_kvmalloc_destroy(kv) == 0);
    CHECK(iopages_allocator_destroy(a) == 0);
}

static void folio_bio_calls(void) {
    iopages_allocator *a = make(1);
    iopages_folio_buffer *b = NULL;
    size_t len = 256 * 1024 + 4096;
    CHECK(iopages_folio_buffer_create(a, IOPAGES_GFP_KERNEL, len, 4, &b) == 0);
    CHECK(iopages_folio_buffer_create(a, IOPAGES_GFP_KERNEL, len, 11, &b) == -EINVAL);
    CHECK(iopages_folio_buffer_len(b) == len);
    size_t nf = iopages_folio_buffer_nr_folios(b);
    CHECK(nf >= 5);
    size_t total = 0;
    for (size_t i = 0; i < nf; i++) {
        void *p;
        size_t n;
        CHECK(iopages_folio_buffer_chunk(b, i, &p, &n) == 0);
        memset(p, (int)i, n);
        total += n;
    }
    CHECK(total == len);
    CHECK(iopages_folio_buffer_chunk(b, nf, NULL, NULL) == -EINVAL);
    char *src = malloc(len), *dst = malloc(len);
    for (size_t i = 0; i < len; i++) src[i] = (char)(i * 7);
    CHECK(iopages_folio_buffer_copy_from(b, src, len) == 0);
    CHECK(iopages_folio_buffer_copy_from(b, src, len + 1) == -EINVAL);
    CHECK(iopages_folio_buffer_copy_to(b, dst, len) == 0 && memcmp(src, dst, len) == 0);

    iopages_bio *bio = NULL;
    CHECK(iopages_bio_from_buffer(b, 0, len + 1, 0, 0, &bio) == -EINVAL);
    CHECK(iopages_bio_from_buffer(b, 0, len, 1, 0, &bio) == -E2BIG);
    CHECK(iopages_bio_from_buffer(b, 512, len - 512, 0, 0, &bio) == 0);
    CHECK(iopages_bio_len(bio) == len - 512);
    size_t ns = iopages_bio_nr_segments(bio);
    CHECK(ns >= 5);
    struct iovec iov[64];
    CHECK(iopages_bio_iovecs(bio, iov, 1) == -ENOSPC);
    CHECK(iopages_bio_iovecs(bio, iov, 64) == (ptrdiff_t)ns);
    size_t at = 512;
    for (size_t i = 0; i < ns; i++) {
        CHECK(memcmp(iov[i].iov_base, src + at, iov[i].iov_len) == 0);
        at += iov[i].iov_len;
    }
    CHECK(at == len);
    char desc[4096];
    CHECK(iopages_bio_describe(bio, desc, sizeof desc) > 0 && strstr(desc, "offset 512") != NULL);
    CHECK(iopages_folio_buffer_destroy(b) == -EBUSY); /* pinned by the bio */
    CHECK(iopages_bio_release(bio) == 0);
    CHECK(iopages_bio_release(NULL) == 0);

    /* A bio over pages from the bulk API. */
    iopages_page v[8];
    CHECK(iopages_alloc_pages_bulk(a, IOPAGES_GFP_KERNEL, v, 8) == 8);
    CHECK(iopages_bio_from_pages(a, v, 8, 0, 8 * 4096, 0, 0, &bio) == 0);
    CHECK(iopages_bio_len(bio) == 8 * 4096);
    CHECK(iopages_free_pages(a, v[0], 0) == -EBUSY); /* pinned */
    CHECK(iopages_bio_release(bio) == 0);
    CHECK(iopages_free_pages_bulk(a, v, 8) == 0);
    iopages_page bogus[1] = {999999};
    CHECK(iopages_bio_from_pages(a, bogus, 1, 0, 4096, 0, 0, &bio) == -EINVAL);

    CHECK(iopages_folio_buffer_destroy(b) == 0);
    free(src);
    free(dst);
    CHECK(iopages_allocator_destroy(a) == 0);
}

/* The header's inline fast paths: the same pages and errors as the
 * exported calls, no counts, the full path taken where the cache cannot serve (empty,
 * full, checks on, careful or unknown flags), nothing freed on a bad
 * address, and the accounting exact afterwards. */
static void fast_calls(void) {
    for (int checks = 0; checks <= 1; checks++) {
        iopages_allocator *a = make(checks);
        iopages_local *l = NULL;
        CHECK(iopages_local_create(a, &l) == 0);
        CHECK(iopages_local_fast_path(NULL) == NULL);
        const iopages_local_fast *f = iopages_local_fast_path(l);
        /* Checks on: both bounds shut (every call takes the library's
         * checked path); off: the floor is 0 and frees go up to cap. */
        CHECK(f != NULL && f->local == l);
        CHECK(*f->floor == (checks ? SIZE_MAX : 0) && (f->cap == 0) == (checks == 1));
        iopages_stats s0, s1;
        /* Empty cache: the first call takes the full path and fills it. */
        char *p = iopages_fast_alloc_page_ptr(f, IOPAGES_GFP_KERNEL);
        CHECK(p != NULL && ((uintptr_t)p & 4095) == 0);
        memset(p, 0x5a, 4096);
        CHECK(iopages_fast_free_page_ptr(f, p) == 0);
        /* Served from the cache: the page just freed comes back. */
        char *q = iopages_fast_alloc_page_ptr(f, IOPAGES_GFP_KERNEL);
        CHECK(q == p);
        /* No flags at all: with checks on, still the checked path (the
         * page is marked allocated, so its free is accepted). */
        char *e = iopages_fast_alloc_page_ptr(f, 0);
        CHECK(e != NULL);
        CHECK(iopages_fast_free_page_ptr(f, e) == 0);
        void *eb[4];
        CHECK(iopages_fast_alloc_bulk_ptrs(f, 0, eb, 4) == 4);
        CHECK(iopages_fast_free_bulk_ptrs(f, eb, 4) == 0);
        iopages_accounting held;
        CHECK(iopages_leak_check(a, &held) == -EBUSY && held.in_use_pages == 1); /* q */
        /* A zeroed page is the full path's: it must come back zeroed. */
        char *z = iopages_fast_alloc_page_ptr(f, IOPAGES_GFP_KERNEL | IOPAGES_GFP_ZERO);
        CHECK(z != NULL && z != q);
        for (int i = 0; i < 4096; i++) CHECK(z[i] == 0);
        CHECK(iopages_fast_alloc_page_ptr(f, 1u << 30) == NULL); /* unknown bits */
        CHECK(strstr(iopages_last_error(), "gfp") != NULL);
        CHECK(iopages_fast_free_page_ptr(f, q + 1) == -EINVAL);
        /* The inline free's one compare (the offset rotated by the page
         * shift against the frame count) refuses what the three tests did:
         * misaligned inside a page, below the base, at and past the end. */
        CHECK(iopages_fast_free_page_ptr(f, q + 2048) == -EINVAL);
        CHECK(iopages_fast_free_page_ptr(f, (char *)f->base - 4096) == -EINVAL);
        CHECK(iopages_fast_free_page_ptr(f, (char *)f->base - 1) == -EINVAL);
        CHECK(iopages_fast_free_page_ptr(f, (char *)f->base + f->arena_bytes) == -EINVAL);
        CHECK(iopages_fast_free_page_ptr(f, (char *)f->base + f->arena_bytes + 4096) == -EINVAL);
        CHECK(iopages_fast_free_page_ptr(f, (char *)f->base + f->arena_bytes - 1) == -EINVAL);
        CHECK(iopages_leak_check(a, &held) == -EBUSY && held.in_use_pages == 2); /* still q and z */
        CHECK(iopages_fast_free_page_ptr(f, q) == 0);
        CHECK(iopages_fast_free_page_ptr(f, z) == 0);
        if (checks) CHECK(iopages_fast_free_page_ptr(f, z) == -EINVAL); /* double free caught */
        /* Bulk, inside and past the cache, every page distinct. */
        static void *v[600];
        size_t sizes[] = {1, 5, 7, 8, 16, 17, 64, 300, 600};
        for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
            size_t n = sizes[k];
            CHECK(iopages_fast_alloc_bulk_ptrs(f, IOPAGES_GFP_KERNEL, v, n) == (intptr_t)n);
            for (size_t i = 0; i < n; i++) {
                CHECK(((uintptr_t)v[i] & 4095) == 0);
                *(size_t *)v[i] = i;
            }
            for (size_t i = 0; i < n; i++) CHECK(*(size_t *)v[i] == i); /* no page twice */
            iopages_accounting acc;
            CHECK(iopages_leak_check(a, &acc) == -EBUSY && acc.in_use_pages == n);
            /* A bad address in the middle (the inline path's four-page
             * steps), and last (its one-page tail), frees nothing. */
            size_t at[] = {n / 2, n - 1};
            for (int k2 = 0; k2 < 2; k2++) {
                void *saved = v[at[k2]];
                v[at[k2]] = (char *)saved + 64;
                CHECK(iopages_fast_free_bulk_ptrs(f, v, n) == -EINVAL);
                CHECK(iopages_leak_check(a, &acc) == -EBUSY && acc.in_use_pages == n); /* nothing freed */
                /* Page starts outside the arena: past its end, below its
                 * base, and 2^43 bytes past it. */
                char *outside[] = {(char *)f->base + f->arena_bytes, (char *)f->base - 4096,
                                   (char *)f->base + ((size_t)1 << 43)};
                for (int o = 0; o < 3; o++) {
                    v[at[k2]] = outside[o];
                    CHECK(iopages_fast_free_bulk_ptrs(f, v, n) == -EINVAL);
                    CHECK(iopages_leak_check(a, &acc) == -EBUSY && acc.in_use_pages == n);
                }
                v[at[k2]] = saved;
            }
            CHECK(iopages_fast_free_bulk_ptrs(f, v, n) == 0);
            CHECK(iopages_leak_check(a, NULL) == 0);
        }
        CHECK(iopages_fast_alloc_bulk_ptrs(f, IOPAGES_GFP_KERNEL, NULL, 4) == -EINVAL);
        CHECK(iopages_fast_free_bulk_ptrs(f, NULL, 4) == -EINVAL);
        /* With the cache warm and checks off, every call below is served
         * inline: nothing reaches the library, so nothing is counted, and
         * the accounting still sees each page exactly. */
        if (!checks) {
            CHECK(iopages_fast_alloc_bulk_ptrs(f, IOPAGES_GFP_KERNEL, v, 64) == 64);
            CHECK(iopages_fast_free_bulk_ptrs(f, v, 64) == 0);
            CHECK(iopages_stats_get(a, &s0) == 0);
            CHECK(iopages_fast_alloc_bulk_ptrs(f, IOPAGES_GFP_KERNEL, v, 8) == 8);
            void *one = iopages_fast_alloc_page_ptr(f, IOPAGES_GFP_KERNEL);
            CHECK(one != NULL);
            iopages_accounting acc;
            CHECK(iopages_leak_check(a, &acc) == -EBUSY && acc.in_use_pages == 9);
            CHECK(iopages_fast_free_page_ptr(f, one) == 0);
            CHECK(iopages_fast_free_bulk_ptrs(f, v, 8) == 0);
            CHECK(iopages_stats_get(a, &s1) == 0);
            CHECK(s1.alloc_thread_cache == s0.alloc_thread_cache);
            CHECK(s1.free_thread_cache == s0.free_thread_cache);
            CHECK(s1.bulk_alloc_calls == s0.bulk_alloc_calls);
            CHECK(s1.bulk_free_calls == s0.bulk_free_calls);
            CHECK(s1.alloc_pcp == s0.alloc_pcp && s1.alloc_zone == s0.alloc_zone);
            /* A batch from the cache comes most recently freed first, from
             * the inline path and the exported call alike. */
            for (int exported = 0; exported < 2; exported++) {
                void *w[8];
                CHECK(iopages_fast_alloc_bulk_ptrs(f, IOPAGES_GFP_KERNEL, v, 8) == 8);
                CHECK(iopages_fast_free_bulk_ptrs(f, v, 8) == 0); /* v[7] on top */
                intptr_t got = exported ? iopages_local_alloc_bulk_ptrs(l, IOPAGES_GFP_KERNEL, w, 8)
                                        : iopages_fast_alloc_bulk_ptrs(f, IOPAGES_GFP_KERNEL, w, 8);
                CHECK(got == 8);
                for (int i = 0; i < 8; i++) CHECK(w[i] == v[7 - i]);
                CHECK(iopages_fast_free_bulk_ptrs(f, w, 8) == 0);
            }
            /* A single free stores its page unless the slot above the
             * length holds it already (the page the last allocation took):
             * a page freed out of that order is the next one out. */
            char *p = iopages_fast_alloc_page_ptr(f, IOPAGES_GFP_KERNEL);
            char *q = iopages_fast_alloc_page_ptr(f, IOPAGES_GFP_KERNEL);
            CHECK(p && q && p != q);
            CHECK(iopages_fast_free_page_ptr(f, p) == 0); /* q's slot above */
            CHECK(iopages_fast_alloc_page_ptr(f, IOPAGES_GFP_KERNEL) == p);
            CHECK(iopages_fast_free_page_ptr(f, p) == 0); /* p's slot: no store */
            CHECK(iopages_fast_alloc_page_ptr(f, IOPAGES_GFP_KERNEL) == p);
            CHECK(iopages_fast_free_page_ptr(f, q) == 0);
            CHECK(iopages_fast_free_page_ptr(f, p) == 0);
            CHECK(iopages_fast_alloc_page_ptr(f, IOPAGES_GFP_KERNEL) == p);
            CHECK(iopages_fast_alloc_page_ptr(f, IOPAGES_GFP_KERNEL) == q);
            CHECK(iopages_fast_free_page_ptr(f, q) == 0);
            CHECK(iopages_fast_free_page_ptr(f, p) == 0);
        }
        CHECK(iopages_local_destroy(l) == 0);
        CHECK(iopages_leak_check(a, NULL) == 0);
        CHECK(iopages_allocator_destroy(a) == 0);
    }
}

/* Inline and exported calls interleaved on one handle, in a pseudo-random
 * order: the exported calls take the handle's state back from what the
 * inline ones changed, so no page is handed out twice or lost, and the
 * accounting matches what the test holds at every step. */
static void mixed_calls(void) {
    iopages_allocator *a = make(0);
    iopages_local *l = NULL;
    CHECK(iopages_local_create(a, &l) == 0);
    const iopages_local_fast *f = iopages_local_fast_path(l);
    enum { MAX_HELD = 2048 };
    static char *held[MAX_HELD];
    static void *v[64];
    size_t nheld = 0;
    uint64_t rng = 0x9e3779b97f4a7c15u;
    iopages_stats last = {0};
    for (int step = 0; step < 20000; step++) {
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        unsigned op = (unsigned)(rng % 8);
        size_t n = 1 + (size_t)((rng >> 8) % 40);
        if (n > IOPAGES_FAST_BULK_MAX && (op == 2 || op == 6)) n = 1 + n % IOPAGES_FAST_BULK_MAX; /* inline sizes */
        if (op < 4 && nheld + n > MAX_HELD) op += 4; /* full: free instead */
        if (op >= 4 && nheld < n) op -= 4;            /* too few: allocate */
        switch (op) {
        case 0: /* inline single */
        case 1: /* exported single */ {
            char *p = op == 0 ? iopages_fast_alloc_page_ptr(f, IOPAGES_GFP_KERNEL)
                              : iopages_local_alloc_page_ptr(l, IOPAGES_GFP_KERNEL);
            CHECK(p != NULL);
            held[nheld++] = p;
            break;
        }
        case 2: /* inline bulk */
        case 3: /* exported bulk */ {
            intptr_t got = op == 2 ? iopages_fast_alloc_bulk_ptrs(f, IOPAGES_GFP_KERNEL, v, n)
                                   : iopages_local_alloc_bulk_ptrs(l, IOPAGES_GFP_KERNEL, v, n);
            CHECK(got == (intptr_t)n);
            for (size_t i = 0; i < n; i++) held[nheld++] = v[i];
            break;
        }
        case 4: /* inline single free */
        case 5: /* exported single free */ {
            char *p = held[--nheld];
            CHECK((op == 4 ? iopages_fast_free_page_ptr(f, p) : iopages_local_free_page_ptr(l, p)) == 0);
            break;
        }
        default: /* bulk frees, inline (6) and exported (7) */ {
            for (size_t i = 0; i < n; i++) v[i] = held[--nheld];
            CHECK((op == 6 ? iopages_fast_free_bulk_ptrs(f, v, n) : iopages_local_free_bulk_ptrs(l, v, n)) == 0);
            break;
        }
        }
        /* Every page held is held once: tag each with its slot, read back. */
        if (step % 97 == 0) {
            for (size_t i = 0; i < nheld; i++) *(size_t *)held[i] = i;
            for (size_t i = 0; i < nheld; i++) CHECK(*(size_t *)held[i] == i);
            iopages_accounting acc;
            int rc = iopages_leak_check(a, &acc);
            CHECK(nheld ? rc == -EBUSY && acc.in_use_pages == nheld : rc == 0);
            /* An exported call working from stale copies would store
             * counts that forget the inline calls' additions. */
            iopages_stats now;
            CHECK(iopages_stats_get(a, &now) == 0);
            CHECK(now.alloc_thread_cache >= last.alloc_thread_cache);
            CHECK(now.free_thread_cache >= last.free_thread_cache);
            CHECK(now.bulk_alloc_calls >= last.bulk_alloc_calls && now.bulk_free_calls >= last.bulk_free_calls);
            last = now;
        }
    }
    while (nheld) CHECK(iopages_fast_free_page_ptr(f, held[--nheld]) == 0);
    CHECK(iopages_leak_check(a, NULL) == 0);
    CHECK(iopages_local_destroy(l) == 0);
    CHECK(iopages_leak_check(a, NULL) == 0);
    CHECK(iopages_allocator_destroy(a) == 0);
}

/* Batches of 2 to 4 through the inline paths, stored packed and one slot
 * at a time (a copy of the view with its flag set each way: the view is
 * copyable, and the flag changes only how the slots are written): each
 * batch comes back most recently freed first, and nothing leaks. */
static void small_batches(void) {
    iopages_allocator *a = make(0);
    iopages_local *l = NULL;
    CHECK(iopages_local_create(a, &l) == 0);
    const iopages_local_fast *view = iopages_local_fast_path(l);
    CHECK(view && view->small_packed <= 1);
    for (uint32_t packed = 0; packed < 2; packed++) {
        iopages_local_fast f = *view;
        f.small_packed = packed;
        for (size_t n = 2; n <= 4; n++) {
            void *v[4], *w[4];
            CHECK(iopages_fast_alloc_bulk_ptrs(&f, IOPAGES_GFP_KERNEL, v, n) == (intptr_t)n);
            CHECK(iopages_fast_free_bulk_ptrs(&f, v, n) == 0);
            CHECK(iopages_fast_alloc_bulk_ptrs(&f, IOPAGES_GFP_KERNEL, w, n) == (intptr_t)n);
            for (size_t i = 0; i < n; i++) CHECK(w[i] == v[n - 1 - i]);
            CHECK(iopages_fast_free_bulk_ptrs(&f, w, n) == 0);
        }
    }
    CHECK(iopages_local_destroy(l) == 0);
    CHECK(iopages_leak_check(a, NULL) == 0);
    CHECK(iopages_allocator_destroy(a) == 0);
}

int main(void) {
    allocator_calls();
    local_calls();
    fast_calls();
    small_batches();
    mixed_calls();
    mempool_calls();
    counter_calls();
    kvmalloc_calls();
    folio_bio_calls();
    printf("api: ok\n");
    return 0;
}
