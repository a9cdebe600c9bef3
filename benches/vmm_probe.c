// What CUDA's virtual memory calls cost for a run of pages, by how the run is made:
//   A  page by page: cuMemCreate + cuMemMap + cuMemRelease + cuMemSetAccess per page;
//   B  one allocation per page, then one cuMemSetAccess (and one cuMemUnmap) over the run;
//   C  one allocation for the whole run;
//   D  loans: each page's allocation mapped again elsewhere (cuMemRetainAllocationHandle),
//      access granted page by page or once;
//   E  whether cuMemMap takes an offset into an allocation (a page of a run mapped alone).
// Build and run on the GPU machine: nvcc -O2 -o vmm_probe benches/vmm_probe.c -lcuda
// Measured on an H200 (driver 580): docs/BENCHMARKS.md.
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* s; cuGetErrorString(r_, &s); printf("FAIL %s: %d %s (line %d)\n", #x, r_, s, __LINE__); return 1; } } while (0)
#define TRY(x) ((x) == CUDA_SUCCESS)
static double now_us(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }
int main(void) {
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CUmemAllocationProp prop = {0}; prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = dev;
  size_t g; CK(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  CUmemAccessDesc acc = {0}; acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const int N[] = {1, 4, 16, 64};
  CUdeviceptr va; size_t range = 4ull << 30; CK(cuMemAddressReserve(&va, range, 0, 0, 0));
  CUdeviceptr va2 = va + (1ull << 30);
  printf("granularity %zu\n", g);
  for (int rep = 0; rep < 3; rep++) for (int k = 0; k < 4; k++) {
    int n = N[k]; double t0, t1, t2, t3;
    // A: page by page, each create+map+release+setAccess.
    t0 = now_us();
    for (int i = 0; i < n; i++) { CUmemGenericAllocationHandle h; CK(cuMemCreate(&h, g, &prop, 0)); CK(cuMemMap(va + i * g, g, 0, h, 0)); CK(cuMemRelease(h)); CK(cuMemSetAccess(va + i * g, g, &acc, 1)); }
    t1 = now_us();
    for (int i = 0; i < n; i++) CK(cuMemUnmap(va + i * g, g));
    t2 = now_us();
    printf("rep %d n %2d A per-page map %8.1f us (%6.1f/page)  unmap per page %8.1f us (%6.1f/page)\n", rep, n, t1 - t0, (t1 - t0) / n, t2 - t1, (t2 - t1) / n);
    // B: per-page handles, one setAccess over the run.
    t0 = now_us();
    for (int i = 0; i < n; i++) { CUmemGenericAllocationHandle h; CK(cuMemCreate(&h, g, &prop, 0)); CK(cuMemMap(va + i * g, g, 0, h, 0)); CK(cuMemRelease(h)); }
    t1 = now_us();
    int ok = TRY(cuMemSetAccess(va, n * g, &acc, 1));
    t2 = now_us();
    // a kernel-free check that the memory is usable: memset and read back
    int usable = ok && TRY(cuMemsetD8(va, 7, n * g)) && TRY(cuCtxSynchronize());
    unsigned char b = 0; if (usable) usable = TRY(cuMemcpyDtoH(&b, va + n * g - 1, 1)) && b == 7;
    // unmap the whole run in one call (spanning n mappings), else page by page
    t3 = now_us();
    int one = TRY(cuMemUnmap(va, n * g));
    if (!one) for (int i = 0; i < n; i++) CK(cuMemUnmap(va + i * g, g));
    double t4 = now_us();
    printf("rep %d n %2d B handles %8.1f us (%6.1f/page) + one setAccess %s %8.1f us, usable %d; unmap %s %8.1f us\n", rep, n, t1 - t0, (t1 - t0) / n, ok ? "ok" : "REFUSED", t2 - t1, usable, one ? "in one call" : "page by page", t4 - t3);
    // C: one allocation for the run.
    t0 = now_us();
    { CUmemGenericAllocationHandle h; CK(cuMemCreate(&h, n * g, &prop, 0)); CK(cuMemMap(va, n * g, 0, h, 0)); CK(cuMemRelease(h)); CK(cuMemSetAccess(va, n * g, &acc, 1)); }
    t1 = now_us();
    CK(cuMemUnmap(va, n * g));
    t2 = now_us();
    printf("rep %d n %2d C one allocation %8.1f us, unmap %8.1f us\n", rep, n, t1 - t0, t2 - t1);
    // D: loans: n pages mapped at va (per page), aliased at va2 page by page with setAccess each, vs one setAccess.
    for (int i = 0; i < n; i++) { CUmemGenericAllocationHandle h; CK(cuMemCreate(&h, g, &prop, 0)); CK(cuMemMap(va + i * g, g, 0, h, 0)); CK(cuMemRelease(h)); }
    CK(cuMemSetAccess(va, n * g, &acc, 1));
    t0 = now_us();
    for (int i = 0; i < n; i++) { CUmemGenericAllocationHandle h; CK(cuMemRetainAllocationHandle(&h, (void*)(va + i * g))); CK(cuMemMap(va2 + i * g, g, 0, h, 0)); CK(cuMemRelease(h)); CK(cuMemSetAccess(va2 + i * g, g, &acc, 1)); }
    t1 = now_us();
    for (int i = 0; i < n; i++) CK(cuMemUnmap(va2 + i * g, g));
    t2 = now_us();
    for (int i = 0; i < n; i++) { CUmemGenericAllocationHandle h; CK(cuMemRetainAllocationHandle(&h, (void*)(va + i * g))); CK(cuMemMap(va2 + i * g, g, 0, h, 0)); CK(cuMemRelease(h)); }
    ok = TRY(cuMemSetAccess(va2, n * g, &acc, 1));
    t3 = now_us();
    printf("rep %d n %2d D alias per page %8.1f us (%6.1f/page); batched %8.1f us (%6.1f/page) setAccess %s; alias unmap per page %6.1f/page\n", rep, n, t1 - t0, (t1 - t0) / n, t3 - t2, (t3 - t2) / n, ok ? "ok" : "REFUSED", (t2 - t1) / n);
    for (int i = 0; i < n; i++) CK(cuMemUnmap(va2 + i * g, g));
    for (int i = 0; i < n; i++) CK(cuMemUnmap(va + i * g, g));
  }
  {
    CUmemGenericAllocationHandle h; CK(cuMemCreate(&h, 4 * g, &prop, 0));
    CUresult rc = cuMemMap(va + g, g, g, h, 0);
    printf("E cuMemMap of one page at offset 1 page into a 4-page allocation: %s (%d)\n", rc == CUDA_SUCCESS ? "ok" : "refused", rc);
    if (rc == CUDA_SUCCESS) CK(cuMemUnmap(va + g, g));
    CK(cuMemRelease(h));
  }
  CK(cuMemAddressFree(va, range));
  return 0;
}
