"""The C ABI through Python's ctypes, on the simulator: what a Python program (or PyTorch's
CUDAPluggableAllocator, which loads the same symbols) sees.

    VRAMPOOL_DEVICE=sim python3 tests/python/smoke.py target/release/libvrampool.so

Run by tests/c_abi.rs. Exits 0 when every check passed.
"""

import ctypes
import json
import os
import sys
import threading

os.environ.setdefault("VRAMPOOL_DEVICE", "sim")
os.environ.setdefault("VRAMPOOL_SIM_BYTES", "2GiB")

lib = ctypes.CDLL(sys.argv[1] if len(sys.argv) > 1 else "target/release/libvrampool.so")

vp = ctypes.c_void_p
lib.vrampool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, vp]
lib.vrampool_malloc.restype = vp
lib.vrampool_free.argtypes = [vp, ctypes.c_ssize_t, ctypes.c_int, vp]
lib.vrampool_free.restype = None
lib.vrampool_free_any.argtypes = [vp, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int), ctypes.POINTER(vp)]
lib.vrampool_free_any.restype = ctypes.c_int
lib.vrampool_record_stream.argtypes = [vp, vp]
lib.vrampool_record_stream.restype = ctypes.c_int
lib.vrampool_empty_cache.argtypes = []
lib.vrampool_empty_cache.restype = ctypes.c_int
lib.vrampool_stats_json.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
lib.vrampool_stats_json.restype = ctypes.c_size_t
lib.vrampool_last_error.argtypes = []
lib.vrampool_last_error.restype = ctypes.c_char_p
lib.vrampool_last_error_code.argtypes = []
lib.vrampool_last_error_code.restype = ctypes.c_int
lib.vrampool_version.restype = ctypes.c_char_p
lib.vrampool_abi_version.restype = ctypes.c_uint32
OOM_HANDLER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_size_t, ctypes.c_int, vp)
lib.vrampool_set_oom_handler.argtypes = [ctypes.c_int, OOM_HANDLER, vp]
lib.vrampool_set_oom_handler.restype = ctypes.c_int



class Extent(ctypes.Structure):
    """vrampool_extent."""

    _fields_ = [(name, ctypes.c_uint64) for name in ("segment", "segment_bytes", "addr", "bytes", "requested")] + [
        ("stream", vp), ("pool_a", ctypes.c_uint64), ("pool_b", ctypes.c_uint64), ("state", ctypes.c_int)]


lib.vrampool_snapshot.argtypes = [ctypes.c_int, ctypes.POINTER(Extent), ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
lib.vrampool_snapshot.restype = ctypes.c_int
LIVE = 0

INVALID_ARGUMENT, INVALID_FREE, DOUBLE_FREE, OUT_OF_MEMORY = 1, 2, 3, 4


def stats(device=0):
    """The statistics JSON: asked for its length, then with room for it to grow, as the
    figures move between calls (settling pending frees in the call itself takes time)."""
    n = lib.vrampool_stats_json(device, None, 0)
    while True:
        assert n > 0, lib.vrampool_last_error()
        room = n + 64
        buf = ctypes.create_string_buffer(room)
        n = lib.vrampool_stats_json(device, buf, room)
        if 0 < n < room:
            assert len(buf.value) == n
            return json.loads(buf.value)


def expect_error(code):
    got = lib.vrampool_last_error_code()
    msg = lib.vrampool_last_error()
    assert got == code and msg, (code, got, msg)
    assert lib.vrampool_last_error() is None


def stream(i):
    return vp(0x2000 + i)


def snapshot(device=0):
    """vrampool_snapshot's extents: asked for the count, then with room for a few more."""
    count = ctypes.c_size_t(0)
    assert lib.vrampool_snapshot(device, None, 0, ctypes.byref(count)) == 0, lib.vrampool_last_error()
    while True:
        room = count.value + 16
        out = (Extent * room)()
        assert lib.vrampool_snapshot(device, out, room, ctypes.byref(count)) == 0, lib.vrampool_last_error()
        if count.value <= room:
            return out[:count.value]


def live_blocks_in_snapshot():
    """Each live block shows as one live extent with its size and stream, until freed."""
    sizes = [300, 70_000, 5 << 20]
    blocks = [(lib.vrampool_malloc(n, 0, stream(20 + i)), n, i) for i, n in enumerate(sizes)]
    shown = {e.addr: e for e in snapshot()}
    for p, n, i in blocks:
        e = shown.get(p)
        assert e is not None and e.state == LIVE and e.requested == n and e.bytes >= n, (p, n, e)
        assert e.stream == stream(20 + i).value and (e.pool_a, e.pool_b) == (0, 0)
    for p, n, i in blocks:
        lib.vrampool_free(p, n, 0, stream(20 + i))
    assert not any(e.state == LIVE and e.addr in {p for p, _, _ in blocks} and e.requested for e in snapshot())


def out_of_memory_handler():
    """A Python callback frees a block kept as spare when the pool runs out (the limit is 80%
    of the simulated 2 GiB: two blocks of 1 GiB never fit at once)."""
    gib = 1 << 30
    spare = [lib.vrampool_malloc(gib, 0, None)]
    assert spare[0] is not None, lib.vrampool_last_error()
    asked = []

    @OOM_HANDLER
    def free_spare(requested, device, _user):
        asked.append((requested, device))
        if not spare:
            return 0
        lib.vrampool_free(spare.pop(), gib, 0, None)
        return 1

    calls0 = stats()["oom_handler_calls"]
    assert lib.vrampool_set_oom_handler(0, free_spare, None) == 0
    p = lib.vrampool_malloc(gib, 0, None)
    assert p is not None and not spare and asked == [(gib, 0)], (p, spare, asked)
    assert lib.vrampool_malloc(gib, 0, None) is None
    expect_error(OUT_OF_MEMORY)
    assert len(asked) == 2 and stats()["oom_handler_calls"] == calls0 + 2
    assert lib.vrampool_set_oom_handler(0, OOM_HANDLER(), None) == 0  # NULL: removed
    lib.vrampool_free(p, gib, 0, None)
    assert lib.vrampool_last_error() is None


def main():
    assert lib.vrampool_abi_version() == 1
    assert b"." in lib.vrampool_version()
    assert lib.vrampool_last_error() is None

    assert lib.vrampool_malloc(0, 0, None) is None
    assert lib.vrampool_last_error() is None
    assert lib.vrampool_malloc(-3, 0, None) is None
    expect_error(INVALID_ARGUMENT)

    s = stats()
    for key in ("allocated_bytes", "reserved_bytes", "cached_bytes", "abi_double_frees", "abi_pending_frees"):
        assert key in s, key

    p = lib.vrampool_malloc(1 << 20, 0, stream(0))
    assert p is not None and p % 256 == 0
    ctypes.memset(p, 7, 1 << 20)  # simulated device memory is host memory
    assert stats()["allocated_bytes"] >= 1 << 20
    assert lib.vrampool_record_stream(p, stream(1)) == 0
    lib.vrampool_free(p + 256, (1 << 20) - 256, 0, stream(0))
    expect_error(INVALID_FREE)
    lib.vrampool_free(p, 1 << 20, 0, stream(0))
    assert lib.vrampool_last_error() is None
    lib.vrampool_free(p, 1 << 20, 0, stream(0))
    expect_error(DOUBLE_FREE)
    lib.vrampool_free(None, 5, 0, None)
    assert lib.vrampool_last_error() is None

    # A free by address alone answers what the block was.
    p = lib.vrampool_malloc(3000, 0, stream(2))
    size, device, where = ctypes.c_size_t(0), ctypes.c_int(-1), vp()
    assert lib.vrampool_free_any(p, ctypes.byref(size), ctypes.byref(device), ctypes.byref(where)) == 0
    assert (size.value, device.value, where.value) == (3000, 0, stream(2).value)
    assert lib.vrampool_free_any(p, None, None, None) == DOUBLE_FREE
    expect_error(DOUBLE_FREE)

    # Blocks allocated on one thread and freed on another, each thread its own stream.
    blocks = []
    lock = threading.Lock()

    def alloc(i):
        for k in range(200):
            size = 256 * (1 + (k * 37 + i) % 500)
            q = lib.vrampool_malloc(size, 0, stream(10 + i))
            assert q is not None, lib.vrampool_last_error()
            with lock:
                blocks.append((q, size, 10 + i))

    threads = [threading.Thread(target=alloc, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stats()["allocated_bytes"] > 0

    def free(part):
        for q, size, i in part:
            lib.vrampool_free(q, size, 0, stream(i))
            assert lib.vrampool_last_error() is None

    parts = [blocks[i::3] for i in range(3)]
    threads = [threading.Thread(target=free, args=(part,)) for part in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    out_of_memory_handler()
    live_blocks_in_snapshot()

    s = stats()
    assert s["allocated_bytes"] == 0, s
    assert s["abi_pending_frees"] == 0, s
    assert s["abi_foreign_frees"] > 0, s
    assert lib.vrampool_empty_cache() == 0, lib.vrampool_last_error()
    s = stats()
    assert s["allocated_bytes"] == 0 and s["reserved_bytes"] == 0, s
    assert s["abi_internal_errors"] == 0, s
    print("Python ctypes smoke test: every check passed")


if __name__ == "__main__":
    main()
