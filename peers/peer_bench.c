/*
 * peer_bench.c — the E1 workload against one allocator that users would pick
 * instead of iopages, compiled once per allocator (see scripts/setup-peers.sh).
 *
 * Owns: the same alloc+free workload the iopages driver runs in-process —
 * 4 KiB buffers, the first byte of each written, LIFO reuse, warm caches —
 * single-threaded at each batch size and multi-threaded with producer /
 * consumer pairs (allocated on one thread, freed on another). Must never:
 * report a figure it did not time; it prints one JSON object per result.
 *
 * Usage: peer-NAME PAGES_PER_RUN MT_PAGES_PER_PAIR "b1,b2,..." "t1,t2,..." "mb1,mb2,..."
 * Batch 0 means the single-object API.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PAGE 4096
#define MAX_BATCH 1024
#define RING 1024 /* slots per producer/consumer ring, a power of two */

#if defined(PEER_GLIBC)
#define PEER_NAME "glibc"
static void *peer_alloc(void) { void *p; return posix_memalign(&p, PAGE, PAGE) ? NULL : p; }
static void peer_free(void *p) { free(p); }
#elif defined(PEER_JEMALLOC)
#include <jemalloc/jemalloc.h>
#define PEER_NAME "jemalloc"
static void *peer_alloc(void) { return mallocx(PAGE, MALLOCX_ALIGN(PAGE)); }
static void peer_free(void *p) { sdallocx(p, PAGE, MALLOCX_ALIGN(PAGE)); }
#elif defined(PEER_MIMALLOC)
#include <mimalloc.h>
#define PEER_NAME "mimalloc"
static void *peer_alloc(void) { return mi_malloc_aligned(PAGE, PAGE); }
static void peer_free(void *p) { mi_free(p); }
#elif defined(PEER_TCMALLOC)
#include <gperftools/tcmalloc.h>
#define PEER_NAME "tcmalloc"
static void *peer_alloc(void) { return tc_memalign(PAGE, PAGE); }
static void peer_free(void *p) { tc_free(p); }
#elif defined(PEER_DPDK) || defined(PEER_DPDK_ALIGNED)
#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_lcore.h>
#include <rte_mempool.h>
#include <sys/mman.h>
#if defined(PEER_DPDK_ALIGNED)
#define PEER_NAME "dpdk-aligned"
#define PEER_DPDK 1
#else
#define PEER_NAME "dpdk"
#endif
#define PEER_BULK 1
static struct rte_mempool *mp;
static void *peer_alloc(void) { void *p; return rte_mempool_get(mp, &p) ? NULL : p; }
static void peer_free(void *p) { rte_mempool_put(mp, p); }
static int peer_alloc_bulk(void **v, unsigned n) { return rte_mempool_get_bulk(mp, v, n); }
static void peer_free_bulk(void **v, unsigned n) { rte_mempool_put_bulk(mp, v, n); }
#else
#error "define one of PEER_GLIBC PEER_JEMALLOC PEER_MIMALLOC PEER_TCMALLOC PEER_DPDK"
#endif

#ifndef PEER_BULK
/* No bulk API: a batch is a loop, as a user of this allocator would write. */
static int peer_alloc_bulk(void **v, unsigned n) {
    for (unsigned i = 0; i < n; i++) {
        v[i] = peer_alloc();
        if (!v[i]) {
            while (i--) peer_free(v[i]);
            return -1;
        }
    }
    return 0;
}
static void peer_free_bulk(void **v, unsigned n) {
    for (unsigned i = 0; i < n; i++) peer_free(v[i]);
}
#endif

#if defined(PEER_DPDK_ALIGNED)
/* The same pool with page-aligned 4 KiB buffers, as O_DIRECT and iopages
 * give: 8 KiB strides (a 64-byte header, then the buffer on a page
 * boundary), no spreading padding, over memory we place ourselves. */
#define ALIGNED_N 8191
static struct rte_mempool *aligned_pool_at(size_t shift) {
    static int gen;
    char name[32];
    snprintf(name, sizeof name, "peer-aligned-%d", gen++);
    struct rte_mempool *p = rte_mempool_create_empty(name, ALIGNED_N, 2 * PAGE - 64, RTE_MEMPOOL_CACHE_MAX_SIZE, 0,
                                                     SOCKET_ID_ANY,
                                                     RTE_MEMPOOL_F_NO_SPREAD | RTE_MEMPOOL_F_NO_IOVA_CONTIG);
    if (!p || rte_mempool_set_ops_byname(p, "ring_mp_mc", NULL)) return NULL;
    size_t len = (size_t)(ALIGNED_N + 2) * 2 * PAGE;
    char *mem = mmap(NULL, len + PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (mem == MAP_FAILED) return NULL;
    if (rte_mempool_populate_iova(p, mem + shift, RTE_BAD_IOVA, len, NULL, NULL) < (int)ALIGNED_N) return NULL;
    return p;
}
static struct rte_mempool *aligned_pool(void) {
    /* Find where DPDK puts the first buffer relative to the memory given,
     * then build the pool shifted so that buffers start on pages. */
    struct rte_mempool *probe = aligned_pool_at(0);
    void *obj;
    if (!probe || rte_mempool_get(probe, &obj)) return NULL;
    size_t off = (uintptr_t)obj % PAGE;
    rte_mempool_put(probe, obj);
    struct rte_mempool *p = aligned_pool_at(off ? PAGE - off : 0);
    if (!p || rte_mempool_get(p, &obj)) return NULL;
    if ((uintptr_t)obj % PAGE) {
        fprintf(stderr, "could not page-align DPDK buffers (offset %zu)\n", (size_t)((uintptr_t)obj % PAGE));
        return NULL;
    }
    rte_mempool_put(p, obj);
    return p;
}
#endif

static void thread_init(void) {
#if defined(PEER_DPDK)
    /* Non-EAL threads need an lcore id to get a per-lcore mempool cache. */
    if (rte_lcore_id() == LCORE_ID_ANY && rte_thread_register() != 0) {
        fprintf(stderr, "rte_thread_register: %s\n", rte_strerror(rte_errno));
        exit(3);
    }
#endif
}

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static void die(const char *what) {
    fprintf(stderr, "%s: %s failed\n", PEER_NAME, what);
    exit(2);
}

/* One timed single-thread pass; returns ns per page. */
static double run_st(unsigned batch, uint64_t pages) {
    static void *v[MAX_BATCH];
    double t0 = now_ns();
    if (batch == 0) {
        for (uint64_t i = 0; i < pages; i++) {
            char *p = peer_alloc();
            if (!p) die("alloc");
            *(volatile char *)p = 1;
            peer_free(p);
        }
    } else {
        uint64_t rounds = pages / batch ? pages / batch : 1;
        for (uint64_t r = 0; r < rounds; r++) {
            if (peer_alloc_bulk(v, batch)) die("bulk alloc");
            for (unsigned i = 0; i < batch; i++) *(volatile char *)v[i] = 1;
            peer_free_bulk(v, batch);
        }
        pages = rounds * batch;
    }
    return (now_ns() - t0) / (double)pages;
}

/* A single-producer single-consumer ring of pointers. */
struct ring {
    _Alignas(64) _Atomic uint64_t head; /* written by the producer */
    _Alignas(64) _Atomic uint64_t tail; /* written by the consumer */
    _Alignas(64) void *slot[RING];
};

struct pair {
    struct ring ring;
    unsigned batch;
    uint64_t pages;
    pthread_barrier_t *start;
};

static void *producer(void *arg) {
    struct pair *pp = arg;
    void *v[MAX_BATCH];
    unsigned b = pp->batch ? pp->batch : 1;
    thread_init();
    pthread_barrier_wait(pp->start);
    uint64_t head = 0;
    for (uint64_t done = 0; done < pp->pages; done += b) {
        if (pp->batch == 0) {
            v[0] = peer_alloc();
            if (!v[0]) die("alloc");
        } else if (peer_alloc_bulk(v, b)) {
            die("bulk alloc");
        }
        for (unsigned i = 0; i < b; i++) *(volatile char *)v[i] = 1;
        while (head + b - atomic_load_explicit(&pp->ring.tail, memory_order_acquire) > RING) sched_yield();
        for (unsigned i = 0; i < b; i++) pp->ring.slot[(head + i) & (RING - 1)] = v[i];
        head += b;
        atomic_store_explicit(&pp->ring.head, head, memory_order_release);
    }
    return NULL;
}

static void *consumer(void *arg) {
    struct pair *pp = arg;
    void *v[MAX_BATCH];
    unsigned b = pp->batch ? pp->batch : 1;
    thread_init();
    pthread_barrier_wait(pp->start);
    uint64_t tail = 0;
    for (uint64_t done = 0; done < pp->pages; done += b) {
        while (atomic_load_explicit(&pp->ring.head, memory_order_acquire) - tail < b) sched_yield();
        for (unsigned i = 0; i < b; i++) v[i] = pp->ring.slot[(tail + i) & (RING - 1)];
        tail += b;
        atomic_store_explicit(&pp->ring.tail, tail, memory_order_release);
        if (pp->batch == 0)
            peer_free(v[0]);
        else
            peer_free_bulk(v, b);
    }
    return NULL;
}

/* One timed multi-thread pass with threads/2 pairs; returns wall ns per page per pair. */
static double run_mt(unsigned threads, unsigned batch, uint64_t pages) {
    unsigned pairs = threads / 2;
    unsigned b = batch ? batch : 1;
    pages = pages / b * b;
    struct pair *pp = aligned_alloc(64, sizeof(struct pair) * pairs);
    pthread_t *tid = calloc(2 * pairs, sizeof(pthread_t));
    pthread_barrier_t start;
    if (!pp || !tid) die("malloc");
    pthread_barrier_init(&start, NULL, 2 * pairs + 1);
    for (unsigned i = 0; i < pairs; i++) {
        memset(&pp[i], 0, sizeof pp[i]);
        pp[i].batch = batch;
        pp[i].pages = pages;
        pp[i].start = &start;
        pthread_create(&tid[2 * i], NULL, producer, &pp[i]);
        pthread_create(&tid[2 * i + 1], NULL, consumer, &pp[i]);
    }
    pthread_barrier_wait(&start);
    double t0 = now_ns();
    for (unsigned i = 0; i < 2 * pairs; i++) pthread_join(tid[i], NULL);
    double ns = now_ns() - t0;
    pthread_barrier_destroy(&start);
    free(tid);
    free(pp);
    return ns / (double)pages;
}

static unsigned parse_list(const char *s, unsigned *out, unsigned max) {
    unsigned n = 0;
    char *copy = strdup(s), *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok && n < max; tok = strtok_r(NULL, ",", &save))
        out[n++] = (unsigned)strtoul(tok, NULL, 10);
    free(copy);
    return n;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s PAGES MT_PAGES BATCHES THREADS MT_BATCHES\n", argv[0]);
        return 64;
    }
    uint64_t pages = strtoull(argv[1], NULL, 10), mt_pages = strtoull(argv[2], NULL, 10);
    unsigned batches[32], threads[32], mt_batches[32];
    unsigned nb = parse_list(argv[3], batches, 32), nt = parse_list(argv[4], threads, 32),
             nmb = parse_list(argv[5], mt_batches, 32);
    for (unsigned i = 0; i < nb; i++)
        if (batches[i] > MAX_BATCH) die("batch size above 1024");
#if defined(PEER_DPDK)
    char *eal[] = {"peer-dpdk", "--no-huge", "--no-pci", "--no-shconf", "--no-telemetry", "-m", "512",
                   "-l", "0", "--log-level", "lib.eal:error", NULL};
    if (rte_eal_init((int)(sizeof eal / sizeof eal[0]) - 1, eal) < 0) {
        fprintf(stderr, "rte_eal_init: %s\n", rte_strerror(rte_errno));
        return 3;
    }
#if defined(PEER_DPDK_ALIGNED)
    mp = aligned_pool();
#else
    /* 16Ki buffers of 4 KiB with the largest per-lcore cache DPDK allows.
     * DPDK places each object after a 64-byte header and pads objects so
     * they spread over memory channels: the buffers are cache-line aligned,
     * not page aligned. */
    mp = rte_mempool_create("peer", 16383, PAGE, RTE_MEMPOOL_CACHE_MAX_SIZE, 0, NULL, NULL, NULL, NULL,
                            SOCKET_ID_ANY, 0);
#endif
    if (!mp) {
        fprintf(stderr, "rte_mempool_create: %s\n", rte_strerror(rte_errno));
        return 3;
    }
#endif
    thread_init();
    /* Warm every workload once, untimed. */
    for (unsigned i = 0; i < nb; i++) run_st(batches[i], pages / 8 + 1);
    for (unsigned i = 0; i < nb; i++)
        printf("{\"peer\":\"%s\",\"mode\":\"st\",\"batch\":%u,\"ns_per_page\":%.4f}\n", PEER_NAME, batches[i],
               run_st(batches[i], pages));
    for (unsigned t = 0; t < nt; t++)
        for (unsigned i = 0; i < nmb; i++)
            printf("{\"peer\":\"%s\",\"mode\":\"mt\",\"threads\":%u,\"batch\":%u,\"ns_per_page\":%.4f}\n", PEER_NAME,
                   threads[t], mt_batches[i], run_mt(threads[t], mt_batches[i], mt_pages));
    fflush(stdout);
    return 0;
}
