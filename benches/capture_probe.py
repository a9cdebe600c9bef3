"""Which CUDA driver calls may run while a stream is being captured, per capture mode, from
the capturing thread and another, with and without RELAXED exchanged in; and whether the
capture survives (cuStreamEndCapture). ctypes on libcuda only: python3 benches/capture_probe.py.
The H200's answers are in docs/BENCHMARKS.md (2026-12-02, graph capture)."""
import ctypes as C, threading, sys
cu = C.CDLL("libcuda.so.1")
def ck(rc, what):
    if rc: sys.exit(f"{what}: {rc}")
u64 = C.c_uint64
ck(cu.cuInit(0), "init")
dev = C.c_int(); ck(cu.cuDeviceGet(C.byref(dev), 0), "dev")
ctx = C.c_void_p(); ck(cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "ctx")
ck(cu.cuCtxSetCurrent(ctx), "set")
def stream():
    s = C.c_void_p(); ck(cu.cuStreamCreate(C.byref(s), 1), "stream"); return s
def event():
    e = C.c_void_p(); ck(cu.cuEventCreate(C.byref(e), 2), "event"); return e
s, t = stream(), stream()
e = event(); ck(cu.cuEventRecord(e, t), "rec"); ck(cu.cuCtxSynchronize(), "sync")
class Loc(C.Structure): _fields_ = [("type", C.c_int), ("id", C.c_int)]
class Flags(C.Structure): _fields_ = [("compressionType", C.c_ubyte), ("gpuDirectRDMACapable", C.c_ubyte), ("usage", C.c_ushort), ("reserved", C.c_ubyte * 4)]
class Prop(C.Structure): _fields_ = [("type", C.c_int), ("requestedHandleTypes", C.c_int), ("location", Loc), ("win32", C.c_void_p), ("allocFlags", Flags)]
class Access(C.Structure): _fields_ = [("location", Loc), ("flags", C.c_int)]
G = 2 << 20
def vmm():
    va = u64(); h = u64(); p = Prop(1, 0, Loc(1, 0)); a = Access(Loc(1, 0), 3)
    rcs = [cu.cuMemAddressReserve(C.byref(va), C.c_size_t(G), C.c_size_t(0), u64(0), u64(0))]
    rcs.append(cu.cuMemCreate(C.byref(h), C.c_size_t(G), C.byref(p), u64(0)))
    rcs.append(cu.cuMemMap(va, C.c_size_t(G), C.c_size_t(0), h, u64(0)))
    rcs.append(cu.cuMemSetAccess(va, C.c_size_t(G), C.byref(a), C.c_size_t(1)))
    rcs.append(cu.cuMemUnmap(va, C.c_size_t(G))); rcs.append(cu.cuMemRelease(h)); rcs.append(cu.cuMemAddressFree(va, C.c_size_t(G)))
    return max(rcs)
def getid(x):
    i = u64(); return cu.cuStreamGetId(x, C.byref(i))
def iscap(x):
    st = C.c_int(); return cu.cuStreamIsCapturing(x, C.byref(st))
def meminfo():
    f = C.c_size_t(); tt = C.c_size_t(); return cu.cuMemGetInfo_v2(C.byref(f), C.byref(tt))
probes = {
    "cuStreamGetId(capturing)": lambda: getid(s),
    "cuStreamGetId(other)": lambda: getid(t),
    "cuStreamIsCapturing(capturing)": lambda: iscap(s),
    "cuEventQuery(other's event)": lambda: cu.cuEventQuery(e),
    "cuEventRecord(other)": lambda: cu.cuEventRecord(event(), t),
    "cuStreamWaitEvent(other, e)": lambda: cu.cuStreamWaitEvent(t, e, 0),
    "cuStreamQuery(other)": lambda: cu.cuStreamQuery(t),
    "VMM reserve/create/map/access/unmap": vmm,
    "cuMemGetInfo": meminfo,
    "cuEventRecord(capturing)": lambda: cu.cuEventRecord(event(), s),
    "cuStreamWaitEvent(capturing, external e)": lambda: cu.cuStreamWaitEvent(s, e, 0),
    "cuStreamQuery(capturing)": lambda: cu.cuStreamQuery(s),
}
def relaxed(fn):
    def run():
        m = C.c_int(2); cu.cuThreadExchangeStreamCaptureMode(C.byref(m)); rc = fn(); cu.cuThreadExchangeStreamCaptureMode(C.byref(m)); return rc
    return run
def on_thread(fn):
    def run():
        out = []
        def body():
            cu.cuCtxSetCurrent(ctx); out.append(fn())
        th = threading.Thread(target=body); th.start(); th.join(); return out[0]
    return run
print(f"{'probe':42} {'mode':6} {'where':14} rc  end-capture rc")
for name, fn in probes.items():
    for mode, mname in ((0, "global"), (1, "thread"), (2, "relax")):
        for where, f in (("same thread", fn), ("same+RELAXED", relaxed(fn)), ("other thread", on_thread(fn)), ("other+RELAXED", on_thread(relaxed(fn)))):
            ck(cu.cuStreamBeginCapture_v2(s, mode), "begin")
            rc = f()
            g = C.c_void_p(); rc2 = cu.cuStreamEndCapture(s, C.byref(g))
            if g.value: cu.cuGraphDestroy(g)
            cu.cuCtxSynchronize()
            print(f"{name:42} {mname:6} {where:14} {rc:<3} {rc2}", flush=True)
