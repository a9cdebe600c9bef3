// The allocator object PyTorch calls for everything but alloc and free, for vrampool.
//
// Python's CUDAPluggableAllocator passes on alloc and free and raises for most of the rest.
// install() makes PyTorch's current allocator a subclass of the C++ CUDAPluggableAllocator,
// over the extension's alloc and free functions, whose overrides answer from vrampool:
//
// - getDeviceStats, resetPeakStats and resetAccumulatedStats, from vrampool_stats_json and
//   vrampool_reset_peak_stats: torch.cuda.memory_stats, memory_allocated,
//   max_memory_reserved, memory_summary, reset_peak_memory_stats and
//   reset_accumulated_memory_stats work (the base class raises for each);
// - snapshot, from vrampool_snapshot: torch.cuda.memory_snapshot and
//   torch.cuda.memory._snapshot (what memory_viz draws) show vrampool's segments and blocks;
// - recordHistory: while torch.cuda.memory._record_memory_history is on, each live block's
//   allocation stack and a ring of recent allocations and frees are kept here and carried
//   by the snapshot, as PyTorch's own allocator does;
// - getMemoryFraction: vrampool's limit over the device's memory;
// - attachOutOfMemoryObserver: observers (torch._C._cuda_attach_out_of_memory_observer)
//   are called before an out-of-memory error is thrown;
// - shareIpcHandle raises with the reason CUDA IPC cannot share vrampool's memory;
// - createOrIncrefPool, getPoolUseCount and setUseOnOOM (off only): torch.cuda.MemPool and
//   use_mem_pool, on vrampool's graph pools;
// - allocate, raw_alloc, raw_alloc_with_stream, raw_delete and raw_deleter, where the library
//   has vrampool_free_any: allocations and frees without the base class's table of live
//   blocks and its process-wide mutex (see StatsAllocator).

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/extension.h>

#include "vrampool_hooks.h"

namespace vh {

// Observers of out-of-memory errors (torch._C._cuda_attach_out_of_memory_observer, which
// PyTorch's memory docs use to dump a snapshot when a program runs out): called as PyTorch's
// own allocator calls them, with the device, the bytes asked for, the device's total and
// free memory, just before the error is thrown.
std::mutex oom_observers_lock;
std::vector<c10::cuda::CUDACachingAllocator::OutOfMemoryObserver> oom_observers;

void tell_oom_observers(int device, uint64_t bytes, size_t total, size_t free) {
  std::vector<c10::cuda::CUDACachingAllocator::OutOfMemoryObserver> observers;
  {
    std::lock_guard<std::mutex> g(oom_observers_lock);
    observers = oom_observers;
  }
  for (const auto& observe : observers) {
    try {
      observe(device, bytes, total, free);
    } catch (...) {
      // The out-of-memory error is what the caller gets, whatever an observer does.
    }
  }
}

// ---- allocation history (torch.cuda.memory._record_memory_history) ------------------------

// While history is on, PyTorch's own allocator keeps the stack that allocated each live
// block (memory_viz shows it beside the block) and a ring of recent allocations and frees
// (memory_viz's trace view). vrampool has neither: the stacks are PyTorch's (its
// context_recorder gathers Python and C++ frames), so they are kept here, by pointer, and
// handed to the snapshot. Off, it costs the hooks one relaxed load.
using c10::CachingDeviceAllocator::TraceEntry;
using RecordContext = c10::cuda::CUDACachingAllocator::RecordContext;

struct History {
  std::mutex lock;  // everything below
  c10::cuda::CUDACachingAllocator::CreateContextFn recorder = nullptr;
  RecordContext when = RecordContext::NEVER;
  size_t max_entries = 0;
  std::vector<TraceEntry::Action> skipped;
  std::unordered_map<void*, std::shared_ptr<c10::GatheredContext>> stacks;  // live blocks'
  std::map<int, std::deque<TraceEntry>> traces;  // per device, oldest first
};
History history;
std::atomic<bool> history_on{false};

// Append to `device`'s ring (the caller holds the lock).
void trace_event(TraceEntry::Action action, int device, void* ptr, size_t size, void* stream,
                 std::shared_ptr<c10::GatheredContext> context) {
  if (history.max_entries == 0 ||
      std::find(history.skipped.begin(), history.skipped.end(), action) != history.skipped.end()) {
    return;
  }
  auto& ring = history.traces[device];
  ring.emplace_back(action, static_cast<c10::DeviceIndex>(device), reinterpret_cast<size_t>(ptr), size, stream,
                    c10::cuda::MempoolId_t{0, 0}, c10::getApproximateTime(), std::move(context));
  while (ring.size() > history.max_entries) {
    ring.pop_front();
  }
}

// The recorder's stack, if `at_least` is asked for: gathered outside the lock (it may take
// the GIL, and another thread holding it may be waiting for this lock).
std::shared_ptr<c10::GatheredContext> gather(RecordContext at_least) {
  c10::cuda::CUDACachingAllocator::CreateContextFn recorder;
  {
    std::lock_guard<std::mutex> g(history.lock);
    if (history.when < at_least) {
      return nullptr;
    }
    recorder = history.recorder;
  }
  return recorder != nullptr ? recorder() : nullptr;
}

// After the block is allocated: never throws (a recorder that does loses the block's
// stack, not the block, which an exception here would leak).
void history_alloc(void* ptr, size_t size, int device, void* stream) noexcept {
  try {
    auto stack = gather(RecordContext::STATE);
    std::lock_guard<std::mutex> g(history.lock);
    if (!history_on.load(std::memory_order_relaxed)) {
      return;
    }
    if (stack) {
      history.stacks[ptr] = stack;
    }
    trace_event(TraceEntry::ALLOC, device, ptr, size, stream,
                history.when >= RecordContext::ALLOC ? stack : nullptr);
  } catch (...) {
  }
}

// From a deleter: never throws (a recorder that does loses its stack, not the free).
void history_free(void* ptr, size_t size, int device, void* stream) noexcept {
  try {
    auto stack = gather(RecordContext::ALL);
    std::lock_guard<std::mutex> g(history.lock);
    history.stacks.erase(ptr);
    if (!history_on.load(std::memory_order_relaxed)) {
      return;
    }
    // vrampool frees in stream order at once (a block given to record_stream waits in the
    // pool, out of PyTorch's sight): the request and its completion are one moment here.
    trace_event(TraceEntry::FREE_REQUESTED, device, ptr, size, stream, stack);
    trace_event(TraceEntry::FREE_COMPLETED, device, ptr, size, stream, stack);
  } catch (...) {
  }
}

void record_history(bool enabled, c10::cuda::CUDACachingAllocator::CreateContextFn recorder, size_t max_entries,
                    RecordContext when, bool clear, const std::vector<std::string>& skip_actions) {
  std::lock_guard<std::mutex> g(history.lock);
  history.recorder = recorder;
  history.when = enabled ? when : RecordContext::NEVER;
  history.max_entries = enabled ? max_entries : 0;
  history.skipped.clear();
  for (const auto& a : skip_actions) {
    history.skipped.push_back(c10::CachingDeviceAllocator::parseTraceEntryAction(a));
  }
  if (clear) {
    history.traces.clear();
  }
  if (!enabled) {
    history.stacks.clear();
  }
  history_on.store(enabled, std::memory_order_relaxed);
}

// ---- PyTorch's memory statistics --------------------------------------------------------

// One number of vrampool's statistics JSON (its keys are unique and its values integers).
int64_t stat_of(const std::string& json, const char* key) {
  const std::string pattern = std::string("\"") + key + "\":";
  const auto at = json.find(pattern);
  return at == std::string::npos ? 0 : std::strtoll(json.c_str() + at + pattern.size(), nullptr, 10);
}

// The figures move between calls (a counter gains a digit, settling takes time), so the length
// asked first is where the buffer starts, with room to grow, and a longer answer asks again.
std::string stats_json(int device) {
  size_t n = lib.stats_json(device, nullptr, 0);
  for (;;) {
    if (n == 0) {
      throw_error(false, "vrampool_stats_json failed: " + last_error_or("no message"));
    }
    std::string buf(n + 64, '\0');
    n = lib.stats_json(device, buf.data(), buf.size());
    if (n > 0 && n < buf.size()) {
      buf.resize(n);
      return buf;
    }
  }
}

// vrampool_snapshot of `device`, with room for every extent: the pool is read while other
// threads go on, so the count asked first may have grown by the second call.
std::vector<Extent> extents_of(int device) {
  if (lib.snapshot == nullptr) {
    throw_error(false, "vrampool_snapshot: not in this library (" + lib.path + ")");
  }
  size_t count = 0;
  std::vector<Extent> out;
  for (int tries = 0; tries < 16; tries++) {
    out.resize(count + count / 8 + 16);
    if (lib.snapshot(device, out.data(), out.size(), &count) != 0) {
      throw_error(false, "vrampool_snapshot failed: " + last_error_or("no message"));
    }
    if (count <= out.size()) {
      out.resize(count);
      return out;
    }
  }
  throw_error(false, "vrampool_snapshot: the pool kept growing while it was read");
}

// PyTorch's picture of its memory from vrampool's: a segment per run of mapped pages
// (vrampool maps pages on demand into one reserved range, as PyTorch's expandable
// segments do), a block per extent. Live blocks are allocated and active; a block freed
// after use on other streams and waiting for their work is active, as PyTorch's blocks
// waiting for their events are; cached and free memory is inactive. While history is on,
// live blocks carry the stacks that allocated them, and device_traces the recent events.
c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot_of(c10::cuda::MempoolId_t mempool) {
  c10::cuda::CUDACachingAllocator::SnapshotInfo info;
  const bool every_pool = mempool.first == 0 && mempool.second == 0;
  const int devices = static_cast<int>(c10::cuda::device_count());
  info.device_traces.resize(devices);
  std::unordered_map<void*, std::shared_ptr<c10::GatheredContext>> stacks;
  {
    std::lock_guard<std::mutex> g(history.lock);
    stacks = history.stacks;
    for (const auto& [device, ring] : history.traces) {
      if (device >= 0 && device < devices) {
        info.device_traces[device].assign(ring.begin(), ring.end());
      }
    }
  }
  for (int device = 0; device < devices; device++) {
    uint64_t at = 0, a = 0, b = 0;
    for (const Extent& e : extents_of(device)) {
      if (!every_pool && (e.pool_a != mempool.first || e.pool_b != mempool.second)) {
        continue;
      }
      if (info.segments.empty() || e.segment != at || e.pool_a != a || e.pool_b != b) {
        at = e.segment, a = e.pool_a, b = e.pool_b;
        c10::CachingDeviceAllocator::SegmentInfo seg;
        seg.device = static_cast<c10::DeviceIndex>(device);
        seg.address = e.segment;
        seg.total_size = e.segment_bytes;
        seg.is_large = e.segment_bytes > (2u << 20);
        seg.is_expandable = true;
        seg.owner_private_pool_id = {e.pool_a, e.pool_b};
        info.segments.push_back(std::move(seg));
      }
      auto& seg = info.segments.back();
      c10::CachingDeviceAllocator::BlockInfo block;
      if (e.state == kExtentLive) {
        const auto it = stacks.find(reinterpret_cast<void*>(e.addr));
        if (it != stacks.end()) {
          block.context_when_allocated = it->second;
        }
      }
      block.size = e.bytes;
      block.requested_size = e.requested;
      block.allocated = e.state == kExtentLive;
      block.active = block.allocated || e.state == kExtentRetiring;
      seg.requested_size += e.requested;
      seg.allocated_size += block.allocated ? e.bytes : 0;
      seg.active_size += block.active ? e.bytes : 0;
      if (seg.stream == nullptr && block.allocated) {
        seg.stream = e.stream;
      }
      seg.blocks.push_back(std::move(block));
    }
  }
  return info;
}

// The pluggable allocator with PyTorch's statistics answered from vrampool's: without it,
// torch.cuda.memory_stats, memory_allocated, max_memory_reserved and the rest raise
// ("does not yet support getDeviceStats"), and training loops and serving frameworks call
// them to log and to size their caches. Only the aggregate ("all") entries are filled:
// vrampool has no small and large pools in PyTorch's sense. The peak of allocated bytes is
// vrampool's sample (taken when it maps and whenever its figures are read), the rest exact.
// vrampool's running totals that PyTorch counts as "accumulated" (allocations and frees,
// bytes mapped and unmapped, out-of-memory errors and retries).
struct Totals {
  int64_t allocs = 0, frees = 0, mapped = 0, unmapped = 0, ooms = 0, retries = 0;
};

Totals totals_of(const std::string& j) {
  Totals t;
  t.allocs = stat_of(j, "allocs");
  t.frees = t.allocs - stat_of(j, "live_blocks");
  t.mapped = stat_of(j, "mapped_bytes");
  t.unmapped = stat_of(j, "unmapped_bytes");
  t.ooms = stat_of(j, "ooms");
  t.retries = stat_of(j, "oom_handler_calls");
  return t;
}

// The extension's alloc function, as the base class's malloc calls it (it throws where
// vrampool refuses).
void* alloc_on(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
  return vrampool_hooks_malloc(static_cast<ssize_t>(size), device, stream);
}

void free_any_deleter(void* ptr) {
  vrampool_hooks_free_any(ptr);
}

// The calling thread's current CUDA device, as the base class's allocations use.
c10::DeviceIndex current_device() {
  c10::DeviceIndex device = -1;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  return device;
}

struct StatsAllocator : torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
  using Base = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;
  using Base::Base;

  // Allocation and free without the base class's table. CUDAPluggableAllocator keeps every
  // live block in a map under one process-wide mutex (so that its free function gets the
  // size, device and stream), which every thread's allocation and free then wait on:
  // 2.5-3.8 us a pair with four threads (H100), against 25-42 ns straight into vrampool.
  // vrampool's own table knows each block's size, device and stream, so with
  // vrampool_free_any the deleter gives it the address alone. Without it (an older library)
  // the base class's paths stay.
  c10::DataPtr allocate(size_t size) override {
    if (lib.free_any == nullptr) {
      return Base::allocate(size);
    }
    const c10::DeviceIndex device = current_device();
    void* p = alloc_on(size, device, c10::cuda::getCurrentCUDAStream(device));
    return {p, p, &free_any_deleter, c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return lib.free_any == nullptr ? Base::raw_deleter() : &free_any_deleter;
  }

  void* raw_alloc(size_t nbytes) override {
    if (lib.free_any == nullptr) {
      return Base::raw_alloc(nbytes);
    }
    const c10::DeviceIndex device = current_device();
    return alloc_on(nbytes, device, c10::cuda::getCurrentCUDAStream(device));
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    if (lib.free_any == nullptr) {
      return Base::raw_alloc_with_stream(nbytes, stream);
    }
    return alloc_on(nbytes, current_device(), stream);
  }

  void raw_delete(void* ptr) override {
    if (lib.free_any == nullptr) {
      Base::raw_delete(ptr);
      return;
    }
    vrampool_hooks_free_any(ptr);
  }

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    const std::string j = stats_json(device);
    const Totals now = totals_of(j), base = baseline(device);
    c10::CachingDeviceAllocator::DeviceStats d;
    const auto all = static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE);
    auto& blocks = d.allocation[all];
    blocks.current = stat_of(j, "live_blocks");
    blocks.peak = blocks.current;
    blocks.allocated = now.allocs - base.allocs;
    blocks.freed = now.frees - base.frees;
    d.active[all] = blocks;
    auto& allocated = d.allocated_bytes[all];
    allocated.current = stat_of(j, "allocated_bytes");
    allocated.peak = stat_of(j, "peak_allocated_bytes");
    d.active_bytes[all] = allocated;
    auto& reserved = d.reserved_bytes[all];
    reserved.current = stat_of(j, "reserved_bytes");
    reserved.peak = stat_of(j, "peak_reserved_bytes");
    reserved.allocated = now.mapped - base.mapped;
    reserved.freed = now.unmapped - base.unmapped;
    d.num_ooms = now.ooms - base.ooms;
    d.num_alloc_retries = now.retries - base.retries;
    return d;
  }

  // torch.cuda.reset_accumulated_memory_stats: PyTorch's accumulated counts start again from
  // here. vrampool's own totals never restart, so their values now become the baseline the
  // counts are read from.
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    const Totals now = totals_of(stats_json(device));
    std::lock_guard<std::mutex> g(baselines_lock);
    baselines[device] = now;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    if (lib.reset_peak == nullptr || lib.reset_peak(device) != 0) {
      throw_error(false, "vrampool_reset_peak_stats failed: " + last_error_or("not in this library"));
    }
  }

  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot(
      c10::cuda::MempoolId_t mempool, bool include_traces) override {
    auto info = snapshot_of(mempool);
    if (!include_traces) {
      for (auto& t : info.device_traces) {
        t.clear();
      }
    }
    return info;
  }

  void recordHistory(bool enabled, c10::cuda::CUDACachingAllocator::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, c10::cuda::CUDACachingAllocator::RecordContext when,
                     bool clear_history, const std::vector<std::string>& skip_actions) override {
    record_history(enabled, context_recorder, alloc_trace_max_entries, when, clear_history, skip_actions);
  }

  bool isHistoryEnabled() override {
    return history_on.load(std::memory_order_relaxed);
  }

  // torch.multiprocessing sends a CUDA tensor to another process through an IPC handle of
  // its memory; vrampool's memory is mapped with CUDA's virtual memory calls, which the
  // legacy IPC calls do not accept, and exporting it would take a handle per page. Say so,
  // and what to do instead, rather than PyTorch's "does not yet support".
  c10::cuda::CUDACachingAllocator::ShareableHandle shareIpcHandle(void* /*ptr*/) override {
    throw_error(false,
                "vrampool: a CUDA tensor cannot be shared with another process (torch.multiprocessing, "
                "CUDA IPC): its memory is mapped with CUDA's virtual memory API, which cudaIpcGetMemHandle "
                "does not accept. Send it through the CPU (tensor.cpu()) and copy it to the device there.");
  }

  // torch.cuda.get_per_process_memory_fraction: vrampool's limit over the device's memory
  // (0.8 by default), as PyTorch's allocator reads its own (its allowed bytes over the
  // device's: 0.1 set reads 0.09999999999529509 there; vrampool rounds to whole pages).
  double getMemoryFraction(c10::DeviceIndex device) override {
    const std::string j = stats_json(device);
    const double total = static_cast<double>(stat_of(j, "device_memory_bytes"));
    return total > 0 ? static_cast<double>(stat_of(j, "max_reserved_bytes")) / total : 1.0;
  }

  // torch.cuda.MemPool and use_mem_pool: the pool is a vrampool graph pool, which keeps its
  // memory apart from every other allocation until its last use is released, as PyTorch's
  // private pools do; use_mem_pool's begin, end and release are the graph-pool hooks'. A
  // pool with an allocator of its own (ncclMemAlloc, say) is not vrampool's to serve.
  void createOrIncrefPool(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id,
                          std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator) override {
    if (allocator != nullptr) {
      throw_error(false, "vrampool: a torch.cuda.MemPool with an allocator of its own is not served by vrampool");
    }
    create_or_incref_pool(device, mempool_id);
  }

  int getPoolUseCount(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id) override {
    return pool_use_count(device, mempool_id);
  }

  // MemPool's destructor turns use_on_oom off on every pool; vrampool never lends a pool's
  // memory to other allocations, so off is what it does, and on is refused.
  void setUseOnOOM(c10::DeviceIndex /*device*/, c10::cuda::MempoolId_t /*mempool_id*/, bool use_on_oom) override {
    if (use_on_oom) {
      throw_error(false, "vrampool: a torch.cuda.MemPool cannot serve other allocations when memory runs out "
                         "(use_on_oom=True)");
    }
  }

  void attachOutOfMemoryObserver(c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> g(oom_observers_lock);
    oom_observers.push_back(std::move(observer));
  }

 private:
  Totals baseline(c10::DeviceIndex device) {
    std::lock_guard<std::mutex> g(baselines_lock);
    const auto it = baselines.find(device);
    return it == baselines.end() ? Totals{} : it->second;
  }

  std::mutex baselines_lock;
  std::map<c10::DeviceIndex, Totals> baselines;
};

// Make a StatsAllocator over this module's alloc and free functions PyTorch's CUDA
// allocator, in place of Python's CUDAPluggableAllocator (whose C++ object cannot be
// subclassed from Python); before CUDA is initialised, as any change of allocator.
std::string install() {
  require_bound();
  auto a = std::make_shared<StatsAllocator>(
      [](size_t size, int device, cudaStream_t stream) {
        return vrampool_hooks_malloc(static_cast<ssize_t>(size), device, stream);
      },
      [](void* ptr, size_t size, int device, cudaStream_t stream) {
        vrampool_hooks_free(ptr, static_cast<ssize_t>(size), device, stream);
      });
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
  return a->name();
}

}  // namespace vh
