// Whether event records on a GPU kept busy by many threads cost what the threads' own kernel
// launches cost: T threads (1, 4, 16), each with its own stream, launch fill kernels over
// their own buffer (a 4 MiB block's worth of work each, as the demo's larger blocks) for two
// seconds, and every 8 launches record an event and query the one before, as the pool does
// for a batch of frees. The record goes on the thread's own stream, then (second round) on
// the next thread's stream, as the pool's records for another stream's memory do (a device
// wait's event, a hurry, a block used on several streams). Each call is timed on the
// calling thread; printed per T: the mean and worst launch, record and query, and of the
// capture check the pool makes before it records or polls on a stream (cuStreamIsCapturing,
// on the same stream as the record). No allocator
// is involved: what a record costs here is the driver's and the GPU's.
// Build and run on the GPU machine:
//   nvcc -O2 -o record_threads benches/record_threads.cu -lcuda -lpthread && ./record_threads
// Measured on an H100 (driver 580): docs/BENCHMARKS.md.
#include <cuda.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <time.h>

__global__ void fill(unsigned long long *p, unsigned long long words, unsigned long long tag) {
  for (unsigned long long k = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; k < words;
       k += (unsigned long long)gridDim.x * blockDim.x)
    p[k] = tag ^ k;
}

static double now_ns() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }

struct Timing { double sum, worst; long n; };
static void note(struct Timing *t, double ns) { t->sum += ns; t->n++; if (ns > t->worst) t->worst = ns; }

struct Worker { int seconds; cudaStream_t own, other; struct Timing launch, record, query, capture; int failed; };

static void *work(void *arg) {
  struct Worker *w = (struct Worker *)arg;
  const unsigned long long words = (4u << 20) / 8;
  cudaStream_t s = w->own;
  unsigned long long *buf;
  cudaEvent_t ev[2];
  if (cudaMalloc(&buf, words * 8) != cudaSuccess ||
      cudaEventCreateWithFlags(&ev[0], cudaEventDisableTiming) != cudaSuccess ||
      cudaEventCreateWithFlags(&ev[1], cudaEventDisableTiming) != cudaSuccess) {
    w->failed = 1;
    return NULL;
  }
  double end = now_ns() + w->seconds * 1e9;
  for (long i = 0; now_ns() < end; i++) {
    double t = now_ns();
    fill<<<1024, 256, 0, s>>>(buf, words, (unsigned long long)i);
    note(&w->launch, now_ns() - t);
    if (i % 8 == 7) {
      cudaEvent_t cur = ev[(i / 8) % 2], prev = ev[(i / 8 + 1) % 2];
      CUstreamCaptureStatus cs;
      t = now_ns();
      if (cuStreamIsCapturing((CUstream)w->other, &cs) != CUDA_SUCCESS) w->failed = 1;
      note(&w->capture, now_ns() - t);
      t = now_ns();
      cudaEventRecord(cur, w->other);
      note(&w->record, now_ns() - t);
      t = now_ns();
      cudaEventQuery(prev);
      note(&w->query, now_ns() - t);
    }
  }
  // A failed launch shows here (cudaEventQuery's "not ready" is not an error to keep).
  if (cudaStreamSynchronize(s) != cudaSuccess) w->failed = 1;
  cudaEventDestroy(ev[0]);
  cudaEventDestroy(ev[1]);
  cudaFree(buf);
  return NULL;
}

int main() {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (cudaFree(0) != cudaSuccess) { printf("no CUDA\n"); return 1; }
  const int threads[] = {1, 4, 16};
  cudaStream_t streams[16];
  for (int i = 0; i < 16; i++)
    if (cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking) != cudaSuccess) { printf("no stream\n"); return 1; }
  for (int round = 0; round < 6; round++) {
    int n = threads[round % 3], next = round / 3;
    struct Worker w[16] = {{0}};
    pthread_t th[16];
    for (int i = 0; i < n; i++) {
      w[i].seconds = 2;
      w[i].own = streams[i];
      w[i].other = streams[(i + next) % n];
      pthread_create(&th[i], NULL, work, &w[i]);
    }
    struct Timing launch = {0}, record = {0}, query = {0}, capture = {0};
    int failed = 0;
    for (int i = 0; i < n; i++) {
      pthread_join(th[i], NULL);
      failed |= w[i].failed;
      launch.sum += w[i].launch.sum; launch.n += w[i].launch.n; if (w[i].launch.worst > launch.worst) launch.worst = w[i].launch.worst;
      record.sum += w[i].record.sum; record.n += w[i].record.n; if (w[i].record.worst > record.worst) record.worst = w[i].record.worst;
      query.sum += w[i].query.sum; query.n += w[i].query.n; if (w[i].query.worst > query.worst) query.worst = w[i].query.worst;
      capture.sum += w[i].capture.sum; capture.n += w[i].capture.n; if (w[i].capture.worst > capture.worst) capture.worst = w[i].capture.worst;
    }
    if (failed) { printf("%2d threads: a CUDA call failed\n", n); return 1; }
    printf("%2d threads, records on %s: %8ld launches, mean %9.1f ns (worst %11.1f); records mean %9.1f ns (worst %11.1f); queries mean %9.1f ns (worst %11.1f); capture checks mean %9.1f ns (worst %11.1f)\n",
           n, next ? "the next thread's stream" : "their own stream  ", launch.n, launch.sum / launch.n, launch.worst, record.sum / record.n, record.worst, query.sum / query.n, query.worst, capture.sum / capture.n, capture.worst);
  }
  return 0;
}
