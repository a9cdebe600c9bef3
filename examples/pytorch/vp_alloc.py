"""The allocator under test: PyTorch's own caching allocator, or vrampool installed through
PyTorch's CUDAPluggableAllocator, and the figures each one gives.

vrampool is installed in one of three ways (``--hooks``):

* ``cpp`` (default): the alloc and free functions are ``vrampool_hooks_malloc`` and
  ``vrampool_hooks_free`` of the C++ extension ``vrampool_hooks.cpp`` (built here with
  torch.utils.cpp_extension and ninja), which raise ``torch.OutOfMemoryError`` where
  ``vrampool_malloc`` returns NULL, count the calls and time them. The extension installs
  its own subclass of the C++ ``CUDAPluggableAllocator`` (``vrampool_allocator.cpp``:
  ``torch.cuda.memory_stats`` and its kin read vrampool's figures, snapshots, history and
  out-of-memory observers work) and sets the record-stream, reset (empty-cache) and
  memory-fraction hooks on it.
* ``ctypes``: ``vrampool_malloc`` and ``vrampool_free`` themselves, and the two hooks set
  through ``torch._C._CUDAPluggableAllocator.set_record_stream_fn`` / ``set_reset_fn``
  (private bindings that take a C function's address; ``vrampool_record_stream`` and
  ``vrampool_empty_cache`` return an int where PyTorch expects void, so their errors are
  dropped). No build needed; a NULL from the alloc function is still unchecked.
* ``none``: only what the public wrapper does: ``CUDAPluggableAllocator(path,
  "vrampool_malloc", "vrampool_free")`` and ``change_current_allocator``.

Everything here must run before CUDA is initialised in the process: PyTorch refuses to
change an allocator that has been used.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

import torch

HOOKS = ("cpp", "ctypes", "none")
DEFAULT_BUILD_DIR = "/tmp/vrampool_torch_ext"
HERE = os.path.dirname(os.path.abspath(__file__))


# ---- the C++ extension --------------------------------------------------------------------


def cuda_include_dirs() -> list[str]:
    """Where cuda_runtime_api.h and crt/host_config.h are: the toolkit (CUDA_HOME, nvcc)
    first, else the headers pip's CUDA wheels install beside torch."""
    from torch.utils import cpp_extension

    site = os.path.dirname(os.path.dirname(torch.__file__))
    candidates = []
    if cpp_extension.CUDA_HOME:
        candidates.append(os.path.join(cpp_extension.CUDA_HOME, "include"))
    candidates += [
        "/usr/local/cuda/include",
        os.path.join(site, "nvidia", "cu13", "include"),
        os.path.join(site, "nvidia", "cuda_runtime", "include"),
        os.path.join(site, "nvidia", "cuda_nvcc", "include"),
        os.path.join(site, "triton", "backends", "nvidia", "include"),
    ]
    runtime = [d for d in candidates if os.path.exists(os.path.join(d, "cuda_runtime_api.h"))]
    crt = [d for d in candidates if os.path.exists(os.path.join(d, "crt", "host_config.h"))]
    if not runtime or not crt:
        raise RuntimeError(
            "no CUDA headers (cuda_runtime_api.h and crt/host_config.h) in any of: "
            + ", ".join(candidates)
        )
    for d in runtime:
        if d in crt:
            return [d]
    return [runtime[0], crt[0]]


def build_hooks(build_dir: str = DEFAULT_BUILD_DIR, verbose: bool = False):
    """Build (or load the cached build of) the extension (vrampool_hooks.cpp and
    vrampool_allocator.cpp); returns the module."""
    from torch.utils import cpp_extension

    os.makedirs(build_dir, exist_ok=True)
    return cpp_extension.load(
        name="vrampool_hooks",
        sources=[os.path.join(HERE, f) for f in ("vrampool_hooks.cpp", "vrampool_allocator.cpp")],
        extra_cflags=["-O2"],
        extra_include_paths=cuda_include_dirs(),
        # The extension calls into libtorch_cuda (CUDAPluggableAllocator) and c10_cuda, but
        # compiles no CUDA code: no nvcc, no -lcudart.
        extra_ldflags=["-lc10_cuda", "-ltorch_cuda", "-ldl"],
        with_cuda=False,
        build_directory=build_dir,
        verbose=verbose,
    )


# ---- vrampool's C functions through ctypes ------------------------------------------------


class Library:
    """libvrampool.so's entry points, for statistics and errors (the allocation path is
    PyTorch's)."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.lib = ctypes.CDLL(self.path)
        vp = ctypes.c_void_p
        L = self.lib
        L.vrampool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, vp]
        L.vrampool_malloc.restype = vp
        L.vrampool_free.argtypes = [vp, ctypes.c_ssize_t, ctypes.c_int, vp]
        L.vrampool_free.restype = None
        L.vrampool_record_stream.argtypes = [vp, vp]
        L.vrampool_record_stream.restype = ctypes.c_int
        L.vrampool_empty_cache.argtypes = []
        L.vrampool_empty_cache.restype = ctypes.c_int
        L.vrampool_stats_json.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        L.vrampool_stats_json.restype = ctypes.c_size_t
        L.vrampool_last_error.argtypes = []
        L.vrampool_last_error.restype = ctypes.c_char_p

    def pause_traces(self, paused: bool) -> None:
        """Pause or resume VRAMPOOL_RECORD_TRACE's recording (a library without the call,
        or a process that does not record: nothing)."""
        f = getattr(self.lib, "vrampool_pause_traces", None)
        if f is not None:
            f.argtypes = [ctypes.c_int]
            f.restype = ctypes.c_int
            f(1 if paused else 0)

    def address(self, name: str) -> int:
        return ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value

    def last_error(self) -> str | None:
        m = self.lib.vrampool_last_error()
        return m.decode(errors="replace") if m else None

    def stats(self, device: int = 0) -> dict:
        n = self.lib.vrampool_stats_json(device, None, 0)
        if n == 0:
            raise RuntimeError(f"vrampool_stats_json: {self.last_error()}")
        buf = ctypes.create_string_buffer(n + 1)
        got = self.lib.vrampool_stats_json(device, buf, n + 1)
        if got != n:
            # The JSON grew between the calls (a counter gained a digit): ask again.
            return self.stats(device)
        return json.loads(buf.value)


# ---- the backends -------------------------------------------------------------------------

# The ABI's counters that mean a call was refused; any of them non-zero fails the run.
REFUSALS = (
    "abi_invalid_mallocs",
    "abi_invalid_frees",
    "abi_double_frees",
    "abi_wrong_size_frees",
    "abi_wrong_stream_frees",
    "abi_late_double_frees",
    "abi_failed_record_streams",
    "abi_internal_errors",
)


class PyTorchBackend:
    name = "pytorch"
    hooks = "native"
    ext = None

    def reserved(self) -> int:
        return torch.cuda.memory_reserved()

    def peak_reserved(self) -> int:
        return torch.cuda.max_memory_reserved()

    def counters(self) -> dict:
        s = torch.cuda.memory_stats()
        return {
            "allocs": s.get("allocation.all.allocated", 0),
            "device_allocs": s.get("num_device_alloc", 0),
            "alloc_retries": s.get("num_alloc_retries", 0),
            "ooms": s.get("num_ooms", 0),
        }

    def final(self) -> dict:
        s = torch.cuda.memory_stats()
        keep = (
            "allocation.all.allocated",
            "num_device_alloc",
            "num_device_free",
            "num_alloc_retries",
            "num_ooms",
            "reserved_bytes.all.peak",
            "allocated_bytes.all.peak",
        )
        return {k: s.get(k) for k in keep}

    def refusals(self) -> dict:
        return {}

    def pause_traces(self, paused: bool) -> None:
        pass  # PyTorch's allocator records nothing here

    def set_record_stream_hook(self, on: bool) -> bool:
        return True  # PyTorch's allocator always honours record_stream

    def empty_cache_reached(self) -> int | None:
        return None


class VrampoolBackend:
    name = "vrampool"

    def __init__(self, lib: Library, hooks: str, ext, pluggable):
        self.lib = lib
        self.hooks = hooks
        self.ext = ext
        self.pluggable = pluggable  # torch.cuda.memory.CUDAPluggableAllocator

    device = 0  # the run uses GPU 0 (PyTorch's default device)

    def stats(self) -> dict:
        return self.lib.stats(self.device)

    def reserved(self) -> int:
        return self.stats()["reserved_bytes"]

    def peak_reserved(self) -> int:
        return self.stats()["peak_reserved_bytes"]

    def counters(self) -> dict:
        s = self.stats()
        # Where the allocator's time can go besides its caches: device calls (maps, loans,
        # unmaps), waits, events. Deltas per workload land in the report's "allocator".
        keys = ("allocs", "ooms", "mapped_bytes", "unmapped_bytes", "pages_lent", "ladder_maps",
                "ladder_flushes", "ladder_waits", "device_waits", "events_recorded", "hurries_skipped", "records_asked", "events_queried", "same_stream_reuses",
                "ladder_ns", "release_ns", "map_ns", "unmap_ns", "event_ns", "query_ns", "record_ns", "reuse_record_ns", "wait_ns", "capture_ns")
        out = {k: s.get(k, 0) for k in keys}
        if self.ext is not None:
            c = self.ext.counters()
            out.update(
                hook_mallocs=c["mallocs"],
                hook_frees=c["frees"],
                alloc_ns=c["malloc_ns"] + c["free_ns"],
            )
        return out

    def final(self) -> dict:
        return self.stats()

    def pause_traces(self, paused: bool) -> None:
        self.lib.pause_traces(paused)

    def refusals(self) -> dict:
        s = self.stats()
        return {k: s.get(k, 0) for k in REFUSALS if s.get(k, 0)}

    def set_record_stream_hook(self, on: bool) -> bool:
        """Install or remove the record-stream hook; False where it cannot be installed."""
        if self.hooks == "cpp":
            self.ext.set_hooks(record_stream=on, empty_cache=True)
            return on
        if self.hooks == "ctypes":
            raw = self.pluggable.allocator()
            # An address of 0 makes an empty std::function: PyTorch's "no hook".
            raw.set_record_stream_fn(self.lib.address("vrampool_record_stream") if on else 0)
            return on
        return False

    def empty_cache_reached(self) -> int | None:
        return self.ext.counters()["empty_caches"] if self.ext is not None else None


def install_vrampool(lib_path: str, hooks: str, build_dir: str, verbose: bool = False):
    """Make vrampool PyTorch's CUDA allocator; must run before CUDA is initialised."""
    if hooks not in HOOKS:
        raise ValueError(f"--hooks is one of {HOOKS}")
    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA is already initialised: the allocator can no longer change")
    os.environ.setdefault("VRAMPOOL_DEVICE", "cuda")
    lib = Library(lib_path)
    ext = None
    if hooks == "cpp":
        ext = build_hooks(build_dir, verbose)
        ext.bind(lib.path)
        # The extension's own subclass of the pluggable allocator, which also answers
        # torch.cuda.memory_stats and its kin from vrampool's figures.
        pluggable = None
        ext.install()
    else:
        pluggable = torch.cuda.memory.CUDAPluggableAllocator(
            lib.path, "vrampool_malloc", "vrampool_free"
        )
        torch.cuda.memory.change_current_allocator(pluggable)
    if hooks == "cpp":
        name = ext.set_hooks(record_stream=True, empty_cache=True)
        assert name == "pluggable", name
        ext.set_timing(True)
    elif hooks == "ctypes":
        raw = pluggable.allocator()
        if not isinstance(raw, torch._C._CUDAPluggableAllocator):
            raise RuntimeError(f"the allocator object is a {type(raw)}, without set_*_fn")
        raw.set_record_stream_fn(lib.address("vrampool_record_stream"))
        raw.set_reset_fn(lib.address("vrampool_empty_cache"))
    return VrampoolBackend(lib, hooks, ext, pluggable)


def backend_for(args):
    """The backend the child process runs under, installed."""
    if args.allocator == "pytorch":
        return PyTorchBackend()
    if not args.lib:
        sys.exit("--allocator vrampool needs --lib path/to/libvrampool.so")
    return install_vrampool(args.lib, args.hooks, args.build_dir, args.verbose)
