/* The C ABI from C, on the simulator: every entry point, every bad input, threads with
 * their own streams freeing each other's blocks, record_stream, the statistics JSON, the
 * out-of-memory handler, the memory fraction and the peaks' reset, and the snapshot.
 *
 * Built and run by tests/c_abi.rs (cc -std=c11 -Wall -Wextra -Werror -pthread against
 * include/vrampool.h and libvrampool.so) with VRAMPOOL_DEVICE=sim. Exits 0 when every check
 * passed; otherwise prints the failed check and exits 1. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vrampool.h"

static int failures = 0;

#define CHECK(cond)                                                                     \
    do {                                                                                \
        if (!(cond)) {                                                                  \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);   \
            failures++;                                                                 \
        }                                                                               \
    } while (0)

/* The calling thread's error must be `code` with a message, then cleared. */
#define CHECK_ERROR(code)                                                               \
    do {                                                                                \
        int got_ = vrampool_last_error_code();                                          \
        const char *msg_ = vrampool_last_error();                                       \
        if (got_ != (code) || msg_ == NULL || msg_[0] == 0) {                           \
            fprintf(stderr, "%s:%d: expected error %d, got %d (%s)\n", __FILE__,        \
                    __LINE__, (int)(code), got_, msg_ ? msg_ : "no message");           \
            failures++;                                                                 \
        }                                                                               \
        CHECK(vrampool_last_error() == NULL);                                           \
        CHECK(vrampool_last_error_code() == 0);                                         \
    } while (0)

#define CHECK_NO_ERROR()                                                                \
    do {                                                                                \
        const char *msg_ = vrampool_last_error();                                       \
        if (msg_ != NULL) {                                                             \
            fprintf(stderr, "%s:%d: unexpected error: %s\n", __FILE__, __LINE__, msg_); \
            failures++;                                                                 \
        }                                                                               \
    } while (0)

/* A number from the device's statistics JSON. */
static long long stat(int device, const char *key) {
    char buf[8192];
    size_t n = vrampool_stats_json(device, buf, sizeof buf);
    if (n == 0 || n >= sizeof buf) {
        fprintf(stderr, "stats_json returned %zu\n", n);
        failures++;
        return -1;
    }
    char pattern[128];
    snprintf(pattern, sizeof pattern, "\"%s\":", key);
    const char *at = strstr(buf, pattern);
    if (at == NULL) {
        fprintf(stderr, "no key %s in %s\n", key, buf);
        failures++;
        return -1;
    }
    return strtoll(at + strlen(pattern), NULL, 10);
}

static void *stream_of(int i) { return (void *)(uintptr_t)(0x1000 + i); }

static void versions(void) {
    CHECK(vrampool_abi_version() == VRAMPOOL_ABI_VERSION);
    const char *v = vrampool_version();
    CHECK(v != NULL && strchr(v, '.') != NULL);
    CHECK(vrampool_last_error() == NULL);
}

static void malloc_inputs(void) {
    /* Empty tensors get NULL, without an error. */
    CHECK(vrampool_malloc(0, 0, NULL) == NULL);
    CHECK_NO_ERROR();
    CHECK(vrampool_malloc(-1, 0, NULL) == NULL);
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_ARGUMENT);
    CHECK(vrampool_malloc((ssize_t)1 << 50, 0, NULL) == NULL);
    int code = vrampool_last_error_code();
    CHECK(code == VRAMPOOL_ERROR_TOO_LARGE || code == VRAMPOOL_ERROR_OUT_OF_MEMORY);
    CHECK(vrampool_last_error() != NULL);
    CHECK(vrampool_malloc(4096, -1, NULL) == NULL);
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_ARGUMENT);
    CHECK(vrampool_malloc(4096, 7, NULL) == NULL); /* one simulated device */
    CHECK_ERROR(VRAMPOOL_ERROR_NO_DEVICE);
}

static void last_error_is_dlerror(void) {
    CHECK(vrampool_malloc(-5, 0, NULL) == NULL);
    /* A successful call neither sets nor clears it. */
    void *p = vrampool_malloc(512, 0, NULL);
    CHECK(p != NULL);
    const char *msg = vrampool_last_error();
    CHECK(msg != NULL && strstr(msg, "-5") != NULL);
    CHECK(vrampool_last_error() == NULL);
    vrampool_free(p, 512, 0, NULL);
    CHECK_NO_ERROR();
}

static void free_inputs(void) {
    long long invalid0 = stat(0, "abi_invalid_frees");
    long long double0 = stat(0, "abi_double_frees");
    long long size0 = stat(0, "abi_wrong_size_frees");
    long long stream0 = stat(0, "abi_wrong_stream_frees");

    vrampool_free(NULL, 0, 0, NULL);
    vrampool_free(NULL, 123, 99, stream_of(1));
    CHECK_NO_ERROR();

    const ssize_t n = 1 << 20;
    char *p = vrampool_malloc(n, 0, NULL);
    CHECK(p != NULL && ((uintptr_t)p % 256) == 0);
    /* Simulated device memory is host memory: it can be written. */
    memset(p, 0xab, (size_t)n);
    CHECK(stat(0, "allocated_bytes") >= n);

    int local = 0;
    vrampool_free(&local, 4, 0, NULL); /* foreign */
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_FREE);
    vrampool_free(p + 1, n - 1, 0, NULL); /* interior, off the grid */
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_FREE);
    vrampool_free(p + 4096, n - 4096, 0, NULL); /* interior, on the grid */
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_FREE);
    vrampool_free(p, n - 256, 0, NULL); /* wrong size */
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_FREE);
    vrampool_free(p, -1, 0, NULL); /* impossible size */
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_FREE);
    vrampool_free(p, n, 0, stream_of(42)); /* wrong stream */
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_FREE);
    vrampool_free(p, n, 3, NULL); /* a device with no pool */
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_FREE);
    /* None of those freed it. */
    CHECK(stat(0, "allocated_bytes") >= n);

    vrampool_free(p, n, 0, NULL);
    CHECK_NO_ERROR();
    vrampool_free(p, n, 0, NULL); /* double free */
    CHECK_ERROR(VRAMPOOL_ERROR_DOUBLE_FREE);

    CHECK(stat(0, "abi_invalid_frees") == invalid0 + 4);
    CHECK(stat(0, "abi_double_frees") == double0 + 1);
    CHECK(stat(0, "abi_wrong_size_frees") == size0 + 2);
    CHECK(stat(0, "abi_wrong_stream_frees") == stream0 + 1);
    CHECK(stat(0, "allocated_bytes") == 0);
}

static void stats_json_is_snprintf(void) {
    /* The figures move between calls (settling pending frees takes time, and the times are
     * figures), so the length asked first is room to start from, not the next call's. */
    size_t n = vrampool_stats_json(0, NULL, 0);
    CHECK(n > 2);
    CHECK_NO_ERROR();
    size_t room = n + 64;
    char *buf = malloc(room);
    memset(buf, 'x', room);
    size_t whole = vrampool_stats_json(0, buf, room);
    CHECK(whole > 2 && whole < room);
    CHECK(strlen(buf) == whole && buf[0] == '{' && buf[whole - 1] == '}');
    CHECK(strstr(buf, "\"allocated_bytes\":") != NULL);
    CHECK(strstr(buf, "\"reserved_bytes\":") != NULL);
    CHECK(strstr(buf, "\"abi_double_frees\":") != NULL);
    /* Too small: truncated and terminated, and the whole length still returned. */
    char small[10];
    memset(small, 'x', sizeof small);
    CHECK(vrampool_stats_json(0, small, sizeof small) > sizeof small);
    CHECK(strlen(small) == sizeof small - 1 && memcmp(small, buf, sizeof small - 1) == 0);
    char one = 'x';
    CHECK(vrampool_stats_json(0, &one, 1) > 2);
    CHECK(one == 0);
    free(buf);
    CHECK(vrampool_stats_json(0, NULL, 5) == 0);
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_ARGUMENT);
    CHECK(vrampool_stats_json(-1, NULL, 0) == 0);
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_ARGUMENT);
}

static void record_stream_inputs(void) {
    CHECK(vrampool_record_stream(NULL, NULL) == VRAMPOOL_ERROR_INVALID_ARGUMENT);
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_ARGUMENT);
    int local = 0;
    CHECK(vrampool_record_stream(&local, NULL) == VRAMPOOL_ERROR_INVALID_FREE);
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_FREE);
    char *p = vrampool_malloc(8192, 0, stream_of(1));
    CHECK(p != NULL);
    CHECK(vrampool_record_stream(p + 256, stream_of(2)) != 0);
    CHECK(vrampool_last_error() != NULL);
    /* Its own stream: nothing to do; another: recorded (twice is once). */
    CHECK(vrampool_record_stream(p, stream_of(1)) == 0);
    CHECK(vrampool_record_stream(p, stream_of(2)) == 0);
    CHECK(vrampool_record_stream(p, stream_of(2)) == 0);
    CHECK(vrampool_record_stream(p, NULL) == 0);
    CHECK_NO_ERROR();
    /* A recorded block is freed with its own stream, as any other. */
    vrampool_free(p, 8192, 0, stream_of(2));
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_FREE);
    vrampool_free(p, 8192, 0, stream_of(1));
    CHECK_NO_ERROR();
    CHECK(vrampool_record_stream(p, stream_of(2)) == VRAMPOOL_ERROR_DOUBLE_FREE);
    CHECK(vrampool_last_error() != NULL);
    vrampool_free(p, 8192, 0, stream_of(1));
    CHECK_ERROR(VRAMPOOL_ERROR_DOUBLE_FREE);
}

/* Threads, each with its own stream: each allocates, frees some blocks itself, records
 * another thread's stream on some, and hands the rest to the next thread to free. */
enum { THREADS = 4, ROUNDS = 2000, HANDOFF = 64 };

struct handoff {
    pthread_mutex_t lock;
    void *ptr[HANDOFF * 4];
    ssize_t size[HANDOFF * 4];
    void *stream[HANDOFF * 4];
    int n;
};

static struct handoff rings[THREADS];

/* Free every block handed to this thread so far, each on the stream it came with. */
static void drain(struct handoff *h) {
    pthread_mutex_lock(&h->lock);
    for (int i = 0; i < h->n; i++) {
        vrampool_free(h->ptr[i], h->size[i], 0, h->stream[i]);
    }
    h->n = 0;
    pthread_mutex_unlock(&h->lock);
}
static pthread_barrier_t start, drained;
static int thread_failures[THREADS];

/* A stream declared destroyed: its live block stays valid and frees with the same handle;
 * the handle's value then names a new stream; default streams are refused. */
static void stream_destroyed(void) {
    void *s = stream_of(99);
    void *kept = vrampool_malloc(8192, 0, s);
    void *p = vrampool_malloc(4096, 0, s);
    CHECK(kept != NULL && p != NULL);
    vrampool_free(p, 4096, 0, s);
    CHECK(vrampool_stream_destroyed(0, s) == 0);
    CHECK_NO_ERROR();
    CHECK(vrampool_stream_destroyed(0, s) == 0); /* nothing left to forget */
    void *q = vrampool_malloc(4096, 0, s);        /* a new stream behind the same value */
    CHECK(q != NULL);
    CHECK_NO_ERROR();
    vrampool_free(q, 4096, 0, s);
    vrampool_free(kept, 8192, 0, s);
    CHECK_NO_ERROR();
    CHECK(vrampool_stream_destroyed(0, NULL) != 0);
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_ARGUMENT);
    CHECK(vrampool_stream_destroyed(-1, s) != 0);
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_ARGUMENT);
    CHECK(vrampool_stream_destroyed(7, s) != 0);
    CHECK_ERROR(VRAMPOOL_ERROR_NO_DEVICE);
}

/* A stream a request, each declared destroyed after: the thread keeps no cache for the
 * streams gone (before, it kept one for every stream it had used). */
static void many_short_lived_streams(void) {
    long long before = stat(0, "thread_caches");
    for (int i = 0; i < 200; i++) {
        void *s = stream_of(1000 + i);
        void *p = vrampool_malloc(1 << 16, 0, s);
        CHECK(p != NULL);
        vrampool_free(p, 1 << 16, 0, s);
        CHECK(vrampool_stream_destroyed(0, s) == 0);
    }
    CHECK_NO_ERROR();
    CHECK(stat(0, "thread_caches") <= before + 1);
}

static void *worker(void *arg) {
    int me = (int)(intptr_t)arg;
    struct handoff *mine = &rings[me], *next = &rings[(me + 1) % THREADS];
    unsigned seed = 12345u + (unsigned)me;
    pthread_barrier_wait(&start);
    for (int r = 0; r < ROUNDS; r++) {
        ssize_t n = 256 + (ssize_t)(rand_r(&seed) % (1 << 18));
        char *p = vrampool_malloc(n, 0, stream_of(me));
        if (p == NULL) {
            fprintf(stderr, "thread %d: malloc(%zd): %s\n", me, n, vrampool_last_error());
            thread_failures[me]++;
            continue;
        }
        p[0] = (char)me;
        p[n - 1] = (char)r;
        if (r % 7 == 0 && vrampool_record_stream(p, stream_of((me + 2) % THREADS)) != 0) {
            fprintf(stderr, "thread %d: record_stream: %s\n", me, vrampool_last_error());
            thread_failures[me]++;
        }
        if (r % 2 == 0) {
            vrampool_free(p, n, 0, stream_of(me));
        } else {
            /* To the next thread, which frees it with this thread's stream. */
            pthread_mutex_lock(&next->lock);
            if (next->n < HANDOFF * 4) {
                next->ptr[next->n] = p;
                next->size[next->n] = n;
                next->stream[next->n] = stream_of(me);
                next->n++;
                p = NULL;
            }
            pthread_mutex_unlock(&next->lock);
            if (p != NULL) {
                vrampool_free(p, n, 0, stream_of(me));
            }
        }
        if (r % 16 == 0 || r == ROUNDS - 1) {
            drain(mine);
        }
        if (vrampool_last_error() != NULL) {
            thread_failures[me]++;
        }
    }
    pthread_barrier_wait(&drained);
    /* Blocks handed over after this thread's last drain. */
    drain(mine);
    if (vrampool_last_error() != NULL) {
        thread_failures[me]++;
    }
    return NULL;
}

static void threads(void) {
    long long foreign0 = stat(0, "abi_foreign_frees");
    pthread_t t[THREADS];
    pthread_barrier_init(&start, NULL, THREADS);
    pthread_barrier_init(&drained, NULL, THREADS);
    for (int i = 0; i < THREADS; i++) {
        pthread_mutex_init(&rings[i].lock, NULL);
        rings[i].n = 0;
    }
    for (int i = 0; i < THREADS; i++) {
        CHECK(pthread_create(&t[i], NULL, worker, (void *)(intptr_t)i) == 0);
    }
    for (int i = 0; i < THREADS; i++) {
        pthread_join(t[i], NULL);
        CHECK(thread_failures[i] == 0);
    }
    CHECK(stat(0, "abi_foreign_frees") > foreign0);
    CHECK(stat(0, "abi_pending_frees") == 0);
    CHECK(stat(0, "allocated_bytes") == 0);
    CHECK(stat(0, "abi_late_double_frees") == 0);
}

/* A capture's graph pool, as a C program that captures declares it: the capture's memory
 * comes from the pool, is refused when freed wrongly, and goes back once the pool is
 * released, its blocks freed and the cache emptied. */
static void *malloc_on_a_thread(void *arg) {
    (void)arg;
    return vrampool_malloc(3000, 0, stream_of(51));
}

/* vrampool_free_any: a block freed by its address alone, whoever allocated it and however it
 * is held (its owner's slot, another thread's, a record_stream record, a graph pool), answers
 * its size and stream; a pointer that is no live block is refused as vrampool_free refuses. */
static void free_any(void) {
    size_t size = 1;
    int device = -1;
    void *stream = &size;
    CHECK(vrampool_free_any(NULL, &size, &device, &stream) == 0);
    CHECK(size == 1 && device == -1 && stream == (void *)&size); /* NULL: nothing written */
    int local;
    CHECK(vrampool_free_any(&local, NULL, NULL, NULL) == VRAMPOOL_ERROR_INVALID_FREE);
    CHECK(vrampool_last_error() != NULL);

    char *p = vrampool_malloc(5000, 0, stream_of(50));
    CHECK(p != NULL);
    CHECK(vrampool_free_any(p + 256, NULL, NULL, NULL) != 0); /* interior */
    CHECK(vrampool_last_error() != NULL);
    CHECK(vrampool_free_any(p, &size, &device, &stream) == 0);
    CHECK(size == 5000 && device == 0 && stream == stream_of(50));
    CHECK(vrampool_free_any(p, NULL, NULL, NULL) == VRAMPOOL_ERROR_DOUBLE_FREE);
    CHECK(vrampool_last_error() != NULL);

    /* This thread's blocks on two streams, freed after its memo moved to the second. */
    void *a = vrampool_malloc(1000, 0, stream_of(54));
    void *b = vrampool_malloc(2000, 0, stream_of(55));
    CHECK(a != NULL && b != NULL);
    CHECK(vrampool_free_any(a, &size, &device, &stream) == 0);
    CHECK(size == 1000 && device == 0 && stream == stream_of(54));
    CHECK(vrampool_free_any(b, &size, &device, &stream) == 0);
    CHECK(size == 2000 && device == 0 && stream == stream_of(55));
    CHECK(vrampool_free_any(a, NULL, NULL, NULL) == VRAMPOOL_ERROR_DOUBLE_FREE);
    CHECK(vrampool_last_error() != NULL);

    pthread_t t;
    void *q = NULL;
    CHECK(pthread_create(&t, NULL, malloc_on_a_thread, NULL) == 0);
    CHECK(pthread_join(t, &q) == 0);
    CHECK(q != NULL);
    CHECK(vrampool_free_any(q, &size, NULL, &stream) == 0);
    CHECK(size == 3000 && stream == stream_of(51));

    void *r = vrampool_malloc(70000, 0, stream_of(52));
    CHECK(r != NULL && vrampool_record_stream(r, stream_of(50)) == 0);
    CHECK(vrampool_free_any(r, &size, &device, &stream) == 0);
    CHECK(size == 70000 && stream == stream_of(52));

    void *s = stream_of(53);
    CHECK(vrampool_begin_allocate_to_pool(0, 8, 0) == 0);
    void *g = vrampool_malloc_to_pool(4096, 0, s, 8, 0);
    CHECK(g != NULL);
    CHECK(vrampool_free_any(g, &size, &device, &stream) == 0);
    CHECK(size == 4096 && device == 0 && stream == s);
    CHECK(vrampool_free_any(g, NULL, NULL, NULL) == VRAMPOOL_ERROR_DOUBLE_FREE);
    CHECK(vrampool_last_error() != NULL);
    CHECK(vrampool_end_allocate_to_pool(0, 8, 0) == 0);
    CHECK(vrampool_release_pool(0, 8, 0) == 0);
    CHECK(vrampool_empty_cache() == 0); /* the released graph pool goes back */
    CHECK(stat(0, "graph_pools") == 0);
    CHECK_NO_ERROR();
}

static void graph_pool(void) {
    void *s = stream_of(40);
    CHECK(vrampool_malloc_to_pool(4096, 0, s, 5, 0) == NULL); /* not opened */
    CHECK(vrampool_last_error() != NULL);
    CHECK(vrampool_begin_allocate_to_pool(0, 5, 0) == 0);
    void *p = vrampool_malloc_to_pool(1 << 20, 0, s, 5, 0);
    CHECK(p != NULL && ((uintptr_t)p % 256) == 0);
    CHECK(stat(0, "graph_pool_blocks") == 1);
    vrampool_free(p, (1 << 20) + 1, 0, s);
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_FREE);
    vrampool_free(p, 1 << 20, 0, s);
    CHECK_NO_ERROR();
    vrampool_free(p, 1 << 20, 0, s);
    CHECK_ERROR(VRAMPOOL_ERROR_DOUBLE_FREE);
    CHECK(vrampool_end_allocate_to_pool(0, 5, 0) == 0);
    CHECK(vrampool_end_allocate_to_pool(0, 5, 0) == VRAMPOOL_ERROR_INVALID_ARGUMENT);
    CHECK(vrampool_last_error() != NULL);
    CHECK(vrampool_release_pool(0, 5, 0) == 0);
    CHECK(stat(0, "graph_pools") == 1);
    CHECK(vrampool_empty_cache() == 0);
    CHECK(stat(0, "graph_pools") == 0);
    CHECK(stat(0, "graph_pool_reserved_bytes") == 0);
}

/* Run with a bad VRAMPOOL_DEVICE: every call that needs a pool fails with a clear error. */
static int bad_config(void) {
    CHECK(vrampool_malloc(4096, 0, NULL) == NULL);
    CHECK(vrampool_last_error_code() == VRAMPOOL_ERROR_CONFIG);
    const char *msg = vrampool_last_error();
    CHECK(msg != NULL && strstr(msg, "VRAMPOOL_DEVICE") != NULL);
    CHECK(vrampool_stats_json(0, NULL, 0) == 0);
    CHECK(vrampool_last_error_code() == VRAMPOOL_ERROR_CONFIG);
    CHECK(vrampool_last_error() != NULL);
    /* Nothing to trim: succeeds. */
    CHECK(vrampool_empty_cache() == 0);
    if (failures != 0) {
        fprintf(stderr, "%d checks failed\n", failures);
        return 1;
    }
    printf("C ABI test (bad configuration): every check passed\n");
    return 0;
}

/* Run with VRAMPOOL_RECORD_TRACE set: three allocations on two streams, two frees, one
 * flush in the middle; what follows the flush reaches the file when the process exits.
 * Before them, paused from the start (before the pool exists), a block that the file must
 * leave out whole, its free after the pause included. */
static int trace(void) {
    CHECK(vrampool_pause_traces(1) == 0);
    void *hidden = vrampool_malloc(4096, 0, stream_of(3));
    CHECK(hidden != NULL);
    CHECK(vrampool_pause_traces(0) == 0);
    void *a = vrampool_malloc(1000, 0, stream_of(1));
    void *b = vrampool_malloc(3 << 20, 0, stream_of(2));
    CHECK(a != NULL && b != NULL);
    vrampool_free(a, 1000, 0, stream_of(1));
    vrampool_free(hidden, 4096, 0, stream_of(3));
    CHECK(vrampool_flush_traces() == 0);
    vrampool_free(b, 3 << 20, 0, stream_of(2));
    CHECK(vrampool_malloc(77, 0, stream_of(1)) != NULL); /* live at exit */
    CHECK_NO_ERROR();
    if (failures != 0) {
        fprintf(stderr, "%d checks failed\n", failures);
        return 1;
    }
    printf("C ABI test (trace): every check passed\n");
    return 0;
}

/* The out-of-memory handler: it frees a block the program kept as spare and the allocation
 * that ran out is tried again; with nothing left to free it declines and the allocation
 * fails; removed, it is not called. The pool's limit is 80% of the simulated 2 GiB, so two
 * blocks of 1 GiB never fit at once. */
static void *oom_spare = NULL;
static int oom_calls = 0;

static int free_the_spare(size_t requested, int device, void *user) {
    oom_calls++;
    CHECK(requested == (size_t)1 << 30 && device == 0 && user == &oom_calls);
    if (oom_spare == NULL) {
        return 0;
    }
    /* Calls into the library on another stream first: the allocation under the handler
     * must still be published as its own. */
    void *other = vrampool_malloc(4096, 0, stream_of(7));
    CHECK(other != NULL);
    vrampool_free(other, 4096, 0, stream_of(7));
    vrampool_free(oom_spare, (ssize_t)1 << 30, 0, NULL);
    oom_spare = NULL;
    return 1;
}

static void oom_handler(void) {
    const ssize_t gib = (ssize_t)1 << 30;
    long long calls0 = stat(0, "oom_handler_calls");
    long long rescues0 = stat(0, "oom_rescues");
    oom_spare = vrampool_malloc(gib, 0, NULL);
    CHECK(oom_spare != NULL);
    CHECK(vrampool_set_oom_handler(0, free_the_spare, &oom_calls) == 0);
    void *p = vrampool_malloc(gib, 0, NULL);
    CHECK(p != NULL && oom_spare == NULL && oom_calls == 1);
    CHECK_NO_ERROR();
    CHECK(vrampool_malloc(gib, 0, NULL) == NULL);
    CHECK_ERROR(VRAMPOOL_ERROR_OUT_OF_MEMORY);
    CHECK(oom_calls == 2); /* asked once more, declined */
    CHECK(stat(0, "oom_handler_calls") == calls0 + 2);
    CHECK(stat(0, "oom_rescues") == rescues0 + 1);
    CHECK(vrampool_set_oom_handler(0, NULL, NULL) == 0);
    CHECK(vrampool_malloc(gib, 0, NULL) == NULL);
    CHECK_ERROR(VRAMPOOL_ERROR_OUT_OF_MEMORY);
    CHECK(oom_calls == 2); /* removed: not asked */
    CHECK(vrampool_set_oom_handler(-1, free_the_spare, NULL) == VRAMPOOL_ERROR_INVALID_ARGUMENT);
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_ARGUMENT);
    vrampool_free(p, gib, 0, NULL);
    CHECK_NO_ERROR();
}

/* The memory fraction (PyTorch's set_per_process_memory_fraction): at a quarter of the
 * simulated 2 GiB, 1 GiB does not fit; at the pool's own 80% again it does; out of (0, 1]
 * or above those 80% is refused. */
static void memory_fraction(void) {
    const ssize_t gib = (ssize_t)1 << 30;
    CHECK(vrampool_empty_cache() == 0);
    CHECK(vrampool_set_memory_fraction(0, 0.25) == 0);
    /* The limit now, as PyTorch's get_per_process_memory_fraction reads it: a quarter of
     * the device, rounded down to whole pages. */
    long long total = stat(0, "device_memory_bytes"), limit = stat(0, "max_reserved_bytes");
    CHECK(total == 2 * gib && limit <= total / 4 && limit > total / 4 - (2 << 20));
    CHECK(vrampool_malloc(gib, 0, NULL) == NULL);
    CHECK_ERROR(VRAMPOOL_ERROR_OUT_OF_MEMORY);
    CHECK(vrampool_set_memory_fraction(0, 0.8) == 0);
    CHECK(stat(0, "max_reserved_bytes") > limit);
    void *p = vrampool_malloc(gib, 0, NULL);
    CHECK(p != NULL);
    CHECK_NO_ERROR();
    vrampool_free(p, gib, 0, NULL);
    CHECK(vrampool_set_memory_fraction(0, 0.0) == VRAMPOOL_ERROR_INVALID_ARGUMENT);
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_ARGUMENT);
    CHECK(vrampool_set_memory_fraction(0, 1.5) == VRAMPOOL_ERROR_INVALID_ARGUMENT);
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_ARGUMENT);
    CHECK(vrampool_set_memory_fraction(0, 0.9) == VRAMPOOL_ERROR_INVALID_ARGUMENT); /* above 80% */
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_ARGUMENT);
    CHECK(vrampool_set_memory_fraction(-1, 0.5) == VRAMPOOL_ERROR_INVALID_ARGUMENT);
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_ARGUMENT);
    /* The peaks start again: the gigabyte above is no longer the peak once freed, trimmed
     * and reset. */
    CHECK(vrampool_empty_cache() == 0);
    CHECK(stat(0, "peak_reserved_bytes") >= gib);
    CHECK(vrampool_reset_peak_stats(0) == 0);
    CHECK(stat(0, "peak_reserved_bytes") < gib && stat(0, "peak_allocated_bytes") < gib);
    CHECK(vrampool_reset_peak_stats(-1) == VRAMPOOL_ERROR_INVALID_ARGUMENT);
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_ARGUMENT);
}

/* A snapshot taken with room for every extent (asked twice, as the header says). */
static vrampool_extent *take_snapshot(int device, size_t *n) {
    size_t count = 0;
    CHECK(vrampool_snapshot(device, NULL, 0, &count) == 0);
    for (int tries = 0; tries < 8; tries++) {
        size_t cap = count + 16;
        vrampool_extent *out = calloc(cap, sizeof *out);
        CHECK(vrampool_snapshot(device, out, cap, &count) == 0);
        if (count <= cap) {
            *n = count;
            return out;
        }
        free(out);
    }
    CHECK(!"the snapshot kept growing");
    *n = 0;
    return NULL;
}

/* The extent that starts at `p`, or NULL. */
static const vrampool_extent *extent_at(const vrampool_extent *e, size_t n, const void *p) {
    for (size_t i = 0; i < n; i++) {
        if (e[i].addr == (uint64_t)(uintptr_t)p) {
            return &e[i];
        }
    }
    return NULL;
}

/* Each segment is covered end to end by its extents, in address order. */
static void check_coverage(const vrampool_extent *e, size_t n) {
    for (size_t i = 0; i < n; i++) {
        int first = i == 0 || e[i].segment != e[i - 1].segment || e[i].pool_a != e[i - 1].pool_a ||
                    e[i].pool_b != e[i - 1].pool_b;
        CHECK(e[i].bytes > 0);
        CHECK(e[i].addr == (first ? e[i].segment : e[i - 1].addr + e[i - 1].bytes));
        int last = i + 1 == n || e[i + 1].segment != e[i].segment || e[i + 1].pool_a != e[i].pool_a ||
                   e[i + 1].pool_b != e[i].pool_b;
        if (last) {
            CHECK(e[i].addr + e[i].bytes == e[i].segment + e[i].segment_bytes);
        }
    }
}

/* The snapshot: every live block with its bytes asked for and its stream, memory covered
 * end to end, a freed block no longer live, a graph pool's block under its pool's id, and
 * bad arguments refused. */
static void snapshot(void) {
    void *s1 = stream_of(50), *s2 = stream_of(51);
    const ssize_t sizes[3] = {1000, 3 << 20, 256};
    void *streams[3] = {s1, s2, NULL};
    void *p[3];
    for (int i = 0; i < 3; i++) {
        p[i] = vrampool_malloc(sizes[i], 0, streams[i]);
        CHECK(p[i] != NULL);
    }
    CHECK(vrampool_begin_allocate_to_pool(0, 6, 0) == 0);
    void *g = vrampool_malloc_to_pool(5000, 0, s1, 6, 0);
    CHECK(g != NULL);
    size_t n = 0;
    vrampool_extent *e = take_snapshot(0, &n);
    check_coverage(e, n);
    for (int i = 0; i < 3; i++) {
        const vrampool_extent *x = extent_at(e, n, p[i]);
        CHECK(x != NULL && x->state == VRAMPOOL_EXTENT_LIVE && x->requested == (uint64_t)sizes[i] &&
              x->bytes >= (uint64_t)sizes[i] && x->stream == streams[i] && x->pool_a == 0);
    }
    free(e);
    /* A block given to record_stream is kept in a record the picture does not read: its
     * capacity stands for its size, with no stream. */
    CHECK(vrampool_record_stream(p[1], s1) == 0);
    e = take_snapshot(0, &n);
    check_coverage(e, n);
    const vrampool_extent *xr = extent_at(e, n, p[1]);
    CHECK(xr != NULL && xr->state == VRAMPOOL_EXTENT_LIVE && xr->requested == xr->bytes &&
          xr->bytes >= (uint64_t)sizes[1] && xr->stream == NULL);
    const vrampool_extent *xg = extent_at(e, n, g);
    CHECK(xg != NULL && xg->state == VRAMPOOL_EXTENT_LIVE && xg->requested == 5000 && xg->pool_a == 6 &&
          xg->pool_b == 0);
    /* A short array gets the first extents and the whole count. */
    if (n > 1) {
        vrampool_extent one[1];
        size_t count = 0;
        CHECK(vrampool_snapshot(0, one, 1, &count) == 0 && count >= n - 1);
        CHECK(one[0].addr == e[0].addr);
    }
    free(e);
    vrampool_free(p[0], sizes[0], 0, s1);
    e = take_snapshot(0, &n);
    check_coverage(e, n);
    const vrampool_extent *x = extent_at(e, n, p[0]);
    CHECK(x == NULL || x->state != VRAMPOOL_EXTENT_LIVE || x->requested == 0);
    free(e);
    for (int i = 1; i < 3; i++) {
        vrampool_free(p[i], sizes[i], 0, streams[i]);
    }
    vrampool_free(g, 5000, 0, s1);
    CHECK(vrampool_end_allocate_to_pool(0, 6, 0) == 0);
    CHECK(vrampool_release_pool(0, 6, 0) == 0);
    CHECK_NO_ERROR();
    size_t count = 7;
    CHECK(vrampool_snapshot(3, NULL, 0, &count) == 0 && count == 0); /* never used */
    CHECK(vrampool_snapshot(0, NULL, 0, NULL) == VRAMPOOL_ERROR_INVALID_ARGUMENT);
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_ARGUMENT);
    CHECK(vrampool_snapshot(0, NULL, 4, &count) == VRAMPOOL_ERROR_INVALID_ARGUMENT);
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_ARGUMENT);
    CHECK(vrampool_snapshot(-1, NULL, 0, &count) == VRAMPOOL_ERROR_INVALID_ARGUMENT);
    CHECK_ERROR(VRAMPOOL_ERROR_INVALID_ARGUMENT);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "bad-config") == 0) {
        return bad_config();
    }
    if (argc > 1 && strcmp(argv[1], "trace") == 0) {
        return trace();
    }
    versions();
    malloc_inputs();
    last_error_is_dlerror();
    free_inputs();
    stats_json_is_snprintf();
    record_stream_inputs();
    stream_destroyed();
    many_short_lived_streams();
    threads();
    graph_pool();
    free_any();
    oom_handler();
    memory_fraction();
    snapshot();
    CHECK(vrampool_flush_traces() == 0); /* nothing records: nothing to do */
    CHECK(stat(0, "allocated_bytes") == 0);
    CHECK(vrampool_empty_cache() == 0);
    CHECK_NO_ERROR();
    CHECK(stat(0, "allocated_bytes") == 0);
    CHECK(stat(0, "reserved_bytes") == 0);
    CHECK(stat(0, "abi_internal_errors") == 0);
    if (failures != 0) {
        fprintf(stderr, "%d checks failed\n", failures);
        return 1;
    }
    printf("C ABI test: every check passed\n");
    return 0;
}
