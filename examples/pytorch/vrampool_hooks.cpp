// What Python's CUDAPluggableAllocator wrapper does not reach, for vrampool under PyTorch.
//
// Built on the GPU machine by run.py (torch.utils.cpp_extension.load, ninja, a build folder
// under /tmp). It owns these things:
//
// 1. The alloc and free functions PyTorch calls (`vrampool_hooks_malloc`,
//    `vrampool_hooks_free`, exported so that Python's CUDAPluggableAllocator can dlsym them
//    from this module's .so). PyTorch does not check the alloc function's result
//    (CUDAPluggableAllocator::malloc stores it in its map and returns it), so a NULL from
//    vrampool_malloc would become a tensor at address 0. The wrapper throws instead:
//    c10::OutOfMemoryError (torch.OutOfMemoryError in Python, which PyTorch's own code,
//    cuDNN's plan search for one, catches and recovers from) when vrampool was out of
//    memory or the request can never fit, with a message that starts as PyTorch's caching
//    allocator's does ("CUDA out of memory. Tried to allocate ..."), and c10::Error
//    (RuntimeError) for any other refusal (a stream being captured into a CUDA graph, a
//    driver error). A NULL for size 0 is vrampool's empty block, not an error.
// 2. The hooks on the C++ allocator object: set_record_stream_fn (Tensor.record_stream ->
//    vrampool_record_stream) and set_reset_fn (torch.cuda.empty_cache ->
//    vrampool_empty_cache). A failed empty_cache throws, so Python sees it; a
//    record_stream of a pointer vrampool does not own is skipped as PyTorch's own
//    allocator skips storages it did not allocate (counted here, and by vrampool as
//    abi_failed_record_streams, which run.py fails on); any other failure throws. And
//    set_memory_fraction_fn (torch.cuda.set_per_process_memory_fraction ->
//    vrampool_set_memory_fraction), which throws when the fraction is refused.
// 2b. CUDA graphs: set_begin_allocate_to_pool / set_end_allocate_to_pool_fn /
//    set_release_pool. PyTorch opens a private pool before every capture
//    (CUDAGraph::capture_begin, make_graphed_callables, torch.cuda.use_mem_pool) with a
//    filter that names the capturing stream (or, for use_mem_pool, the calling thread); while one is open, the alloc function asks each open
//    pool's filter and sends a match to vrampool_malloc_to_pool, so that what a graph
//    captures is memory nothing else gets until the graph is released. The begin hook also
//    tells vrampool a capture is underway: from then on it checks streams for capture
//    before asking their id (cuStreamGetId on a capturing stream invalidates the capture)
//    and runs its driver calls in the RELAXED capture mode. The end and release hooks run
//    in PyTorch's capture_end and graph destructor: they never throw (a failure is counted
//    and kept in graph_errors for counters()).
// 2c. The allocator object PyTorch calls for everything else (statistics, snapshots, the
//    allocation history, out-of-memory observers, IPC): vrampool_allocator.cpp, whose
//    install() this module offers. The two files share vrampool_hooks.h.
// 3. Counters of what PyTorch asked for, and the time spent inside vrampool's malloc and
//    free (a tick counter read around each call; off unless asked for). Each thread has
//    its own slot, written only by it: no read-modify-write on the allocation path.
// 4. A measurement of the pluggable wrapper's own cost: the same malloc/free pairs from N
//    threads straight into vrampool, with one process-wide mutex around each call (the
//    wrapper's lock alone), through the C++ CUDAPluggableAllocator object (its
//    std::function, its mutex and its pointer -> metadata map per call) and through
//    PyTorch's current allocator as PyTorch's code calls it.
//
// vrampool's six C functions are found with dlopen/dlsym on the library Python already
// loaded (same path, so the same handle and the same pools): nothing is linked at build time,
// and one build serves every copy of the library.

#include <dlfcn.h>
#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <unordered_map>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/extension.h>

#include "vrampool_hooks.h"

#define VH_EXPORT extern "C" __attribute__((visibility("default")))

namespace vh {

Library lib;

Failure last_failure(const char* fallback) {
  // The code first: vrampool_last_error clears both.
  const int code = lib.last_error_code ? lib.last_error_code() : kOutOfMemory;
  const char* m = lib.last_error ? lib.last_error() : nullptr;
  return {code, m ? std::string(m) : std::string(fallback)};
}

std::string last_error_or(const char* fallback) {
  return last_failure(fallback).message;
}

std::string format_size(uint64_t size) {
  char buf[64];
  if (size <= 1024) {
    std::snprintf(buf, sizeof buf, "%llu bytes", static_cast<unsigned long long>(size));
  } else if (size <= 1048576) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", static_cast<double>(size) / 1024.0);
  } else if (size <= 1073741824ULL) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(size) / 1048576.0);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(size) / 1073741824.0);
  }
  return buf;
}

void require_bound() {
  TORCH_CHECK(lib.malloc != nullptr, "vrampool_hooks: bind(path) was not called");
}

// The allocation paths' errors are built without iostreams: on the GPU machine,
// c10::str's ostringstream, instantiated in this extension, crashed inserting an int
// (a libstdc++ facet this extension and the process's libstdc++ disagree on), inside a
// refused allocation. snprintf and std::string are all the messages need.
std::string num(long long v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%lld", v);
  return buf;
}

[[noreturn]] void throw_error(bool oom, const std::string& msg) {
  const c10::SourceLocation here{__func__, __FILE__, static_cast<uint32_t>(__LINE__)};
  if (oom) {
    throw c10::OutOfMemoryError(here, msg);
  }
  throw c10::Error(here, msg);
}

}  // namespace vh

using namespace vh;

namespace {

// ---- counters: one slot per thread, summed when read --------------------------------------

// Written only by its thread (relaxed loads and stores, no read-modify-write), read by
// counters(); never freed, so a reader may walk the list while threads come and go.
struct alignas(64) Slot {
  std::atomic<uint64_t> mallocs{0};
  std::atomic<uint64_t> failed_mallocs{0};
  std::atomic<uint64_t> frees{0};
  std::atomic<uint64_t> malloc_ticks{0};
  std::atomic<uint64_t> free_ticks{0};
  Slot* next = nullptr;
};
std::atomic<Slot*> slots{nullptr};
thread_local Slot* my_slot = nullptr;

std::atomic<uint64_t> record_streams{0};
std::atomic<uint64_t> record_streams_skipped{0};
std::atomic<uint64_t> empty_caches{0};
std::atomic<bool> timing{false};

Slot& slot() {
  if (my_slot == nullptr) {
    auto* s = new Slot();
    s->next = slots.load(std::memory_order_relaxed);
    while (!slots.compare_exchange_weak(
        s->next, s, std::memory_order_release, std::memory_order_relaxed)) {
    }
    my_slot = s;
  }
  return *my_slot;
}

// Only this thread writes its slot: a relaxed load and store, which costs no bus lock.
inline void add(std::atomic<uint64_t>& c, uint64_t v) {
  c.store(c.load(std::memory_order_relaxed) + v, std::memory_order_relaxed);
}

inline uint64_t ticks() {
#if defined(__x86_64__)
  return __rdtsc();
#else
  return static_cast<uint64_t>(
      std::chrono::steady_clock::now().time_since_epoch().count());
#endif
}

// Ticks per nanosecond, measured against steady_clock over the life of the module.
struct Calibration {
  uint64_t tick0;
  std::chrono::steady_clock::time_point t0;
};
Calibration calibration{ticks(), std::chrono::steady_clock::now()};

double ticks_per_ns() {
#if defined(__x86_64__)
  auto t1 = std::chrono::steady_clock::now();
  uint64_t k1 = ticks();
  double ns = std::chrono::duration<double, std::nano>(t1 - calibration.t0).count();
  if (ns < 1e6) {  // under 1 ms since load: wait a little for a usable ratio
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    t1 = std::chrono::steady_clock::now();
    k1 = ticks();
    ns = std::chrono::duration<double, std::nano>(t1 - calibration.t0).count();
  }
  return static_cast<double>(k1 - calibration.tick0) / ns;
#else
  using period = std::chrono::steady_clock::period;
  return static_cast<double>(period::den) / (1e9 * period::num);
#endif
}

// Throw what PyTorch's own allocator would for this refusal: out of memory (also for a
// request no pool can ever serve) as c10::OutOfMemoryError, anything else as c10::Error.
[[noreturn]] void throw_refused(ssize_t size, int device, const Failure& f) {
  if (f.code == kOutOfMemory || f.code == kTooLarge) {
    const auto bytes = static_cast<uint64_t>(size);
    std::string capacity = "";
    size_t free = 0, total = 0;
    try {
      // The allocator object's own query (cudaMemGetInfo under a device guard).
      auto info = c10::cuda::CUDACachingAllocator::get()->getMemoryInfo(
          static_cast<c10::DeviceIndex>(device));
      free = info.first, total = info.second;
      capacity = " has a total capacity of " + format_size(info.second) + " of which " +
          format_size(info.first) + " is free";
    } catch (const std::exception&) {
      // No device to ask (the simulator): the message goes without the figures.
    }
    tell_oom_observers(device, bytes, total, free);
    if (bytes >= (1ULL << 60)) {
      throw_error(true, "CUDA out of memory. Tried to allocate more than 1EB memory. vrampool: " + f.message);
    }
    throw_error(true, "CUDA out of memory. Tried to allocate " + format_size(bytes) + ". GPU " + num(device) +
                    capacity + ". vrampool: " + f.message);
  }
  throw_error(false,
        "vrampool could not allocate " + num(size) + " bytes on CUDA device " + num(device) +
            (f.code == kStreamCapturing
                 ? " (a stream being captured into a CUDA graph outside a graph pool: capture with "
                   "torch.cuda.graph, whose pool the graph-pool hooks route to vrampool)"
                 : "") +
            ": " + f.message);
}

}  // namespace

// ---- the functions PyTorch calls ----------------------------------------------------------

namespace {

// The graph pools PyTorch has open (between its beginAllocateToPool and endAllocateToPool),
// each with the filter that names its capture's streams. Read under `open_lock` only while
// `open_count` is not zero: no lock on the allocation path otherwise.
struct OpenPool {
  int device;
  c10::cuda::MempoolId_t id;
  std::function<bool(cudaStream_t)> filter;
};
std::mutex open_lock;
std::vector<OpenPool> open_pools;
std::atomic<int> open_count{0};
std::atomic<uint64_t> graph_mallocs{0};
std::atomic<uint64_t> graph_errors{0};
std::mutex graph_error_lock;
std::string graph_last_error;

// Each pool's uses as PyTorch counts them (getPoolUseCount): one per begin and per
// createOrIncrefPool (a torch.cuda.MemPool), less one per release. vrampool keeps the same
// count (a pool goes back only once every use was released) but does not export it.
std::map<std::tuple<int, uint64_t, uint64_t>, int> pool_uses;  // under open_lock
std::atomic<bool> graph_hooks_on{false};

void count_use(int device, c10::cuda::MempoolId_t id, int by) {
  const std::lock_guard<std::mutex> held(open_lock);
  const auto key = std::make_tuple(device, static_cast<uint64_t>(id.first), static_cast<uint64_t>(id.second));
  if ((pool_uses[key] += by) <= 0) {
    pool_uses.erase(key);
  }
}

void graph_failed(const char* what) {
  graph_errors.fetch_add(1, std::memory_order_relaxed);
  const std::lock_guard<std::mutex> held(graph_error_lock);
  graph_last_error = std::string(what) + ": " + last_error_or("no message");
}

// The open pool whose filter names `stream` on `device`, if any.
bool pool_for(int device, void* stream, c10::cuda::MempoolId_t* id) {
  const std::lock_guard<std::mutex> held(open_lock);
  for (const auto& p : open_pools) {
    if (p.device == device && p.filter && p.filter(static_cast<cudaStream_t>(stream))) {
      *id = p.id;
      return true;
    }
  }
  return false;
}

void begin_pool_hook(int device, c10::cuda::MempoolId_t id, std::function<bool(cudaStream_t)> filter) {
  if (lib.begin_pool(device, id.first, id.second) != 0) {
    throw_error(false, "vrampool_begin_allocate_to_pool failed: " + last_error_or("no message"));
  }
  count_use(device, id, 1);
  const std::lock_guard<std::mutex> held(open_lock);
  open_pools.push_back(OpenPool{device, id, std::move(filter)});
  open_count.fetch_add(1, std::memory_order_release);
}

void end_pool_hook(int device, c10::cuda::MempoolId_t id) {
  {
    const std::lock_guard<std::mutex> held(open_lock);
    auto it = std::find_if(open_pools.begin(), open_pools.end(), [&](const OpenPool& p) {
      return p.device == device && p.id == id;
    });
    if (it != open_pools.end()) {
      open_pools.erase(it);
      open_count.fetch_sub(1, std::memory_order_release);
    }
  }
  if (lib.end_pool(device, id.first, id.second) != 0) {
    graph_failed("vrampool_end_allocate_to_pool");
  }
}

void release_pool_hook(int device, c10::cuda::MempoolId_t id) {
  count_use(device, id, -1);
  if (lib.release_pool(device, id.first, id.second) != 0) {
    graph_failed("vrampool_release_pool");
  }
}

}  // namespace

namespace vh {

void create_or_incref_pool(int device, c10::cuda::MempoolId_t id) {
  if (!graph_hooks_on.load(std::memory_order_acquire)) {
    throw_error(false,
                "vrampool: torch.cuda.MemPool needs the graph-pool hooks (set_hooks(graph_pools=True)) and a "
                "library with vrampool_begin_allocate_to_pool");
  }
  // A use that opens nothing: a begin (counted as a use until its release) whose empty
  // filter names no stream, ended at once.
  begin_pool_hook(device, id, {});
  end_pool_hook(device, id);
}

int pool_use_count(int device, c10::cuda::MempoolId_t id) {
  const std::lock_guard<std::mutex> held(open_lock);
  const auto it =
      pool_uses.find(std::make_tuple(device, static_cast<uint64_t>(id.first), static_cast<uint64_t>(id.second)));
  return it == pool_uses.end() ? 0 : it->second;
}

}  // namespace vh

VH_EXPORT void* vrampool_hooks_malloc(ssize_t size, int device, void* stream) {
  require_bound();
  Slot& s = slot();
  const bool timed = timing.load(std::memory_order_relaxed);
  const uint64_t t0 = timed ? ticks() : 0;
  void* p = nullptr;
  c10::cuda::MempoolId_t id;
  if (open_count.load(std::memory_order_acquire) != 0 && lib.malloc_to_pool != nullptr &&
      pool_for(device, stream, &id)) {
    graph_mallocs.fetch_add(1, std::memory_order_relaxed);
    p = lib.malloc_to_pool(size, device, stream, id.first, id.second);
  } else {
    p = lib.malloc(size, device, stream);
  }
  if (timed) {
    add(s.malloc_ticks, ticks() - t0);
  }
  add(s.mallocs, 1);
  if (p == nullptr && size != 0) {
    add(s.failed_mallocs, 1);
    // Read the error now: it is this thread's, and the next call would replace it.
    throw_refused(size, device, last_failure("no message"));
  }
  if (history_on.load(std::memory_order_relaxed) && p != nullptr) {
    history_alloc(p, static_cast<size_t>(size), device, stream);
  }
  return p;
}

VH_EXPORT void vrampool_hooks_free(void* ptr, ssize_t size, int device, void* stream) {
  // Called from deleters: nothing may throw here. A refused free is counted by vrampool
  // (abi_* in its statistics), which run.py checks.
  if (lib.free == nullptr) {
    return;
  }
  Slot& s = slot();
  const bool timed = timing.load(std::memory_order_relaxed);
  const uint64_t t0 = timed ? ticks() : 0;
  lib.free(ptr, size, device, stream);
  if (timed) {
    add(s.free_ticks, ticks() - t0);
  }
  add(s.frees, 1);
  if (history_on.load(std::memory_order_relaxed) && ptr != nullptr) {
    history_free(ptr, static_cast<size_t>(size), device, stream);
  }
}

VH_EXPORT void vrampool_hooks_free_any(void* ptr) {
  // Called from deleters: nothing may throw here. A refused free is counted by vrampool.
  if (ptr == nullptr || lib.free_any == nullptr) {
    return;
  }
  Slot& s = slot();
  const bool timed = timing.load(std::memory_order_relaxed);
  const uint64_t t0 = timed ? ticks() : 0;
  size_t size = 0;
  int device = -1;
  void* stream = nullptr;
  const int rc = lib.free_any(ptr, &size, &device, &stream);
  if (timed) {
    add(s.free_ticks, ticks() - t0);
  }
  add(s.frees, 1);
  if (rc == 0 && history_on.load(std::memory_order_relaxed)) {
    history_free(ptr, size, device, stream);
  }
}

namespace {

// ---- binding and the hooks on the C++ allocator object ------------------------------------

template <typename F>
F symbol(void* handle, const char* name) {
  void* f = dlsym(handle, name);
  TORCH_CHECK(f != nullptr, "vrampool_hooks: ", lib.path, " has no symbol ", name);
  return reinterpret_cast<F>(f);
}

void bind(const std::string& path) {
  if (lib.handle != nullptr) {
    TORCH_CHECK(path == lib.path, "vrampool_hooks: already bound to ", lib.path);
    return;
  }
  // The same path as Python's ctypes.CDLL: dlopen hands back the loaded library.
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  TORCH_CHECK(h != nullptr, "vrampool_hooks: dlopen(", path, "): ", dlerror());
  lib.path = path;
  lib.free = symbol<FreeFn>(h, "vrampool_free");
  lib.free_any = reinterpret_cast<FreeAnyFn>(dlsym(h, "vrampool_free_any"));
  lib.record_stream = symbol<RecordStreamFn>(h, "vrampool_record_stream");
  lib.empty_cache = symbol<EmptyCacheFn>(h, "vrampool_empty_cache");
  lib.stats_json = symbol<StatsJsonFn>(h, "vrampool_stats_json");
  lib.last_error = symbol<LastErrorFn>(h, "vrampool_last_error");
  lib.last_error_code =
      reinterpret_cast<LastErrorCodeFn>(dlsym(h, "vrampool_last_error_code"));
  lib.malloc_to_pool = reinterpret_cast<MallocToPoolFn>(dlsym(h, "vrampool_malloc_to_pool"));
  lib.begin_pool = reinterpret_cast<PoolFn>(dlsym(h, "vrampool_begin_allocate_to_pool"));
  lib.end_pool = reinterpret_cast<PoolFn>(dlsym(h, "vrampool_end_allocate_to_pool"));
  lib.release_pool = reinterpret_cast<PoolFn>(dlsym(h, "vrampool_release_pool"));
  if (!lib.malloc_to_pool || !lib.begin_pool || !lib.end_pool || !lib.release_pool) {
    lib.malloc_to_pool = nullptr;  // an older library: no graph pools
  }
  lib.memory_fraction = reinterpret_cast<MemoryFractionFn>(dlsym(h, "vrampool_set_memory_fraction"));
  lib.reset_peak = reinterpret_cast<ResetPeakFn>(dlsym(h, "vrampool_reset_peak_stats"));
  lib.snapshot = reinterpret_cast<SnapshotFn>(dlsym(h, "vrampool_snapshot"));
  lib.malloc = symbol<MallocFn>(h, "vrampool_malloc");
  lib.handle = h;
}

torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator& pluggable() {
  auto* current = c10::cuda::CUDACachingAllocator::get();
  auto* p = dynamic_cast<torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator*>(current);
  TORCH_CHECK(
      p != nullptr,
      "vrampool_hooks: the current CUDA allocator is '",
      current ? current->name() : std::string("none"),
      "', not a CUDAPluggableAllocator: call change_current_allocator first");
  return *p;
}

void record_stream_hook(void* ptr, cudaStream_t stream) {
  if (ptr == nullptr) {
    return;  // an empty tensor's storage: nothing to record, as PyTorch's own allocator
  }
  record_streams.fetch_add(1, std::memory_order_relaxed);
  int rc = lib.record_stream(ptr, stream);
  if (rc == 0) {
    return;
  }
  std::string why = last_error_or("no message");
  if (rc == kInvalidFree) {
    // Not a block of vrampool's (a storage from another allocator, from IPC or from_blob):
    // PyTorch's caching allocator skips those (its recordStream checks the deleter).
    record_streams_skipped.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  throw_error(false, "vrampool_record_stream failed (status " + num(rc) + "): " + why);
}

void empty_cache_hook() {
  empty_caches.fetch_add(1, std::memory_order_relaxed);
  int rc = lib.empty_cache();
  if (rc != 0) {
    std::string why = last_error_or("no message");
    throw_error(false, "vrampool_empty_cache failed (status " + num(rc) + "): " + why);
  }
}

// torch.cuda.set_per_process_memory_fraction(fraction, device): vrampool's limit for the
// device becomes that fraction of its memory. A refused fraction (above the pool's ceiling,
// VRAMPOOL_MAX_RESERVED) throws, so Python sees it.
void memory_fraction_hook(double fraction, int device) {
  if (lib.memory_fraction(device, fraction) != 0) {
    std::string why = last_error_or("no message");
    throw_error(false, "vrampool_set_memory_fraction failed: " + why);
  }
}

// Install (true) or remove (false) each hook; an empty std::function is PyTorch's "unset"
// (recordStream and emptyCache test it before calling). Call with no other thread inside
// the allocator: the std::function is not guarded.
std::string set_hooks(bool record_stream, bool empty_cache, bool graph_pools) {
  require_bound();
  auto& a = pluggable();
  const bool graphs = graph_pools && lib.malloc_to_pool != nullptr;
  graph_hooks_on.store(graphs, std::memory_order_release);
  using BeginFn = std::function<void(int, c10::cuda::MempoolId_t, std::function<bool(cudaStream_t)>)>;
  using PoolHookFn = std::function<void(int, c10::cuda::MempoolId_t)>;
  a.set_begin_allocate_to_pool(graphs ? BeginFn(begin_pool_hook) : BeginFn());
  a.set_end_allocate_to_pool_fn(graphs ? PoolHookFn(end_pool_hook) : PoolHookFn());
  a.set_release_pool(graphs ? PoolHookFn(release_pool_hook) : PoolHookFn());
  a.set_record_stream_fn(
      record_stream ? std::function<void(void*, cudaStream_t)>(record_stream_hook)
                    : std::function<void(void*, cudaStream_t)>());
  a.set_reset_fn(
      empty_cache ? std::function<void()>(empty_cache_hook) : std::function<void()>());
  // Always on where the library has it: without it PyTorch ignores the fraction silently.
  a.set_memory_fraction_fn(
      lib.memory_fraction ? std::function<void(double, int)>(memory_fraction_hook)
                          : std::function<void(double, int)>());
  return a.name();
}

py::dict counters() {
  uint64_t mallocs = 0, failed = 0, frees = 0, mt = 0, ft = 0;
  for (Slot* s = slots.load(std::memory_order_acquire); s != nullptr; s = s->next) {
    mallocs += s->mallocs.load(std::memory_order_relaxed);
    failed += s->failed_mallocs.load(std::memory_order_relaxed);
    frees += s->frees.load(std::memory_order_relaxed);
    mt += s->malloc_ticks.load(std::memory_order_relaxed);
    ft += s->free_ticks.load(std::memory_order_relaxed);
  }
  const double per_ns = ticks_per_ns();
  py::dict d;
  d["mallocs"] = mallocs;
  d["failed_mallocs"] = failed;
  d["frees"] = frees;
  d["malloc_ns"] = static_cast<double>(mt) / per_ns;
  d["free_ns"] = static_cast<double>(ft) / per_ns;
  d["record_streams"] = record_streams.load();
  d["record_streams_skipped"] = record_streams_skipped.load();
  d["empty_caches"] = empty_caches.load();
  d["graph_mallocs"] = graph_mallocs.load();
  d["graph_errors"] = graph_errors.load();
  {
    const std::lock_guard<std::mutex> held(graph_error_lock);
    d["graph_last_error"] = graph_last_error;
  }
  d["timing"] = timing.load();
  return d;
}

// ---- the wrapper's cost -------------------------------------------------------------------

// `threads` threads, thread i on streams[i % n], each `rounds` times: `window` allocations
// of `size` bytes, then their frees in order. path "direct": vrampool_malloc/vrampool_free
// through their pointers; "mutex": the same with one process-wide std::mutex held around
// each call, as the wrapper holds its allocator_mutex_ once per malloc and once per free
// (the lock's cost alone, contention included); "pluggable": the C++ CUDAPluggableAllocator base class's malloc and
// raw_delete (its std::function, mutex and map around vrampool_hooks_malloc, no CUDA call);
// "allocator": c10::cuda::CUDACachingAllocator::raw_alloc_with_stream and raw_delete, i.e.
// PyTorch's current allocator as PyTorch's own code calls it (the pluggable one, or
// PyTorch's caching allocator). Returns wall time and nanoseconds per pair, overall and
// per thread. Runs without the GIL.
py::dict bench_pairs(
    const std::string& path,
    int64_t size,
    int64_t rounds,
    int64_t window,
    const std::vector<uint64_t>& streams,
    int64_t threads,
    int device) {
  enum class Path { Direct, Mutex, Pluggable, Allocator };
  TORCH_CHECK(
      path == "direct" || path == "mutex" || path == "pluggable" || path == "allocator",
      "path is 'direct', 'mutex', 'pluggable' or 'allocator'");
  TORCH_CHECK(size > 0 && rounds > 0 && window > 0 && threads > 0, "bad bench arguments");
  TORCH_CHECK(!streams.empty(), "no streams");
  const Path which = path == "direct" ? Path::Direct
      : path == "mutex"               ? Path::Mutex
      : path == "pluggable"           ? Path::Pluggable
                                      : Path::Allocator;
  std::mutex lock;  // the "mutex" path's, shared by its threads as the wrapper's is
  torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator* plug = nullptr;
  if (which != Path::Allocator) {
    require_bound();
  }
  if (which == Path::Pluggable) {
    plug = &pluggable();
  }
  const auto dev = static_cast<c10::DeviceIndex>(device);
  auto alloc_one = [&](void* stream) -> void* {
    switch (which) {
      case Path::Direct: {
        void* p = lib.malloc(size, device, stream);
        TORCH_CHECK(p != nullptr, "vrampool_malloc: ", last_error_or("NULL"));
        return p;
      }
      case Path::Mutex: {
        void* p = nullptr;
        {
          const std::lock_guard<std::mutex> held(lock);
          p = lib.malloc(size, device, stream);
        }
        TORCH_CHECK(p != nullptr, "vrampool_malloc: ", last_error_or("NULL"));
        return p;
      }
      case Path::Pluggable:
        return plug->malloc(static_cast<size_t>(size), dev, static_cast<cudaStream_t>(stream));
      case Path::Allocator:
        break;
    }
    return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(
        static_cast<size_t>(size), static_cast<cudaStream_t>(stream));
  };
  auto free_one = [&](void* p, void* stream) {
    switch (which) {
      case Path::Direct:
        lib.free(p, size, device, stream);
        return;
      case Path::Mutex: {
        const std::lock_guard<std::mutex> held(lock);
        lib.free(p, size, device, stream);
        return;
      }
      case Path::Pluggable:
        // The base class's own, which looks the block up in its table: the allocator that
        // install() made overrides raw_delete (and allocates without the table).
        plug->CUDAPluggableAllocator::raw_delete(p);
        return;
      case Path::Allocator:
        break;
    }
    c10::cuda::CUDACachingAllocator::raw_delete(p);
  };
  std::vector<double> per_thread_ns(threads, 0.0);
  std::vector<std::string> errors(threads);
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::chrono::steady_clock::time_point start, end;
  {
    py::gil_scoped_release no_gil;
    std::vector<std::thread> pool;
    for (int64_t t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        auto* stream = reinterpret_cast<void*>(streams[t % streams.size()]);
        std::vector<void*> live(window, nullptr);
        bool counted = false;
        try {
          // cudaSetDevice even when device 0 looks current: it makes the primary context
          // current on this new thread, as PyTorch's threads have it.
          if (c10::cuda::device_count() > 0) {
            c10::cuda::set_device(static_cast<c10::DeviceIndex>(device), /*force=*/true);
          }
          ready.fetch_add(1);
          counted = true;
          while (!go.load(std::memory_order_acquire)) {
            std::this_thread::yield();
          }
          auto t0 = std::chrono::steady_clock::now();
          for (int64_t r = 0; r < rounds; ++r) {
            for (int64_t i = 0; i < window; ++i) {
              live[i] = alloc_one(stream);
            }
            for (int64_t i = 0; i < window; ++i) {
              free_one(live[i], stream);
              live[i] = nullptr;
            }
          }
          auto t1 = std::chrono::steady_clock::now();
          per_thread_ns[t] = std::chrono::duration<double, std::nano>(t1 - t0).count() /
              static_cast<double>(rounds * window);
        } catch (const std::exception& e) {
          errors[t] = e.what();
          for (void* p : live) {
            if (p == nullptr) {
              continue;
            }
            try {
              free_one(p, stream);
            } catch (const std::exception&) {
              // The first error is the one reported.
            }
          }
          if (!counted) {
            ready.fetch_add(1);
          }
        }
      });
    }
    while (ready.load() < threads) {
      std::this_thread::yield();
    }
    start = std::chrono::steady_clock::now();
    go.store(true, std::memory_order_release);
    for (auto& th : pool) {
      th.join();
    }
    end = std::chrono::steady_clock::now();
  }
  for (const auto& e : errors) {
    TORCH_CHECK(e.empty(), "bench_pairs: ", e);
  }
  const double wall = std::chrono::duration<double, std::nano>(end - start).count();
  py::dict d;
  d["wall_ns"] = wall;
  d["pairs"] = rounds * window * threads;
  // Aggregate: wall time over all pairs of all threads (throughput view);
  // per thread: each thread's own time per pair (latency view, contention included).
  d["ns_per_pair_aggregate"] = wall / static_cast<double>(rounds * window * threads);
  d["ns_per_pair_per_thread"] = per_thread_ns;
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vrampool's hooks into PyTorch's CUDAPluggableAllocator";
  m.def("bind", &bind, "dlopen libvrampool.so (the path Python loaded) and find its functions");
  m.def(
      "set_hooks",
      &set_hooks,
      py::arg("record_stream") = true,
      py::arg("empty_cache") = true,
      py::arg("graph_pools") = true,
      "install or remove the record_stream, empty_cache and graph-pool hooks on the current pluggable allocator");
  m.def(
      "install",
      &install,
      "make vrampool PyTorch's CUDA allocator through this module, with PyTorch's memory statistics");
  m.def("counters", &counters, "what PyTorch asked of vrampool through this module");
  m.def("set_timing", [](bool on) { timing.store(on); }, "time each vrampool malloc/free");
  m.def(
      "bench_pairs",
      &bench_pairs,
      py::arg("path"),
      py::arg("size"),
      py::arg("rounds"),
      py::arg("window"),
      py::arg("streams"),
      py::arg("threads"),
      py::arg("device") = 0);
  // The alloc and free functions as PyTorch calls them, for checks without PyTorch's
  // allocator in between (a NULL for a size > 0 raises torch.OutOfMemoryError).
  m.def(
      "malloc_through_hooks",
      [](int64_t size, int device, uint64_t stream) {
        return reinterpret_cast<uint64_t>(
            vrampool_hooks_malloc(size, device, reinterpret_cast<void*>(stream)));
      },
      py::arg("size"),
      py::arg("device"),
      py::arg("stream"));
  m.def(
      "free_through_hooks",
      [](uint64_t ptr, int64_t size, int device, uint64_t stream) {
        vrampool_hooks_free(
            reinterpret_cast<void*>(ptr), size, device, reinterpret_cast<void*>(stream));
      },
      py::arg("ptr"),
      py::arg("size"),
      py::arg("device"),
      py::arg("stream"));
  m.def(
      "record_stream_through_hook",
      [](uint64_t ptr, uint64_t stream) {
        record_stream_hook(reinterpret_cast<void*>(ptr), reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("ptr"),
      py::arg("stream"));
  // The C++ allocator object's own malloc and raw_delete (PyTorch's wrapper: std::function,
  // mutex, map), which make no CUDA call: the alloc path through libtorch_cuda, checkable
  // on a machine without a GPU (VRAMPOOL_DEVICE=sim).
  m.def(
      "pluggable_malloc",
      [](int64_t size, int device, uint64_t stream) {
        return reinterpret_cast<uint64_t>(pluggable().malloc(
            static_cast<size_t>(size),
            static_cast<c10::DeviceIndex>(device),
            reinterpret_cast<cudaStream_t>(stream)));
      },
      py::arg("size"),
      py::arg("device"),
      py::arg("stream"));
  m.def(
      "pluggable_free",
      [](uint64_t ptr) { pluggable().raw_delete(reinterpret_cast<void*>(ptr)); },
      py::arg("ptr"));
  m.attr("MALLOC_SYMBOL") = "vrampool_hooks_malloc";
  m.attr("FREE_SYMBOL") = "vrampool_hooks_free";
}
