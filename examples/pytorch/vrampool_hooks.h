// What the extension's two files share: vrampool's C functions as bound with dlsym, the
// errors thrown to PyTorch, and what the allocator object (vrampool_allocator.cpp) offers
// the alloc and free functions and the module (vrampool_hooks.cpp).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <string>

#include <c10/cuda/CUDACachingAllocator.h>

// The alloc and free functions PyTorch calls (vrampool_hooks.cpp).
extern "C" void* vrampool_hooks_malloc(ssize_t size, int device, void* stream);
extern "C" void vrampool_hooks_free(void* ptr, ssize_t size, int device, void* stream);
// As vrampool_hooks_free, given the address alone (vrampool_free_any): the allocator's
// deleter and raw_delete where the library has it.
extern "C" void vrampool_hooks_free_any(void* ptr);

namespace vh {

using MallocFn = void* (*)(ssize_t, int, void*);
using FreeFn = void (*)(void*, ssize_t, int, void*);
using FreeAnyFn = int (*)(void*, size_t*, int*, void**);
using RecordStreamFn = int (*)(void*, void*);
using EmptyCacheFn = int (*)();
using StatsJsonFn = size_t (*)(int, char*, size_t);
using LastErrorFn = const char* (*)();
using LastErrorCodeFn = int (*)();
using MallocToPoolFn = void* (*)(ssize_t, int, void*, uint64_t, uint64_t);
using PoolFn = int (*)(int, uint64_t, uint64_t);
using MemoryFractionFn = int (*)(int, double);
using ResetPeakFn = int (*)(int);

// vrampool_extent of include/vrampool.h (this file does not include the header: it binds
// with dlsym, and is built where only PyTorch's headers are known), field for field.
struct Extent {
  uint64_t segment;
  uint64_t segment_bytes;
  uint64_t addr;
  uint64_t bytes;
  uint64_t requested;
  void* stream;
  uint64_t pool_a;
  uint64_t pool_b;
  int32_t state;  // vrampool_extent_state
};
static_assert(sizeof(Extent) == 72, "vrampool_extent is 72 bytes");
constexpr int32_t kExtentLive = 0;
constexpr int32_t kExtentRetiring = 2;
using SnapshotFn = int (*)(int, Extent*, size_t, size_t*);

// vrampool_status values (include/vrampool.h) this file tells apart.
constexpr int kInvalidFree = 2;
constexpr int kOutOfMemory = 4;
constexpr int kTooLarge = 5;
constexpr int kStreamCapturing = 9;

// The library's entry points; written once by bind() before any allocation, read after.
struct Library {
  void* handle = nullptr;
  std::string path;
  MallocFn malloc = nullptr;
  FreeFn free = nullptr;
  // vrampool_free_any; optional (an older library has none, and the allocator then keeps
  // CUDAPluggableAllocator's own table of live blocks).
  FreeAnyFn free_any = nullptr;
  RecordStreamFn record_stream = nullptr;
  EmptyCacheFn empty_cache = nullptr;
  StatsJsonFn stats_json = nullptr;
  LastErrorFn last_error = nullptr;
  LastErrorCodeFn last_error_code = nullptr;  // beyond PyTorch's six; optional
  // Graph pools (vrampool_begin_allocate_to_pool and its kin); optional, as a whole.
  MallocToPoolFn malloc_to_pool = nullptr;
  PoolFn begin_pool = nullptr;
  PoolFn end_pool = nullptr;
  PoolFn release_pool = nullptr;
  // vrampool_set_memory_fraction and vrampool_reset_peak_stats; optional (an older library
  // has neither).
  MemoryFractionFn memory_fraction = nullptr;
  ResetPeakFn reset_peak = nullptr;
  SnapshotFn snapshot = nullptr;  // optional (an older library has none)
};
extern Library lib;

// This thread's last error, read at once: the next call into the library replaces it.
struct Failure {
  int code;  // a vrampool_status; kOutOfMemory where the library cannot say
  std::string message;
};

Failure last_failure(const char* fallback);
std::string last_error_or(const char* fallback);
// As c10's CUDACachingAllocator formats sizes in its messages.
std::string format_size(uint64_t size);
std::string num(long long v);
void require_bound();
[[noreturn]] void throw_error(bool oom, const std::string& msg);

// torch.cuda.MemPool: a use of graph pool `id` that opens nothing (its constructor's
// createOrIncrefPool; its destructor's releasePool is the release hook's), and the uses
// counted so far (getPoolUseCount). Both in vrampool_hooks.cpp, beside the pool hooks.
void create_or_incref_pool(int device, c10::cuda::MempoolId_t id);
int pool_use_count(int device, c10::cuda::MempoolId_t id);

// ---- vrampool_allocator.cpp -------------------------------------------------------------

// Make the allocator object PyTorch's CUDA allocator (before CUDA is initialised); its name.
std::string install();

// Whether torch.cuda.memory._record_memory_history is on: the alloc and free functions
// then tell the history of each block.
extern std::atomic<bool> history_on;
void history_alloc(void* ptr, size_t size, int device, void* stream) noexcept;
void history_free(void* ptr, size_t size, int device, void* stream) noexcept;

// Call the out-of-memory observers PyTorch attached, before the error is thrown.
void tell_oom_observers(int device, uint64_t bytes, size_t total, size_t free);

}  // namespace vh
