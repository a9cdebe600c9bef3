// What the driver calls on vrampool's miss path cost when nothing waits on the GPU: the
// capture-mode exchange and the context check `CudaDevice` makes around every call, the
// capture query every miss makes, and the event calls of a free's cadence. One thread,
// then the same on 16 threads at once (each its own stream), ns per call. Then what an
// event record costs on a stream with a long queue of work ahead of it (host functions of
// 10 us each, as a busy server's stream holds kernels): whether a record waits for room.
// Build and run on the GPU machine: nvcc -O2 -o driver_calls benches/driver_calls.c -lcuda -lpthread
// Measured on an H100 (driver 580): docs/BENCHMARKS.md.
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <time.h>
#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* s; cuGetErrorString(r_, &s); printf("FAIL %s: %d %s (line %d)\n", #x, r_, s, __LINE__); return NULL; } } while (0)
#define ITERS 200000
static CUcontext ctx;
static double now_ns(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
struct result { double exchange, ctx_get, is_capturing, event_query, event_record, stream_get_id; };
static void* run(void* out) {
  struct result* r = out;
  CK(cuCtxSetCurrent(ctx));
  CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUevent e; CK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
  CK(cuEventRecord(e, s)); CK(cuStreamSynchronize(s));
  double t;
  t = now_ns();
  for (int i = 0; i < ITERS; i++) { CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_RELAXED; cuThreadExchangeStreamCaptureMode(&m); }
  r->exchange = (now_ns() - t) / ITERS;
  t = now_ns();
  for (int i = 0; i < ITERS; i++) { CUcontext c; cuCtxGetCurrent(&c); }
  r->ctx_get = (now_ns() - t) / ITERS;
  t = now_ns();
  for (int i = 0; i < ITERS; i++) { CUstreamCaptureStatus st; cuStreamIsCapturing(s, &st); }
  r->is_capturing = (now_ns() - t) / ITERS;
  t = now_ns();
  for (int i = 0; i < ITERS; i++) cuEventQuery(e);
  r->event_query = (now_ns() - t) / ITERS;
  t = now_ns();
  for (int i = 0; i < ITERS / 10; i++) cuEventRecord(e, s);
  r->event_record = (now_ns() - t) / (ITERS / 10);
  CK(cuStreamSynchronize(s));
  t = now_ns();
  for (int i = 0; i < ITERS; i++) { unsigned long long id; cuStreamGetId(s, &id); }
  r->stream_get_id = (now_ns() - t) / ITERS;
  cuEventDestroy(e); cuStreamDestroy(s);
  return NULL;
}
static void print(const char* what, struct result* r, int n) {
  double a[6] = {0};
  for (int i = 0; i < n; i++) { a[0] += r[i].exchange; a[1] += r[i].ctx_get; a[2] += r[i].is_capturing; a[3] += r[i].event_query; a[4] += r[i].event_record; a[5] += r[i].stream_get_id; }
  printf("%-12s exchange-capture-mode %6.1f  ctx-get-current %6.1f  stream-is-capturing %6.1f  event-query %6.1f  event-record %6.1f  stream-get-id %6.1f ns\n",
         what, a[0] / n, a[1] / n, a[2] / n, a[3] / n, a[4] / n, a[5] / n);
}
static void CUDA_CB spin10(void* arg) {
  (void)arg;
  double t = now_ns();
  while (now_ns() - t < 10000) {}
}
static void* queued(void* unused) {
  (void)unused;
  CK(cuCtxSetCurrent(ctx));
  CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUevent e; CK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
  const int depth[] = {0, 100, 1000, 4000, 16000};
  for (int d = 0; d < 5; d++) {
    double t = now_ns();
    for (int i = 0; i < depth[d]; i++) CK(cuLaunchHostFunc(s, spin10, NULL));
    double enq = (now_ns() - t) / (depth[d] ? depth[d] : 1);
    double worst = 0, sum = 0;
    for (int i = 0; i < 200; i++) {
      double t0 = now_ns();
      CK(cuEventRecord(e, s));
      double took = now_ns() - t0;
      sum += took; if (took > worst) worst = took;
      CK(cuLaunchHostFunc(s, spin10, NULL));
    }
    printf("queue of %5d host functions (enqueued at %7.1f ns each): event-record mean %9.1f ns, worst %10.1f ns\n", depth[d], enq, sum / 200, worst);
    CK(cuStreamSynchronize(s));
  }
  cuEventDestroy(e); cuStreamDestroy(s);
  return NULL;
}
int main(void) {
  if (cuInit(0) != CUDA_SUCCESS) { printf("no CUDA\n"); return 1; }
  CUdevice dev; cuDeviceGet(&dev, 0); cuDevicePrimaryCtxRetain(&ctx, dev);
  struct result one[1], many[16];
  for (int rep = 0; rep < 2; rep++) {
    run(&one[0]); print("1 thread", one, 1);
    pthread_t th[16];
    for (int i = 0; i < 16; i++) pthread_create(&th[i], NULL, run, &many[i]);
    for (int i = 0; i < 16; i++) pthread_join(th[i], NULL);
    print("16 threads", many, 16);
  }
  queued(NULL);
  return 0;
}
