#!/usr/bin/env python3
"""PyTorch on vrampool: real models with random weights under vrampool and under PyTorch's
own caching allocator, with the same seeds; their outputs compared and their figures side
by side.

    python3 examples/pytorch/run.py --lib target/release/libvrampool.so [--quick]

runs one child process per allocator (``--allocator pytorch``, then ``--allocator
vrampool``), each of which runs every workload (vp_workloads.py) and the checks
(vp_checks.py) and saves its outputs (``<out>/<allocator>.pt``) and figures
(``<out>/<allocator>.json``); then compares the outputs and prints the tables (also written
to ``<out>/summary.md``). Exit status 0 when the outputs match and every check passed.

    python3 examples/pytorch/run.py --allocator vrampool --lib ... --out DIR   # one child
    python3 examples/pytorch/run.py --compare DIR/pytorch.pt DIR/vrampool.pt     # outputs only

Nothing is downloaded: the models are built from their configurations with random
weights. vrampool is configured by its environment variables (VRAMPOOL_DEVICE=cuda is the
default here; VRAMPOOL_MAX_RESERVED, ...).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings

# Before torch is imported: cuBLAS reads it when it makes its workspaces, and a fixed
# workspace is what makes its kernels deterministic.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import vp_alloc  # noqa: E402
import vp_checks  # noqa: E402
import vp_workloads  # noqa: E402

GIB = float(1 << 30)


# ---- one allocator, in this process -------------------------------------------------------


class DeviceSampler:
    """The device's used memory (cudaMemGetInfo: total - free) every 10 ms on a thread of
    its own, and its peak since the last reset: what nvidia-smi shows, context included."""

    def __init__(self, period: float = 0.01):
        self.period = period
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mem-sampler", daemon=True)

    def used(self) -> int:
        free, total = torch.cuda.mem_get_info()
        return total - free

    def _run(self):
        torch.cuda.set_device(0)
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used())
            self._stop.wait(self.period)

    def start(self):
        self.peak = self.used()
        self._thread.start()

    def reset(self) -> None:
        self.peak = self.used()

    def stop(self):
        self._stop.set()
        self._thread.join()


class NondeterminismLog:
    """The warnings torch.use_deterministic_algorithms(warn_only=True) gives: the ops that
    have no deterministic kernel, by the workload running when they warned. A workload
    none of whose ops warned must give bit-identical outputs under both allocators."""

    def __init__(self):
        self.seen: dict[str, list[str]] = {}
        self.current = None
        self._show = warnings.showwarning
        self._filters = None

    def __enter__(self):
        def show(message, category, filename, lineno, file=None, line=None):
            text = str(message)
            if "deterministic" in text:
                first = text.splitlines()[0][:200]
                mine = self.seen.setdefault(self.current or "-", [])
                if first in mine:
                    return None
                mine.append(first)
            return self._show(message, category, filename, lineno, file, line)

        self._filters = warnings.filters[:]
        # Every occurrence, not once per call site: a later workload that uses an op an
        # earlier one warned about must be attributed too.
        warnings.filterwarnings("always", message=".*deterministic.*")
        warnings.showwarning = show
        return self

    def __exit__(self, *exc):
        warnings.showwarning = self._show
        warnings.filters[:] = self._filters


def child(args) -> int:
    backend = vp_alloc.backend_for(args)  # before anything touches CUDA
    if backend.name == "pytorch" and args.hooks == "cpp":
        # Only for the cost of PyTorch's own allocator's pair (vp_checks.wrapper_cost).
        backend.ext = vp_alloc.build_hooks(args.build_dir, args.verbose)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.cuda.init()
    props = torch.cuda.get_device_properties(0)
    sampler = DeviceSampler()
    sampler.start()
    report = {
        "allocator": backend.name,
        "hooks": backend.hooks,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": props.name,
        "device_total": props.total_memory,
        "quick": args.quick,
        "threads": args.threads,
        "seed": args.seed,
        "baseline_device_used": sampler.used(),
        "workloads": {},
    }
    outputs: dict = {}
    cfg = argparse.Namespace(seed=args.seed, quick=args.quick, threads=args.threads, device="cuda")
    with NondeterminismLog() as nondet:
        for name in args.only:
            # Each workload from the same start: nothing cached from the one before (the
            # empty_cache reaches vrampool through the C++ hook).
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            nondet.current = name
            c0 = backend.counters()
            sampler.reset()
            t0 = time.perf_counter()
            r = vp_workloads.ALL[name](cfg, outputs)
            torch.cuda.synchronize()
            r["total_s"] = time.perf_counter() - t0
            c1 = backend.counters()
            r["peak_reserved"] = backend.peak_reserved()
            r["reserved_after"] = backend.reserved()
            r["device_used_peak"] = sampler.peak
            r["allocator"] = {k: c1[k] - c0.get(k, 0) for k in c1}
            report["workloads"][name] = r
            print(f"[{backend.name}] {name}: {r['throughput']:.1f} {r['unit']} "
                  f"({r['wall_s']:.2f} s timed), peak reserved {r['peak_reserved'] / GIB:.2f} GiB",
                  flush=True)
            nondet.current = None
        report["nondeterministic_ops"] = nondet.seen
    # The checks and the cost measurements need no determinism, and its fill of every new
    # tensor would be counted in the per-tensor cost. Nor are they the workloads: a trace
    # recorded with VRAMPOOL_RECORD_TRACE stops here.
    backend.pause_traces(True)
    torch.use_deterministic_algorithms(False)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    checks = report["checks"] = {}
    checks["record_stream"] = vp_checks.record_stream(backend)
    checks["empty_cache"] = vp_checks.empty_cache(backend)
    checks["out_of_memory"] = vp_checks.out_of_memory(backend)
    checks["memory_fraction"] = vp_checks.memory_fraction(backend)
    checks["memory_statistics"] = vp_checks.memory_statistics(backend)
    checks["memory_snapshot"] = vp_checks.memory_snapshot(backend)
    checks["memory_history"] = vp_checks.memory_history(backend)
    checks["oom_observer"] = vp_checks.oom_observer(backend)
    checks["cuda_graph"] = vp_checks.cuda_graph(backend)
    checks["mem_pool"] = vp_checks.mem_pool(backend)
    report["pytorch_stats_calls"] = vp_checks.pytorch_stats_calls()
    report["tensor_pairs"] = vp_checks.tensor_pairs(5_000 if args.quick else 20_000)
    report["wrapper_cost"] = vp_checks.wrapper_cost(backend, args.quick)
    sampler.stop()
    report["refusals"] = backend.refusals()
    report["final_stats"] = backend.final()
    torch.save(outputs, os.path.join(args.out, f"{backend.name}.pt"))
    with open(os.path.join(args.out, f"{backend.name}.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    ok = all(c.get("ok", True) for c in checks.values()) and not report["refusals"]
    print(f"[{backend.name}] checks {'passed' if ok else 'FAILED'}: "
          + ", ".join(f"{k}={'ok' if v.get('ok', True) else 'FAIL'}" for k, v in checks.items())
          + (f"; refused calls {report['refusals']}" if report["refusals"] else ""), flush=True)
    return 0 if ok else 1


def dry_run(args) -> int:
    """The workloads on the CPU, twice, outputs compared: checks the script's model code
    on a machine without a GPU (no allocator is involved)."""
    cfg = argparse.Namespace(seed=args.seed, quick=True, threads=args.threads, device="cpu")
    runs = []
    for _ in range(2):
        outputs: dict = {}
        for name in args.only:
            r = vp_workloads.ALL[name](cfg, outputs)
            print(f"[cpu] {name}: {r['throughput']:.1f} {r['unit']} ({r['detail']})", flush=True)
        runs.append(outputs)
    per = compare(*runs)
    print("\n".join(comparison_lines(per)))
    return 0 if all(r["ok"] for r in per.values()) else 1


def oom_probe(args) -> int:
    """The public wrapper alone, asked for 64 TiB: prints what the tensor became."""
    args.hooks = "none"
    vp_alloc.install_vrampool(args.lib, "none", args.build_dir)
    r = vp_checks.oom_probe()
    print("OOM-PROBE " + json.dumps(r), flush=True)
    return 0


# ---- comparing outputs ---------------------------------------------------------------------


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bit for bit (NaNs and signed zeros included, which torch.equal does not see)."""
    return torch.equal(x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8))


def compare(a: dict, b: dict, nondeterministic=()) -> dict:
    """Per workload: how many outputs, how many bit-exact, the largest difference, and
    whether they match: bit for bit where none of the workload's ops warned of a
    nondeterministic kernel (in `nondeterministic`: workload names), else floating outputs
    within the workload's tolerance; integer outputs must always be equal."""
    per: dict = {}
    for key in sorted(set(a) | set(b)):
        w = key.split("/")[0]
        rtol, atol = vp_workloads.TOLERANCE.get(w, (0.0, 0.0))
        exact = w not in nondeterministic
        r = per.setdefault(w, {"outputs": 0, "exact": 0, "max_abs_diff": 0.0, "ok": True,
                               "rtol": rtol, "atol": atol, "exact_required": exact, "problems": []})
        r["outputs"] += 1
        if key not in a or key not in b:
            r["ok"] = False
            r["problems"].append(f"{key}: only in {'first' if key in a else 'second'}")
            continue
        x, y = a[key], b[key]
        if x.shape != y.shape or x.dtype != y.dtype:
            r["ok"] = False
            r["problems"].append(f"{key}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
            continue
        if same_bits(x, y):
            r["exact"] += 1
            continue
        if not x.is_floating_point():
            r["ok"] = False
            diff = (x != y).nonzero()
            r["problems"].append(f"{key}: {diff.shape[0]} values differ (first at {diff[0].tolist()})")
            continue
        d = float((x.double() - y.double()).abs().nan_to_num(float("inf")).max())
        r["max_abs_diff"] = max(r["max_abs_diff"], d)
        if exact:
            r["ok"] = False
            close = torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
            r["problems"].append(f"{key}: not bit-exact though no op warned of nondeterminism "
                                 f"(max abs diff {d:.3g}, {'within' if close else 'beyond'} rtol {rtol} atol {atol})")
        elif not torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
            r["ok"] = False
            r["problems"].append(f"{key}: max abs diff {d:.3g} beyond rtol {rtol} atol {atol}")
    return per


def compare_files(pa: str, pb: str) -> int:
    nondet = set()
    for pt in (pa, pb):  # the run's report beside its outputs names the workloads that warned
        js = os.path.splitext(pt)[0] + ".json"
        if os.path.exists(js):
            with open(js) as f:
                nondet |= {w for w, ops in json.load(f).get("nondeterministic_ops", {}).items() if ops}
    per = compare(torch.load(pa), torch.load(pb), nondet)
    for line in comparison_lines(per):
        print(line)
    return 0 if all(r["ok"] for r in per.values()) else 1


def comparison_lines(per: dict) -> list[str]:
    lines = ["| workload | outputs | bit-exact | max abs diff | required | match |",
             "|---|---:|---:|---:|---|---|"]
    for w, r in per.items():
        need = "bit-exact" if r.get("exact_required", True) else f"rtol {r['rtol']}, atol {r['atol']}"
        lines.append(f"| {w} | {r['outputs']} | {r['exact']} | {r['max_abs_diff']:.3g} | "
                     f"{need} | {'yes' if r['ok'] else 'NO'} |")
        lines += [f"|  ↳ {p} | | | | | |" for p in r["problems"][:5]]
    return lines


# ---- the driver ----------------------------------------------------------------------------


def fmt_bytes(n) -> str:
    return "-" if n is None else f"{n / GIB:.2f} GiB"


def tables(reports: dict, per: dict | None) -> list[str]:
    names = list(reports)
    first = reports[names[0]]
    out = [f"PyTorch {first['torch']} (CUDA {first['cuda']}) on {first['device']}, "
           f"{first['threads']} threads{' (--quick)' if first['quick'] else ''}", ""]
    out += ["| workload | allocator | throughput | peak reserved (allocator) | "
            "device used peak (cudaMemGetInfo) | allocations | time in allocator |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for w in first["workloads"]:
        base = None
        for n in names:
            r = reports[n]["workloads"].get(w)
            if r is None:
                continue
            base = base or r["throughput"]
            a = r["allocator"]
            in_alloc = "n/a"
            if "alloc_ns" in a:
                ms = a["alloc_ns"] / 1e6
                in_alloc = f"{ms:.1f} ms ({ms / 1e3 / r['total_s'] * 100:.2f}% of {r['total_s']:.1f} s)"
            ratio = "" if r["throughput"] == base else f" ({r['throughput'] / base:.2f}x)"
            out.append(f"| {w} | {n} | {r['throughput']:.1f} {r['unit']}{ratio} | "
                       f"{fmt_bytes(r['peak_reserved'])} | {fmt_bytes(r['device_used_peak'])} | "
                       f"{a.get('allocs', '-')} | {in_alloc} |")
    out += ["", "Peak reserved is the allocator's own figure, cumulative over the workloads "
            "in this order (vrampool: peak_reserved_bytes from vrampool_stats_json; PyTorch: "
            "torch.cuda.max_memory_reserved). Device used peak is total - free from "
            "cudaMemGetInfo sampled every 10 ms during the workload (CUDA context, cuBLAS and "
            "cuDNN included; baseline after CUDA init: "
            + ", ".join(f"{n} {fmt_bytes(reports[n]['baseline_device_used'])}" for n in names)
            + "). Time in allocator: inside vrampool_malloc/vrampool_free as the C++ hooks "
            "time them; PyTorch's caching allocator has no such hook.", ""]
    if per is not None:
        out += ["Outputs, " + " vs ".join(names) + ":", ""] + comparison_lines(per) + [""]
    out += ["| check | allocator | result |", "|---|---|---|"]
    for n in names:
        c = reports[n].get("checks", {})
        for case in c.get("record_stream", {}).get("cases", []):
            where = "default stream" if case["threads"] == 1 else f"{case['threads']} threads, own streams"
            out.append(
                f"| record_stream: {case['case']}, {where} | {n} | "
                f"{'clean' if case['corrupted_elements'] == 0 else 'CORRUPTED'} "
                f"({case['corrupted_elements']} wrong, second pattern seen: {case['saw_second_pattern']}, "
                f"same address reused: {case['same_address_reused']}/{case['runs']}, "
                f"side busy at free: {case['side_busy_at_free']}/{case['runs']}"
                + (f", calls reaching the hook: {case['reached_pool']}" if "reached_pool" in case else "")
                + f"){'' if case['ok'] else ' FAIL'} |")
        e = c.get("empty_cache")
        if e:
            out.append(f"| empty_cache after freeing 1 GiB | {n} | reserved {fmt_bytes(e['reserved_before'])}"
                       f" -> {fmt_bytes(e['reserved_after'])}, reached pool: {e['reached_pool']}"
                       f"{'' if e['ok'] else ' FAIL'} |")
        o = c.get("out_of_memory")
        if o and "skipped" in o:
            out.append(f"| out of memory | {n} | {o['skipped']} |")
        elif o:
            for case in o["cases"]:
                text = f"raised {case['raised']}: {case.get('message', '')}"
                if "retry_after_free" in case:
                    text += f"; after freeing the first: {case['retry_after_free']}"
                out.append(f"| out of memory: {case['case']} | {n} | {text}{'' if case['ok'] else ' FAIL'} |")
            out.append(f"| usable after out of memory | {n} | {o['usable_after']} |")
        for k, v in reports[n].get("pytorch_stats_calls", {}).items():
            out.append(f"| {k}() | {n} | {v} |")
        if reports[n].get("refusals"):
            out.append(f"| refused vrampool calls | {n} | {reports[n]['refusals']} FAIL |")
        for w, ops in reports[n].get("nondeterministic_ops", {}).items():
            if ops:
                out.append(f"| nondeterministic ops in {w} | {n} | {'; '.join(ops)} |")
        if "oom_probe" in reports[n]:
            out.append(f"| 64 TiB request, public wrapper only | {n} | {reports[n]['oom_probe']} |")
    out += ["", "| allocation path | allocator | threads | window x size | ns per pair |",
            "|---|---|---:|---|---:|"]
    for n in names:
        tp = reports[n].get("tensor_pairs")
        if tp:
            out.append(f"| torch.empty(1 KiB) + free (Python) | {n} | 1 | 1 x 1 KiB | {tp['us_per_pair'] * 1e3:.0f} |")
        for row in reports[n].get("wrapper_cost", {}).get("rows", []):
            label = {
                "direct": "vrampool_malloc/free, direct",
                "mutex": "the same, one std::mutex held per call",
                "pluggable": "C++ CUDAPluggableAllocator malloc/raw_delete",
                "allocator": "PyTorch's current allocator (raw_alloc_with_stream/raw_delete)",
            }[row["path"]]
            out.append(f"| {label} | {n} | {row['threads']} | {row['window']} x {row['size'] // 1024} KiB | "
                       f"{row['ns_per_pair']:.1f} |")
    out += ["", "The CUDAPluggableAllocator path takes PyTorch's wrapper per call: its std::function, "
            "its mutex and its pointer -> (size, device, stream) map (a heap node per allocation), then "
            "the C++ hook and vrampool; its difference to 'direct' is the wrapper's cost, and 'mutex' - "
            "'direct' the share of its lock alone (one process-wide lock per malloc and per free, as the "
            "wrapper's allocator_mutex_). The current-allocator path adds a cudaGetDevice. ns per pair: "
            "each thread's own time per pair, averaged over the threads; each thread on its own stream."]
    return out


def driver(args) -> int:
    started = time.perf_counter()
    out = args.out or tempfile.mkdtemp(prefix="vrampool_torch_")
    os.makedirs(out, exist_ok=True)
    if "vrampool" in args.allocators and not args.lib:
        sys.exit("--lib path/to/libvrampool.so is needed for the vrampool run")
    for alloc in args.allocators:  # a child that dies must not leave an older run's files in use
        for ext in (".json", ".pt"):
            if os.path.exists(os.path.join(out, alloc + ext)):
                os.remove(os.path.join(out, alloc + ext))
    if args.hooks == "cpp":
        t0 = time.perf_counter()
        vp_alloc.build_hooks(args.build_dir, args.verbose)  # cached for the children
        print(f"C++ hooks built in {time.perf_counter() - t0:.1f} s ({args.build_dir})", flush=True)
    common = ["--out", out, "--hooks", args.hooks, "--build-dir", args.build_dir,
              "--threads", str(args.threads), "--seed", str(args.seed), "--only", ",".join(args.only)]
    if args.lib:
        common += ["--lib", os.path.abspath(args.lib)]
    if args.quick:
        common.append("--quick")
    rcs = {}
    for alloc in args.allocators:
        t0 = time.perf_counter()
        rc = subprocess.run([sys.executable, os.path.abspath(__file__), "--allocator", alloc] + common).returncode
        rcs[alloc] = rc
        print(f"[{alloc}] child exited {rc} after {time.perf_counter() - t0:.1f} s", flush=True)
    reports = {}
    for alloc in args.allocators:
        p = os.path.join(out, f"{alloc}.json")
        if os.path.exists(p):
            with open(p) as f:
                reports[alloc] = json.load(f)
    if "vrampool" in reports and not args.quick:
        try:
            probe = subprocess.run([sys.executable, os.path.abspath(__file__), "--oom-probe"] + common,
                                   capture_output=True, text=True, timeout=120)
            line = [ln for ln in probe.stdout.splitlines() if ln.startswith("OOM-PROBE ")]
            reports["vrampool"]["oom_probe"] = (line[0][len("OOM-PROBE "):] if line else
                                                f"exit {probe.returncode}: {probe.stderr.strip()[-300:]}")
        except subprocess.TimeoutExpired:
            reports["vrampool"]["oom_probe"] = "did not finish in 120 s"
    per = None
    if len(reports) == 2 and all(os.path.exists(os.path.join(out, f"{a}.pt")) for a in reports):
        a, b = list(reports)
        nondet = {w for r in reports.values() for w, ops in r.get("nondeterministic_ops", {}).items() if ops}
        per = compare(torch.load(os.path.join(out, f"{a}.pt")), torch.load(os.path.join(out, f"{b}.pt")), nondet)
    lines = tables(reports, per) if reports else ["no child produced a report"]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    ok = all(rc == 0 for rc in rcs.values()) and len(reports) == len(args.allocators)
    if per is not None:
        ok = ok and all(r["ok"] for r in per.values())
    print(f"\nRESULT: {'PASS' if ok else 'FAIL'} (children {rcs}; {time.perf_counter() - started:.0f} s "
          f"in all; files in {out})")
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", help="libvrampool.so (needed for the vrampool run)")
    p.add_argument("--allocator", choices=["pytorch", "vrampool"],
                   help="run this allocator in this process (a child); without it, the driver runs both")
    p.add_argument("--allocators", default="pytorch,vrampool", help="the driver's children, in order")
    p.add_argument("--hooks", choices=vp_alloc.HOOKS, default="cpp", help="how vrampool is wired in (vp_alloc.py)")
    p.add_argument("--quick", action="store_true", help="fewer batches, tokens and steps (the GPU test)")
    p.add_argument("--only", default=",".join(vp_workloads.WORKLOADS),
                   help="workloads, comma-separated; also " + ", ".join(vp_workloads.HELD_OUT))
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="folder for the outputs and figures (default: a new one under /tmp)")
    p.add_argument("--build-dir", default=vp_alloc.DEFAULT_BUILD_DIR, help="the C++ extension's build folder")
    p.add_argument("--compare", nargs=2, metavar=("A.pt", "B.pt"), help="compare two saved outputs and exit")
    p.add_argument("--oom-probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dry-run-cpu", action="store_true",
                   help="run the workloads twice on the CPU and compare (no GPU, no allocator)")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    args.only = [w for w in args.only.split(",") if w]
    unknown = [w for w in args.only if w not in vp_workloads.ALL]
    if unknown:
        p.error(f"unknown workloads {unknown}; known: {list(vp_workloads.ALL)}")
    args.allocators = [a for a in args.allocators.split(",") if a]
    if args.compare:
        return compare_files(*args.compare)
    if args.oom_probe:
        return oom_probe(args)
    if args.dry_run_cpu:
        return dry_run(args)
    if args.allocator:
        if not args.out:
            p.error("--allocator needs --out")
        os.makedirs(args.out, exist_ok=True)
        return child(args)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
