/*
 * peer_bench.c — the E1 workload against one allocator that users would pick
 * instead of iopages, compiled once per allocator (see scripts/setup-peers.sh).
 *
 * Owns: the same alloc+free workload the iopages driver runs in-process —
 * 4 KiB buffers, the first byte of each written, LIFO reuse, warm caches —
 * single-threaded at each batch size and multi-threaded with producer /
 * consumer pairs (allocated on one thread, freed on another). Must never:
 * report a figure it did not time, or a multi-thread figure whose clock
 * failed its check without saying so; it prints one JSON object per result.
 *
 * Multi-thread clock: every worker reads the monotonic clock and its own
 * thread CPU time right after the start barrier and again when it is done.
 * The interval is the latest end minus the earliest start. The main thread
 * takes no time itself: with as many threads as cores it may not run again
 * until the workers are nearly done, and would time the wrong interval.
 *
 * iopages itself is a row too when the harness is built against libiopages
 * (-DPEER_IOPAGES -DHAVE_IOPAGES, see scripts/setup-peers.sh): its C ABI,
 * measured by the same program as every other allocator.
 *
 * Usage: peer-NAME PAGES_PER_RUN MT_PAGES_PER_PAIR "b1,b2,..." "t1,t2,..." "mb1,mb2,..."
 * Batch 0 means the single-object API. Multi-thread lines carry
 * ns_per_page (wall per page per pair), pages_per_s (all pairs together),
 * cpu_ns_per_page (the workers' CPU time per page) and clock_check.
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
#include <unistd.h>

#define PAGE 4096
#define MAX_BATCH 1024
#define RING 1024 /* slots per producer/consumer ring, a power of two */
#define MAX_LIST 32 /* entries of each comma list on the command line */
/* How far the workers' CPU time may exceed threads x interval before the
 * clock is called wrong (clock granularity, a worker's last slice). */
#define CLOCK_SLACK 1.10

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
/* Objects the pool needs: every ring full, a batch in each worker's hands,
 * and a full per-lcore cache (at most twice its size) for every thread. */
static unsigned pool_need(unsigned max_threads, unsigned max_batch) {
    unsigned b = max_batch ? max_batch : 1;
    return max_threads / 2 * (RING + 2 * b) + (max_threads + 1) * 2 * RTE_MEMPOOL_CACHE_MAX_SIZE;
}
/* The smallest 2^q - 1 (the size DPDK advises) holding at least `floor`
 * and `need` objects. */
static unsigned pool_size(unsigned floor, unsigned need) {
    unsigned n = floor;
    while (n < need) n = 2 * n + 1;
    return n;
}
static void *peer_alloc(void) { void *p; return rte_mempool_get(mp, &p) ? NULL : p; }
static void peer_free(void *p) { rte_mempool_put(mp, p); }
static int peer_alloc_bulk(void **v, unsigned n) { return rte_mempool_get_bulk(mp, v, n); }
static void peer_free_bulk(void **v, unsigned n) { rte_mempool_put_bulk(mp, v, n); }
#elif defined(PEER_IOPAGES) && defined(HAVE_IOPAGES)
/* iopages through its C ABI (libiopages, crates/iopages-ffi): the same
 * workload the in-process iopages row runs — each thread allocates through
 * its own per-thread handle (iopages_local: LocalAllocator), single pages
 * and bulk batches by address, from a populated arena with checks off —
 * through the header's inline fast paths (iopages_fast_*), as DPDK's row
 * uses rte_mempool_get_bulk, inline over its per-lcore cache. */
#include <iopages.h>
#define PEER_NAME "iopages-c"
#define PEER_BULK 1
#define PEER_PER_THREAD 1
static iopages_allocator *ioa;
static __thread iopages_local *iol;
static __thread const iopages_local_fast *iof;
static void *peer_alloc(void) { return iopages_fast_alloc_page_ptr(iof, IOPAGES_GFP_KERNEL); }
static void peer_free(void *p) { iopages_fast_free_page_ptr(iof, p); }
static int peer_alloc_bulk(void **v, unsigned n) {
    return iopages_fast_alloc_bulk_ptrs(iof, IOPAGES_GFP_KERNEL, v, n) == (intptr_t)n ? 0 : -1;
}
static void peer_free_bulk(void **v, unsigned n) { iopages_fast_free_bulk_ptrs(iof, v, n); }
/* The single-thread loop works on a copy of the view in a local, as the
 * header advises for hot loops: the view never changes, and a local copy
 * whose address goes nowhere keeps its fields in registers, where through
 * the thread's pointer each first-byte store (through a char *, which may
 * alias anything) makes the compiler load them again. */
#define PEER_ST_BEGIN \
    const iopages_local_fast st_view = *iof; \
    const iopages_local_fast *const st_f = &st_view;
#define peer_st_alloc() iopages_fast_alloc_page_ptr(st_f, IOPAGES_GFP_KERNEL)
#define peer_st_free(p) iopages_fast_free_page_ptr(st_f, (p))
#define peer_st_alloc_bulk(v, n) \
    (iopages_fast_alloc_bulk_ptrs(st_f, IOPAGES_GFP_KERNEL, (v), (n)) == (intptr_t)(n) ? 0 : -1)
#define peer_st_free_bulk(v, n) iopages_fast_free_bulk_ptrs(st_f, (v), (n))
#else
#error "define one of PEER_GLIBC PEER_JEMALLOC PEER_MIMALLOC PEER_TCMALLOC PEER_DPDK (or PEER_IOPAGES with HAVE_IOPAGES)"
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
#define PROBE_N 63
static struct rte_mempool *aligned_pool_at(unsigned n, size_t shift, char **mem_out, size_t *len_out) {
    static int gen;
    char name[32];
    snprintf(name, sizeof name, "peer-aligned-%d", gen++);
    /* The probe is too small for a cache (DPDK wants n >= 1.5 x cache). */
    unsigned cache = n == PROBE_N ? 0 : RTE_MEMPOOL_CACHE_MAX_SIZE;
    struct rte_mempool *p = rte_mempool_create_empty(name, n, 2 * PAGE - 64, cache, 0, SOCKET_ID_ANY,
                                                     RTE_MEMPOOL_F_NO_SPREAD | RTE_MEMPOOL_F_NO_IOVA_CONTIG);
    if (!p || rte_mempool_set_ops_byname(p, "ring_mp_mc", NULL)) return NULL;
    size_t len = (size_t)(n + 2) * 2 * PAGE;
    char *mem = mmap(NULL, len + PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (mem == MAP_FAILED) return NULL;
    if (rte_mempool_populate_iova(p, mem + shift, RTE_BAD_IOVA, len, NULL, NULL) < (int)n) return NULL;
    if (mem_out) {
        *mem_out = mem;
        *len_out = len + PAGE;
    }
    return p;
}
static struct rte_mempool *aligned_pool(unsigned n) {
    /* Find where DPDK puts the first buffer relative to the memory given
     * (the same for any pool size: one header, then the object), then build
     * the pool shifted so that buffers start on pages. The probe is small
     * and freed, so only the real pool's memory stays populated. */
    char *probe_mem;
    size_t probe_len;
    struct rte_mempool *probe = aligned_pool_at(PROBE_N, 0, &probe_mem, &probe_len);
    void *obj;
    if (!probe || rte_mempool_get(probe, &obj)) return NULL;
    size_t off = (uintptr_t)obj % PAGE;
    rte_mempool_put(probe, obj);
    rte_mempool_free(probe);
    munmap(probe_mem, probe_len);
    struct rte_mempool *p = aligned_pool_at(n, off ? PAGE - off : 0, NULL, NULL);
    if (!p || rte_mempool_get(p, &obj)) return NULL;
    if ((uintptr_t)obj % PAGE) {
        fprintf(stderr, "could not page-align DPDK buffers (offset %zu)\n", (size_t)((uintptr_t)obj % PAGE));
        return NULL;
    }
    rte_mempool_put(p, obj);
    return p;
}
#endif

#if defined(PEER_DPDK)
/* The CPUs the process may run on before EAL pins the main thread to
 * lcore 0 ("-l 0"). Threads the workers create inherit that pin: without
 * giving them this set back, every producer and consumer would share CPU 0,
 * and DPDK's multi-thread figures would be one core's (a pair on one core
 * also hands pages over in that core's caches). */
static cpu_set_t all_cpus;
#endif
static pthread_t main_thread;

static void thread_init(void) {
#if defined(PEER_PER_THREAD)
    if (!iol && iopages_local_create(ioa, &iol) != 0) {
        fprintf(stderr, "iopages_local_create: %s\n", iopages_last_error());
        exit(3);
    }
    iof = iopages_local_fast_path(iol);
#endif
#if defined(PEER_DPDK)
    /* Non-EAL threads need an lcore id to get a per-lcore mempool cache. */
    if (rte_lcore_id() == LCORE_ID_ANY && rte_thread_register() != 0) {
        fprintf(stderr, "rte_thread_register: %s\n", rte_strerror(rte_errno));
        exit(3);
    }
    if (!pthread_equal(pthread_self(), main_thread) &&
        pthread_setaffinity_np(pthread_self(), sizeof all_cpus, &all_cpus) != 0) {
        fprintf(stderr, "pthread_setaffinity_np failed\n");
        exit(3);
    }
#endif
}

/* A worker's goodbye, after its timed span. DPDK keeps an lcore id and its
 * cache after the thread exits: without this, every pass would strand up to
 * a cache of buffers per thread and use up the lcore ids. */
static void thread_exit(void) {
#if defined(PEER_PER_THREAD)
    iopages_local_destroy(iol);
    iol = NULL;
    iof = NULL;
#endif
#if defined(PEER_DPDK)
    rte_mempool_cache_flush(NULL, mp);
    rte_thread_unregister();
#endif
}

static uint64_t clock_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static double now_ns(void) { return (double)clock_ns(CLOCK_MONOTONIC); }

static void die(const char *what) {
    fprintf(stderr, "%s: %s failed\n", PEER_NAME, what);
    exit(2);
}

static void bad_arg(const char *why) {
    fprintf(stderr, "%s: %s\n", PEER_NAME, why);
    exit(64);
}

/* A peer whose handle is best kept in the loop's own locals says how
 * (PEER_ST_BEGIN and the peer_st_* calls); the others are called as they
 * are everywhere. */
#ifndef PEER_ST_BEGIN
#define PEER_ST_BEGIN
#define peer_st_alloc() peer_alloc()
#define peer_st_free(p) peer_free(p)
#define peer_st_alloc_bulk(v, n) peer_alloc_bulk((v), (n))
#define peer_st_free_bulk(v, n) peer_free_bulk((v), (n))
#endif

/* One timed single-thread pass; returns ns per page. */
static double run_st(unsigned batch, uint64_t pages) {
    static void *v[MAX_BATCH];
    PEER_ST_BEGIN
    double t0 = now_ns();
    if (batch == 0) {
#ifdef PEER_ST_LAG
        /* A diagnostic build (-DPEER_ST_LAG): each round frees the page of
         * the round before, which breaks the chain from one free's store to
         * the next allocation's load (docs/experiments.md, the C row). */
        char *prev = peer_st_alloc();
        if (!prev) die("alloc");
        for (uint64_t i = 0; i < pages; i++) {
            char *p = peer_st_alloc();
            if (!p) die("alloc");
            *(volatile char *)p = 1;
            peer_st_free(prev);
            prev = p;
        }
        peer_st_free(prev);
#else
        for (uint64_t i = 0; i < pages; i++) {
            char *p = peer_st_alloc();
            if (!p) die("alloc");
            *(volatile char *)p = 1;
            peer_st_free(p);
        }
#endif
    } else {
        uint64_t rounds = pages / batch ? pages / batch : 1;
        for (uint64_t r = 0; r < rounds; r++) {
            if (peer_st_alloc_bulk(v, batch)) die("bulk alloc");
            for (unsigned i = 0; i < batch; i++) *(volatile char *)v[i] = 1;
            peer_st_free_bulk(v, batch);
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

/* One worker's clocks over its timed span: monotonic start and end, and its
 * own CPU time in between (read inside the wall span, so never longer). */
struct span {
    uint64_t start, end, cpu;
    uint64_t cpu0; /* private: CPU clock at the start */
};

static void span_begin(struct span *s) {
    s->start = clock_ns(CLOCK_MONOTONIC);
    s->cpu0 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
}

static void span_end(struct span *s) {
    s->cpu = clock_ns(CLOCK_THREAD_CPUTIME_ID) - s->cpu0;
    s->end = clock_ns(CLOCK_MONOTONIC);
}

struct pair {
    struct ring ring;
    unsigned batch;
    uint64_t pages;
    pthread_barrier_t *start;
    struct span producer, consumer;
};

static void *producer(void *arg) {
    struct pair *pp = arg;
    void *v[MAX_BATCH];
    unsigned b = pp->batch ? pp->batch : 1;
    thread_init();
    pthread_barrier_wait(pp->start);
    span_begin(&pp->producer);
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
    span_end(&pp->producer);
    thread_exit();
    return NULL;
}

static void *consumer(void *arg) {
    struct pair *pp = arg;
    void *v[MAX_BATCH];
    unsigned b = pp->batch ? pp->batch : 1;
    thread_init();
    pthread_barrier_wait(pp->start);
    span_begin(&pp->consumer);
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
    span_end(&pp->consumer);
    thread_exit();
    return NULL;
}

struct mt_result {
    double ns_per_page;     /* interval / pages per pair */
    double pages_per_s;     /* pairs x pages per pair / interval */
    double cpu_ns_per_page; /* the workers' CPU time / pages of all pairs */
    double busy_cpus;       /* the workers' CPU time / interval */
    unsigned cpu_bound;     /* min(threads, online CPUs) */
    int clock_ok;           /* busy_cpus <= cpu_bound x CLOCK_SLACK */
};

/* The figures of one pass from its workers' spans. */
static struct mt_result mt_figures(unsigned threads, uint64_t pages, const struct pair *pp, unsigned pairs) {
    uint64_t first = UINT64_MAX, last = 0;
    double cpu = 0;
    for (unsigned i = 0; i < pairs; i++) {
        const struct span *s[2] = {&pp[i].producer, &pp[i].consumer};
        for (int k = 0; k < 2; k++) {
            if (s[k]->start < first) first = s[k]->start;
            if (s[k]->end > last) last = s[k]->end;
            cpu += (double)s[k]->cpu;
        }
    }
    double interval = last > first ? (double)(last - first) : 1.0;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    struct mt_result r;
    r.ns_per_page = interval / (double)pages;
    r.pages_per_s = (double)pairs * (double)pages / interval * 1e9;
    r.cpu_ns_per_page = cpu / ((double)pairs * (double)pages);
    r.busy_cpus = cpu / interval;
    r.cpu_bound = online > 0 && (unsigned long)online < threads ? (unsigned)online : threads;
    r.clock_ok = r.busy_cpus <= r.cpu_bound * CLOCK_SLACK;
    return r;
}

/* One timed multi-thread pass with threads/2 pairs. */
static struct mt_result run_mt(unsigned threads, unsigned batch, uint64_t pages) {
    unsigned pairs = threads / 2;
    unsigned b = batch ? batch : 1;
    pages = pages / b * b;
    struct pair *pp = aligned_alloc(64, sizeof(struct pair) * pairs);
    pthread_t *tid = calloc(2 * pairs, sizeof(pthread_t));
    pthread_barrier_t start;
    if (!pp || !tid) die("malloc");
    /* Only the workers meet at the barrier: each starts its own clock. */
    pthread_barrier_init(&start, NULL, 2 * pairs);
    for (unsigned i = 0; i < pairs; i++) {
        memset(&pp[i], 0, sizeof pp[i]);
        pp[i].batch = batch;
        pp[i].pages = pages;
        pp[i].start = &start;
        pthread_create(&tid[2 * i], NULL, producer, &pp[i]);
        pthread_create(&tid[2 * i + 1], NULL, consumer, &pp[i]);
    }
    for (unsigned i = 0; i < 2 * pairs; i++) pthread_join(tid[i], NULL);
    struct mt_result r = mt_figures(threads, pages, pp, pairs);
    pthread_barrier_destroy(&start);
    free(tid);
    free(pp);
    if (!r.clock_ok)
        fprintf(stderr,
                "%s: WARNING: clock check FAILED at %u threads, batch %u: the workers were busy %.2f CPUs "
                "on average, more than the %u that can run them (+10%%); these figures are wrong\n",
                PEER_NAME, threads, batch, r.busy_cpus, r.cpu_bound);
    return r;
}

static unsigned parse_list(const char *s, unsigned *out, unsigned max) {
    unsigned n = 0;
    char *copy = strdup(s), *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (n == max) bad_arg("a list has more than 32 entries"); /* never drop entries silently */
        out[n++] = (unsigned)strtoul(tok, NULL, 10);
    }
    free(copy);
    return n;
}

int main(int argc, char **argv) {
    main_thread = pthread_self();
    if (argc != 6) {
        fprintf(stderr, "usage: %s PAGES MT_PAGES BATCHES THREADS MT_BATCHES\n", argv[0]);
        return 64;
    }
    uint64_t pages = strtoull(argv[1], NULL, 10), mt_pages = strtoull(argv[2], NULL, 10);
    unsigned batches[MAX_LIST], threads[MAX_LIST], mt_batches[MAX_LIST];
    unsigned nb = parse_list(argv[3], batches, MAX_LIST), nt = parse_list(argv[4], threads, MAX_LIST),
             nmb = parse_list(argv[5], mt_batches, MAX_LIST);
    unsigned max_threads = 0, max_mt_batch = 0;
    for (unsigned i = 0; i < nb; i++)
        if (batches[i] > MAX_BATCH) bad_arg("batch size above 1024");
    for (unsigned i = 0; i < nmb; i++) {
        if (mt_batches[i] > MAX_BATCH) bad_arg("batch size above 1024");
        if (mt_batches[i] > max_mt_batch) max_mt_batch = mt_batches[i];
    }
    for (unsigned i = 0; i < nt; i++) {
        if (threads[i] < 2 || threads[i] % 2) bad_arg("thread counts must be even (producer/consumer pairs)");
        if (threads[i] > max_threads) max_threads = threads[i];
    }
    (void)max_threads, (void)max_mt_batch; /* only DPDK and iopages size their memory */
#if defined(PEER_IOPAGES)
    /* As the in-process E1 run: populated, checks off, huge pages if the
     * kernel gives them; 64 MiB, 128 MiB when more than 8 threads run. */
    iopages_config cfg;
    iopages_config_default(&cfg);
    cfg.size_bytes = max_threads > 8 ? 128u << 20 : 64u << 20;
    cfg.huge_pages = IOPAGES_HUGE_TRY;
    cfg.populate = true;
    cfg.checks = 0;
    if (iopages_allocator_create(&cfg, &ioa) != 0) {
        fprintf(stderr, "iopages_allocator_create: %s\n", iopages_last_error());
        return 3;
    }
#endif
#if defined(PEER_DPDK)
    /* A pool that cannot hold what the largest pass keeps in flight would
     * run dry and end the process: size it for the thread counts asked. */
    unsigned need = pool_need(max_threads, max_mt_batch);
#if defined(PEER_DPDK_ALIGNED)
    unsigned pool_n = pool_size(ALIGNED_N, need);
    unsigned eal_mb = 512; /* the aligned pool lives in memory we map */
#else
    unsigned pool_n = pool_size(16383, need);
    /* EAL memory for the pool's objects (4 KiB, header and padding). */
    unsigned eal_mb = (unsigned)((uint64_t)pool_n * 5 * 1024 / (1 << 20)) + 256;
    if (eal_mb < 512) eal_mb = 512;
#endif
    char eal_m[16];
    snprintf(eal_m, sizeof eal_m, "%u", eal_mb);
    if (sched_getaffinity(0, sizeof all_cpus, &all_cpus) != 0) die("sched_getaffinity");
    char *eal[] = {"peer-dpdk", "--no-huge", "--no-pci", "--no-shconf", "--no-telemetry", "-m", eal_m,
                   "-l", "0", "--log-level", "lib.eal:error", NULL};
    if (rte_eal_init((int)(sizeof eal / sizeof eal[0]) - 1, eal) < 0) {
        fprintf(stderr, "rte_eal_init: %s\n", rte_strerror(rte_errno));
        return 3;
    }
#if defined(PEER_DPDK_ALIGNED)
    mp = aligned_pool(pool_n);
#else
    /* 16Ki buffers of 4 KiB (more where the thread counts need them) with
     * the largest per-lcore cache DPDK allows. DPDK places each object
     * after a 64-byte header and pads objects so they spread over memory
     * channels: the buffers are cache-line aligned, not page aligned. */
    mp = rte_mempool_create("peer", pool_n, PAGE, RTE_MEMPOOL_CACHE_MAX_SIZE, 0, NULL, NULL, NULL, NULL,
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
        for (unsigned i = 0; i < nmb; i++) {
            struct mt_result r = run_mt(threads[t], mt_batches[i], mt_pages);
            printf("{\"peer\":\"%s\",\"mode\":\"mt\",\"threads\":%u,\"batch\":%u,\"ns_per_page\":%.4f,"
                   "\"pages_per_s\":%.1f,\"cpu_ns_per_page\":%.4f,\"clock_check\":\"%s\"}\n",
                   PEER_NAME, threads[t], mt_batches[i], r.ns_per_page, r.pages_per_s, r.cpu_ns_per_page,
                   r.clock_ok ? "ok" : "failed");
        }
    fflush(stdout);
    return 0;
}
