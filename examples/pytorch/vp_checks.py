"""What the allocator must get right beyond the models, checked in the same process:
record_stream, empty_cache, out-of-memory, the statistics PyTorch asks of the allocator,
and what a malloc/free pair costs through PyTorch's wrapper and around it.
"""

from __future__ import annotations

import time

import torch


def cycles_per_ms() -> float:
    """torch.cuda._sleep's clock ticks per millisecond on this GPU."""
    torch.cuda._sleep(1_000_000)  # warm up the kernel
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def side_stream_reuse(record: bool, busy_ms: float, per_ms: float, mib: int = 64) -> dict:
    """A tensor x written on the main stream and read on a side stream that is still busy
    (a sleep kernel) when x is freed on the main stream; then a tensor of the same size is
    allocated on the main stream and written with another pattern. The side stream's copy
    of x must read the first pattern. `record` calls x.record_stream(side) first, which is
    what tells the allocator that the side stream still uses x."""
    n = mib * 2**20 // 4
    main = torch.cuda.current_stream()
    # High priority: from another pool of PyTorch's streams than the threads' own, so the
    # side stream is never the main stream itself (which would make the test show nothing).
    side = torch.cuda.Stream(priority=-1)
    x = torch.full((n,), 1.0, device="cuda")
    y = torch.empty(n, device="cuda")
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(busy_ms * per_ms))
        y.copy_(x)
    if record:
        x.record_stream(side)
    old = x.data_ptr()
    del x  # freed on the main stream while the side stream still has to read it
    z = torch.empty(n, device="cuda")
    z.fill_(2.0)  # main stream: runs at once, during the side stream's sleep
    reused = z.data_ptr() == old
    busy_when_freed = not side.query()
    side.synchronize()
    torch.cuda.synchronize()
    wrong = int((y != 1.0).sum().item())
    saw_second = bool((y == 2.0).any().item())
    del y, z
    return {
        "record_stream_called": record,
        "side_busy_at_free": busy_when_freed,
        "same_address_reused": reused,
        "corrupted_elements": wrong,
        "saw_second_pattern": saw_second,
    }


def side_stream_reuse_threads(threads: int, record: bool, busy_ms: float, per_ms: float) -> list:
    """side_stream_reuse on `threads` threads at once, each with its own main stream (and
    its own side stream): the frees, reuses and record_stream calls of 4 streams overlap."""
    from vp_workloads import run_threads

    def body(t, stream, barrier):
        barrier.wait()
        return side_stream_reuse(record, busy_ms, per_ms)

    _, results = run_threads(threads, body)
    return results


def record_stream(backend) -> dict:
    """The side-stream test with the hook on (must be clean) and, where the hook can be
    removed, with it off (shows what a record_stream that never reaches the pool does);
    each on the main thread's default stream and on 4 threads with their own streams."""
    per_ms = cycles_per_ms()
    cases = []
    if backend.name == "pytorch":
        cases.append(("record_stream", True, True))
        cases.append(("no record_stream", False, False))
    elif backend.hooks in ("cpp", "ctypes"):
        cases.append(("hook on", True, True))
        cases.append(("hook off", True, False))
    else:
        cases.append(("no hook (public wrapper)", True, False))
    switchable = backend.name == "vrampool" and backend.hooks in ("cpp", "ctypes")
    counted = backend.name == "vrampool" and backend.hooks == "cpp"
    out = []
    for label, call, hook in cases:
        for threads in (1, 4):
            if switchable:
                backend.set_record_stream_hook(hook)
            before = backend.ext.counters()["record_streams"] if counted else None
            try:
                if threads == 1:
                    runs = [side_stream_reuse(call, busy_ms=200.0, per_ms=per_ms)]
                else:
                    runs = side_stream_reuse_threads(threads, call, busy_ms=200.0, per_ms=per_ms)
            finally:
                if switchable:
                    backend.set_record_stream_hook(True)
            r = {
                "case": label,
                "threads": threads,
                "record_stream_called": call,
                "corrupted_elements": sum(x["corrupted_elements"] for x in runs),
                "saw_second_pattern": any(x["saw_second_pattern"] for x in runs),
                "same_address_reused": sum(x["same_address_reused"] for x in runs),
                "side_busy_at_free": sum(x["side_busy_at_free"] for x in runs),
                "runs": len(runs),
            }
            if before is not None:
                r["reached_pool"] = backend.ext.counters()["record_streams"] - before
            r["must_be_clean"] = hook
            # Clean is required with the hook; a side stream that had finished before the
            # free would make the test show nothing, so it must have been busy.
            r["ok"] = (r["corrupted_elements"] == 0 and r["side_busy_at_free"] == len(runs)) if hook else True
            out.append(r)
    return {"cases": out, "ok": all(c["ok"] for c in out), "cycles_per_ms": per_ms}


def empty_cache(backend) -> dict:
    """Free 1 GiB, then torch.cuda.empty_cache(): the allocator's reserved bytes before
    and after, and whether the call reached vrampool."""
    t = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    t.fill_(1)
    del t
    torch.cuda.synchronize()
    reached0 = backend.empty_cache_reached()
    before = backend.reserved()
    torch.cuda.empty_cache()
    after = backend.reserved()
    reached = None if reached0 is None else backend.empty_cache_reached() - reached0 > 0
    r = {"reserved_before": before, "reserved_after": after, "released": before - after,
         "reached_pool": reached}
    if backend.name == "pytorch" or backend.hooks == "cpp":
        # With a hook that counts, the call must arrive; what the pool gives back is shown.
        r["ok"] = reached is not False and after <= before
    elif backend.hooks == "ctypes":
        r["ok"] = after <= before
    else:
        r["ok"] = True  # nothing reaches the pool: shown, not required
    return r


def cuda_graph(backend) -> dict:
    """Capture a small MLP step with torch.cuda.graph (its private pool: vrampool's graph
    pool through the hooks), replay it on new inputs, and compare with eager; then
    allocate eagerly while the graph lives and check that no eager tensor got the
    graph's memory (a replay would overwrite it)."""
    torch.manual_seed(1)
    layers = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)).cuda()
    static_in = torch.randn(32, 256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):  # warm-up on a side stream, as PyTorch's docs do
            layers(static_in)
    torch.cuda.current_stream().wait_stream(side)
    before = backend.ext.counters()["graph_mallocs"] if getattr(backend, "ext", None) is not None else None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        static_out = layers(static_in)
    graph_mallocs = None if before is None else backend.ext.counters()["graph_mallocs"] - before
    worst = 0.0
    eager_hits = 0
    for k in range(5):
        x = torch.randn(32, 256, device="cuda")
        static_in.copy_(x)
        g.replay()
        with torch.no_grad():
            ref = layers(x)
        worst = max(worst, (static_out - ref).abs().max().item())
        # Eager tensors made while the graph lives must not sit in its memory.
        eager = [torch.full((64 << 10,), k, device="cuda") for _ in range(16)]
        g.replay()
        torch.cuda.synchronize()
        eager_hits += sum(int((t != k).any().item()) for t in eager)
    del g, static_out
    torch.cuda.synchronize()
    r = {"max_abs_diff_vs_eager": worst, "eager_tensors_overwritten": eager_hits, "graph_mallocs": graph_mallocs}
    r["ok"] = worst < 1e-4 and eager_hits == 0 and (graph_mallocs is None or backend.name == "pytorch" or graph_mallocs > 0)
    return r


def _try_alloc(nbytes: int) -> dict:
    """torch.empty of nbytes: whether it raised, what and with which message."""
    try:
        t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        return {"raised": "torch.OutOfMemoryError", "message": str(e).splitlines()[0][:300]}
    except RuntimeError as e:  # noqa: BLE001 - reported
        return {"raised": type(e).__name__, "message": str(e).splitlines()[0][:300]}
    r = {"raised": None, "data_ptr": t.data_ptr()}
    del t
    return r


def out_of_memory(backend) -> dict:
    """Requests the GPU cannot serve must raise torch.OutOfMemoryError and leave the
    allocator usable: one no pool can ever hold (64 TiB), and one past what is left (60% of
    the free memory while 60% is allocated: the pool's whole ladder runs, then gives up),
    after which the same request, once the first is freed, must succeed (as PyTorch's
    test_out_of_memory_retry). Without the C++ wrapper a NULL would become a tensor at
    address 0: that case runs in a child process (run.py --oom-probe), never here."""
    if backend.name == "vrampool" and backend.hooks != "cpp":
        return {"skipped": "alloc function unchecked (no C++ wrapper): see --oom-probe", "ok": True}
    cases = []
    r = _try_alloc(1 << 46)  # 64 TiB
    r["case"] = "64 TiB"
    r["ok"] = r["raised"] == "torch.OutOfMemoryError"
    cases.append(r)

    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    size = int(free * 0.6)
    first = torch.empty(size, dtype=torch.uint8, device="cuda")
    r = _try_alloc(size)
    r["case"] = f"60% of free ({size / 2**30:.1f} GiB) twice"
    r["ok"] = r["raised"] == "torch.OutOfMemoryError"
    del first
    retry = _try_alloc(size)
    r["retry_after_free"] = "ok" if retry["raised"] is None else f"{retry['raised']}: {retry.get('message')}"
    r["ok"] = r["ok"] and retry["raised"] is None
    cases.append(r)
    torch.cuda.empty_cache()

    after = torch.ones(1 << 20, device="cuda")
    usable = bool(after.sum().item() == (1 << 20))
    del after
    return {"cases": cases, "usable_after": usable, "ok": usable and all(c["ok"] for c in cases)}


def memory_fraction(backend) -> dict:
    """torch.cuda.set_per_process_memory_fraction must bind the allocator: at a tenth of the
    device, a request for a fifth raises torch.OutOfMemoryError; back at the default, the same
    request is served. Under vrampool the fraction reaches vrampool_set_memory_fraction
    through the pluggable allocator's hook (the C++ wrapper installs it); the default
    fraction is PyTorch's 1.0 and vrampool's 0.8 (its pool's ceiling).
    get_per_process_memory_fraction reads each back."""
    if backend.name == "vrampool" and backend.hooks != "cpp":
        return {"skipped": "the memory-fraction hook is installed by the C++ wrapper", "ok": True}
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info()
    default = 0.8 if backend.name == "vrampool" else 1.0
    size = total // 5
    r = {}
    get = torch.cuda.get_per_process_memory_fraction
    r["read_first"] = get()
    try:
        torch.cuda.set_per_process_memory_fraction(0.1)
        r["read_at_a_tenth"] = get()
        r["at_a_tenth"] = _try_alloc(size)
    finally:
        torch.cuda.set_per_process_memory_fraction(default)
    r["read_at_default"] = get()
    r["at_default"] = _try_alloc(size)
    torch.cuda.empty_cache()
    r["ok"] = (r["at_a_tenth"]["raised"] == "torch.OutOfMemoryError" and r["at_default"]["raised"] is None
               and abs(r["read_first"] - default) < 1e-3 and abs(r["read_at_a_tenth"] - 0.1) < 1e-3
               and abs(r["read_at_default"] - default) < 1e-3)
    return r


def memory_statistics(backend) -> dict:
    """PyTorch's memory statistics must follow a tensor: memory_allocated grows by at least
    its size while it lives, max_memory_allocated and max_memory_reserved cover it, and after
    it is freed, the cache emptied and the peaks reset, max_memory_reserved is below the
    peak it had; after reset_accumulated_memory_stats the allocation counts start from zero;
    memory_summary reads them. Under vrampool these are answered by the C++ wrapper's allocator from
    vrampool's own figures (the public wrapper alone raises)."""
    if backend.name == "vrampool" and backend.hooks != "cpp":
        return {"skipped": "the statistics come through the C++ wrapper's allocator", "ok": True}
    size = 256 << 20
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t = torch.empty(size, dtype=torch.uint8, device="cuda")
    r = {
        "allocated_growth": torch.cuda.memory_allocated() - base,
        "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(),
    }
    del t
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    r["max_reserved_after_reset"] = torch.cuda.max_memory_reserved()
    # The accumulated counts start again: none after the reset, one allocation and one free
    # of a tensor after it.
    torch.cuda.reset_accumulated_memory_stats()
    counts = lambda: {k: torch.cuda.memory_stats()[f"allocation.all.{k}"] for k in ("allocated", "freed")}
    r["counts_after_reset"] = counts()
    t = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    del t
    r["counts_after_a_tensor"] = counts()
    r["summary_lines"] = len(torch.cuda.memory_summary().splitlines())
    r["ok"] = (r["allocated_growth"] >= size and r["max_allocated"] >= base + size
               and r["max_reserved"] >= size and r["max_reserved_after_reset"] < r["max_reserved"]
               and r["counts_after_reset"] == {"allocated": 0, "freed": 0}
               and r["counts_after_a_tensor"] == {"allocated": 1, "freed": 1}
               and r["summary_lines"] > 10)
    return r


def _block_at(segments: list, ptr: int):
    """The block of `segments` (torch.cuda.memory_snapshot's list) starting at `ptr`."""
    for seg in segments:
        at = seg["address"]
        for b in seg["blocks"]:
            if at == ptr:
                return b
            at += b["size"]
    return None


def memory_snapshot(backend) -> dict:
    """torch.cuda.memory_snapshot must show a live tensor as an allocated block at its
    address with the bytes asked for, in segments their blocks cover end to end, and not once
    it is freed; memory_viz's segment summary must read it. Under vrampool the C++ wrapper's
    allocator answers from vrampool_snapshot (the public wrapper alone raises)."""
    if backend.name == "vrampool" and backend.hooks != "cpp":
        return {"skipped": "the snapshot comes through the C++ wrapper's allocator", "ok": True}
    from torch.cuda import _memory_viz

    size = (64 << 20) + 12345
    torch.cuda.synchronize()
    t = torch.empty(size, dtype=torch.uint8, device="cuda")
    ptr = t.data_ptr()
    segments = torch.cuda.memory_snapshot()
    block = _block_at(segments, ptr)
    r = {
        "segments": len(segments),
        "blocks": sum(len(s["blocks"]) for s in segments),
        "covered": all(sum(b["size"] for b in s["blocks"]) == s["total_size"] for s in segments),
        "block": block and {k: block[k] for k in ("size", "requested_size", "state")},
    }
    summary = _memory_viz.segsum(torch.cuda.memory._snapshot())
    r["segsum_lines"] = len(summary.splitlines())
    del t
    torch.cuda.synchronize()
    after = _block_at(torch.cuda.memory_snapshot(), ptr)
    r["after_free"] = after and after["state"]
    r["ok"] = (r["covered"] and block is not None and block["state"] == "active_allocated"
               and block["requested_size"] == size and block["size"] >= size
               and r["segsum_lines"] > 1
               and (after is None or after["state"] != "active_allocated"))
    return r


def _in_segments(segments: list, ptr: int) -> bool:
    return any(seg["address"] <= ptr < seg["address"] + seg["total_size"] for seg in segments)


def mem_pool(backend) -> dict:
    """torch.cuda.MemPool and use_mem_pool: tensors made inside the context live in the
    pool (its memory_snapshot lists segments holding them), one made outside does not, the
    pool's use count reads 1, 2 inside the context and 1 again after it, and every tensor
    keeps its values. Under vrampool the pool is a graph pool, through the C++ wrapper."""
    if backend.name == "vrampool" and backend.hooks != "cpp":
        return {"skipped": "MemPool comes through the C++ wrapper's allocator", "ok": True}
    torch.cuda.synchronize()
    pool = torch.cuda.MemPool()
    counts = [pool.use_count()]
    with torch.cuda.use_mem_pool(pool):
        counts.append(pool.use_count())
        inside = [torch.full((1 << 20,), i, dtype=torch.uint8, device="cuda") for i in range(4)]
    counts.append(pool.use_count())
    outside = torch.full((1 << 20,), 9, dtype=torch.uint8, device="cuda")
    segments = torch.cuda.memory_snapshot(pool.id)
    r = {
        "use_counts": counts,
        "pool_segments": len(segments),
        "inside_in_pool": sum(_in_segments(segments, t.data_ptr()) for t in inside),
        "outside_in_pool": _in_segments(segments, outside.data_ptr()),
    }
    torch.cuda.synchronize()
    r["values_kept"] = all(bool((t == i).all().item()) for i, t in enumerate(inside)) and bool((outside == 9).all().item())
    del inside, outside, pool
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    r["ok"] = (counts == [1, 2, 1] and r["inside_in_pool"] == 4 and not r["outside_in_pool"] and r["values_kept"])
    return r


def _marked_allocation(nbytes: int) -> torch.Tensor:
    """A tensor allocated under a name to find in its stack."""
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def memory_history(backend) -> dict:
    """With torch.cuda.memory._record_memory_history on, the snapshot must carry the Python
    stack that allocated a live tensor (this function's helper among its frames) and the
    recent allocations and frees, which memory_viz's trace view draws; off again, no new
    event is kept. Under vrampool the C++ wrapper's allocator keeps both (the public wrapper
    alone raises)."""
    if backend.name == "vrampool" and backend.hooks != "cpp":
        return {"skipped": "the history comes through the C++ wrapper's allocator", "ok": True}
    from torch.cuda import _memory_viz

    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(context="all", stacks="python", max_entries=10_000)
    try:
        t = _marked_allocation((3 << 20) + 5)
        u = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        u_ptr = u.data_ptr()
        del u
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    block = _block_at(snap["segments"], t.data_ptr())
    names = [f.get("name") for f in (block or {}).get("frames", [])]
    events = [e for device in snap["device_traces"] for e in device]
    seen = lambda action, ptr: any(e["action"] == action and e["addr"] == ptr for e in events)
    r = {
        "stack": names[:6],
        "events": len(events),
        "alloc_seen": seen("alloc", t.data_ptr()),
        "free_seen": seen("free_requested", u_ptr) and seen("free_completed", u_ptr),
        "trace_plot_bytes": len(_memory_viz.trace_plot(snap)),
    }
    # Off: an allocation adds no event (its address may be one the trace already holds).
    after = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    later = [e for device in torch.cuda.memory._snapshot()["device_traces"] for e in device]
    allocs_at = lambda evs: sum(e["action"] == "alloc" and e["addr"] == after.data_ptr() for e in evs)
    r["kept_after_off"] = allocs_at(later) > allocs_at(events)
    del t, after
    r["ok"] = ("_marked_allocation" in names and r["alloc_seen"] and r["free_seen"]
               and r["trace_plot_bytes"] > 0 and not r["kept_after_off"])
    return r


def oom_observer(backend) -> dict:
    """An observer attached with torch._C._cuda_attach_out_of_memory_observer must be called
    when an allocation runs out, before torch.OutOfMemoryError reaches the program, and may
    take a snapshot there (PyTorch's memory docs dump one so). Observers cannot be detached:
    this one stays, and only counts. Under vrampool the C++ wrapper's allocator calls them
    (the public wrapper alone raises when one is attached)."""
    if backend.name == "vrampool" and backend.hooks != "cpp":
        return {"skipped": "observers are called by the C++ wrapper's allocator", "ok": True}
    seen = []

    def observe(device, alloc, device_total, device_free):
        segments = torch.cuda.memory._snapshot()["segments"]
        seen.append({"device": device, "alloc": alloc, "device_total": device_total,
                     "device_free": device_free, "segments": len(segments)})

    torch._C._cuda_attach_out_of_memory_observer(observe)
    r = {"first": _try_alloc(1 << 46)}
    r["observed"] = seen[:1]
    r["ok"] = (r["first"]["raised"] == "torch.OutOfMemoryError" and len(seen) == 1
               and seen[0]["alloc"] >= 1 << 46 and seen[0]["device_total"] > 0)
    return r


def oom_probe() -> dict:
    """Run in a child with the public wrapper only: what a NULL from the alloc function
    becomes (the tensor is never touched)."""
    t = torch.empty(1 << 46, dtype=torch.uint8, device="cuda")
    return {"data_ptr": t.data_ptr(), "numel": t.numel()}


def pytorch_stats_calls() -> dict:
    """What PyTorch's statistics functions do under this allocator."""
    out = {}
    calls = {
        "torch.cuda.memory_stats": torch.cuda.memory_stats,
        "torch.cuda.max_memory_reserved": torch.cuda.max_memory_reserved,
        "torch.cuda.memory_allocated": torch.cuda.memory_allocated,
        "torch.cuda.mem_get_info": torch.cuda.mem_get_info,
    }
    for name, f in calls.items():
        try:
            v = f()
            out[name] = "ok" if isinstance(v, dict) else f"ok: {v}"
        except Exception as e:  # noqa: BLE001 - reported
            out[name] = f"raises {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return out


def tensor_pairs(n: int) -> dict:
    """torch.empty(1 KiB) and its free, n times on the main thread: the whole per-tensor
    path (dispatcher, allocator, storage), in microseconds per pair."""
    for _ in range(1000):
        torch.empty(256, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        torch.empty(256, device="cuda")
    dt = time.perf_counter() - t0
    return {"pairs": n, "us_per_pair": dt / n * 1e6}


def wrapper_cost(backend, quick: bool) -> dict:
    """Malloc/free pairs from C++ threads, each on its own stream: straight into vrampool
    ("direct"), the same with one process-wide mutex taken per call as the wrapper takes
    its own ("mutex": the lock's share), through the C++ CUDAPluggableAllocator object
    ("pluggable": its std::function, mutex and map, then the C++ hook) and through PyTorch's current
    allocator as PyTorch's code calls it ("allocator": raw_alloc_with_stream/raw_delete;
    for vrampool the pluggable path plus a cudaGetDevice, for PyTorch its caching
    allocator). Needs the C++ extension."""
    ext = backend.ext
    if ext is None:
        return {"skipped": "needs the C++ extension (--hooks cpp)"}
    streams = [torch.cuda.Stream() for _ in range(4)]
    handles = [s.cuda_stream for s in streams]
    rounds = 50_000 if quick else 200_000
    timing = ext.counters()["timing"]
    ext.set_timing(False)
    rows = []
    try:
        paths = ["direct", "mutex", "pluggable", "allocator"] if backend.name == "vrampool" else ["allocator"]
        for window, size in ((1, 4096), (64, 65536)):
            for threads in (1, 4):
                for path in paths:
                    r_rounds = max(1, rounds // window)
                    ext.bench_pairs(path, size, max(1, r_rounds // 10), window, handles, threads)
                    r = ext.bench_pairs(path, size, r_rounds, window, handles, threads)
                    per = r["ns_per_pair_per_thread"]
                    rows.append({
                        "path": path, "threads": threads, "window": window, "size": size,
                        "ns_per_pair": sum(per) / len(per),
                        "ns_per_pair_aggregate": r["ns_per_pair_aggregate"],
                    })
    finally:
        ext.set_timing(timing)
    torch.cuda.synchronize()
    return {"rows": rows}
