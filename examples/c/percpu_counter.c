/* percpu_counter.c — a per-CPU counter shared by threads: cheap adds, a
 * rough read that never contends, the exact sum, and a limit that holds
 * under races (a budget of bytes in flight).
 *
 * Build: cc percpu_counter.c $(pkg-config --cflags --libs iopages) -lpthread
 */
#include <pthread.h>
#include <stdio.h>

#include <iopages.h>

#define THREADS 4
#define ADDS 100000
#define BUDGET 1000

static iopages_counter *events, *in_flight;
static long admitted[THREADS];

static void *worker(void *arg) {
    long id = (long)arg;
    for (int i = 0; i < ADDS; i++) {
        iopages_counter_add(events, 1);
        /* Admit a request only while the budget holds; never give back. */
        if (iopages_counter_limited_add(in_flight, BUDGET, 1) == 1) admitted[id]++;
    }
    return NULL;
}

int main(void) {
    if (iopages_counter_create(0, 0, 0, &events) || iopages_counter_create(0, 0, 0, &in_flight)) {
        fprintf(stderr, "create: %s\n", iopages_last_error());
        return 1;
    }
    pthread_t t[THREADS];
    for (long i = 0; i < THREADS; i++) pthread_create(&t[i], NULL, worker, (void *)i);
    for (int i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
    long total = 0;
    for (int i = 0; i < THREADS; i++) total += admitted[i];
    int64_t bound;
    iopages_counter_error_bound(events, &bound);
    int64_t rough = iopages_counter_read(events), exact = iopages_counter_sum(events);
    printf("percpu_counter: exact %lld, rough %lld (within %lld)\n", (long long)exact, (long long)rough,
           (long long)bound);
    printf("percpu_counter: admitted %ld of a budget of %d\n", total, BUDGET);
    int ok = exact == (int64_t)THREADS * ADDS && rough >= exact - bound && rough <= exact + bound &&
             total == BUDGET && iopages_counter_sum(in_flight) == BUDGET &&
             iopages_counter_compare(events, exact) == 0;
    iopages_counter_destroy(events);
    iopages_counter_destroy(in_flight);
    printf("percpu_counter: %s\n", ok ? "ok" : "WRONG");
    return ok ? 0 : 1;
}
