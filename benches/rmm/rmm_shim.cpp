// RAPIDS RMM's device memory resources behind a small C interface, so that `compare` (Rust)
// can measure them in the same binary and harness as vrampool and cuMemAllocAsync. Built
// on the GPU machine against RMM's headers (benches/rmm/build.sh); nothing of RMM is kept in
// this repository.
//
// Two resources, the ones an RMM user picks for a server:
//   kind 0: pool_memory_resource over cudaMalloc: one coalescing free list per stream
//           behind one mutex; grows by doubling (at least the request) when nothing fits.
//   kind 1: arena_memory_resource over cudaMalloc: per-thread arenas of superblocks from a
//           global arena that takes `arena_bytes` (0: RMM's default, half the free memory)
//           from cudaMalloc up front.
// Each sits on a statistics adaptor over cudaMalloc, so the bytes it takes from the device
// (its reserved memory) and their peak are read the same way for both.
//
// Every entry point catches exceptions: a failure is a null pointer (or -1) and a message
// for vpbench_rmm_last_error(). Streams are CUstream / cudaStream_t handles.

#include <rmm/cuda_stream_view.hpp>
#include <rmm/mr/device/arena_memory_resource.hpp>
#include <rmm/mr/device/cuda_memory_resource.hpp>
#include <rmm/mr/device/pool_memory_resource.hpp>
#include <rmm/mr/device/statistics_resource_adaptor.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>

namespace {

thread_local std::string last_error;

using upstream_t = rmm::mr::statistics_resource_adaptor<rmm::mr::cuda_memory_resource>;

struct Resource {
  rmm::mr::cuda_memory_resource cuda;
  upstream_t upstream{&cuda};
  std::unique_ptr<rmm::mr::device_memory_resource> mr;
};

template <class F>
auto guarded(F&& f, decltype(f()) on_error) noexcept -> decltype(f())
{
  try {
    return f();
  } catch (std::exception const& e) {
    last_error = e.what();
  } catch (...) {
    last_error = "unknown exception";
  }
  return on_error;
}

}  // namespace

extern "C" {

// The message of this thread's last failure.
const char* vpbench_rmm_last_error() { return last_error.c_str(); }

// A resource of `kind` (see above) on the current device; null on failure.
void* vpbench_rmm_new(int kind, std::size_t arena_bytes)
{
  return guarded(
    [&]() -> void* {
      auto r = std::make_unique<Resource>();
      if (kind == 0) {
        r->mr = std::make_unique<rmm::mr::pool_memory_resource<upstream_t>>(&r->upstream, 0);
      } else if (kind == 1) {
        std::optional<std::size_t> size;
        if (arena_bytes != 0) { size = arena_bytes; }
        r->mr = std::make_unique<rmm::mr::arena_memory_resource<upstream_t>>(&r->upstream, size);
      } else {
        last_error = "unknown kind";
        return nullptr;
      }
      return r.release();
    },
    nullptr);
}

void vpbench_rmm_delete(void* res)
{
  guarded([&] { delete static_cast<Resource*>(res); return 0; }, 0);
}

// `bytes` on `stream`, stream-ordered; null on failure.
void* vpbench_rmm_alloc(void* res, std::size_t bytes, void* stream)
{
  auto* r = static_cast<Resource*>(res);
  return guarded(
    [&] { return r->mr->allocate(bytes, rmm::cuda_stream_view{static_cast<cudaStream_t>(stream)}); },
    static_cast<void*>(nullptr));
}

// Free `ptr` (of `bytes`) on `stream`, stream-ordered; 0, or -1 on failure.
int vpbench_rmm_free(void* res, void* ptr, std::size_t bytes, void* stream)
{
  auto* r = static_cast<Resource*>(res);
  return guarded(
    [&] {
      r->mr->deallocate(ptr, bytes, rmm::cuda_stream_view{static_cast<cudaStream_t>(stream)});
      return 0;
    },
    -1);
}

// Bytes the resource holds from cudaMalloc now (`peak` = 0) or at most so far (`peak` = 1).
std::size_t vpbench_rmm_reserved(void* res, int peak)
{
  auto* r = static_cast<Resource*>(res);
  auto c = r->upstream.get_bytes_counter();
  return static_cast<std::size_t>(peak != 0 ? c.peak : c.value);
}

}  // extern "C"
