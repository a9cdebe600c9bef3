// Whether an event record waits when its stream has a long queue of kernels ahead of it, as
// a busy server's streams do: queue N kernels of ~10 us on one stream, then time 200 records,
// each followed by one more kernel. (benches/driver_calls.c does the same with host
// functions.) Build and run on the GPU machine:
//   nvcc -O2 -o record_queue benches/record_queue.cu -lcuda && ./record_queue
// Measured on an H100 (driver 580): docs/BENCHMARKS.md.
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <time.h>

__global__ void spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {}
}

static double now_ns() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }

int main() {
  setvbuf(stdout, NULL, _IOLBF, 0);
  cudaStream_t s;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) { printf("no CUDA\n"); return 1; }
  int khz = 0;
  cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0);
  long long ten_us = (long long)khz / 100;  // cycles in 10 us at the reported clock (kHz)
  cudaEvent_t e;
  cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  spin<<<1, 1, 0, s>>>(ten_us);
  cudaStreamSynchronize(s);
  const int depth[] = {0, 100, 1000, 2000, 4000, 16000};
  for (int d = 0; d < 6; d++) {
    double t = now_ns();
    for (int i = 0; i < depth[d]; i++) spin<<<1, 1, 0, s>>>(ten_us);
    double enq = (now_ns() - t) / (depth[d] ? depth[d] : 1);
    double worst = 0, sum = 0, launch = 0;
    for (int i = 0; i < 200; i++) {
      double t0 = now_ns();
      cudaEventRecord(e, s);
      double took = now_ns() - t0;
      sum += took;
      if (took > worst) worst = took;
      double t1 = now_ns();
      spin<<<1, 1, 0, s>>>(ten_us);
      launch += now_ns() - t1;
    }
    printf("queue of %5d kernels (launched at %8.1f ns each): record mean %9.1f ns, worst %10.1f ns; the launch after it %9.1f ns\n",
           depth[d], enq, sum / 200, worst, launch / 200);
    cudaStreamSynchronize(s);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) { printf("error %s\n", cudaGetErrorString(err)); return 1; }
  return 0;
}
