#!/usr/bin/env python3
"""PyTorch's own test/test_cuda.py, of the installed version, as an outside client of
vrampool: once under PyTorch's caching allocator and once with vrampool installed as the
current allocator before any CUDA use (in every pytest worker, by vp_pytest_plugin.py, as
PyTorch's test_cuda_expandable_segments.py changes a setting and then runs test_cuda.py),
with pytest-xdist and a deadline per test; pass / fail / skip counts side by side (from
each run's junit XML and the plugin's own record), and every test that fails only under
vrampool, with its message and a first guess at why.

    python3 examples/pytorch/run_test_cuda.py TESTS_DIR --lib target/release/libvrampool.so
        [--workers 8] [--timeout 90] [--budget 210] [-k EXPR] [--out DIR]

TESTS_DIR holds test_cuda.py (and whatever test-folder modules it imports) from PyTorch's
repository at the commit of the installed torch (torch.version.git_version), and pylib/
with the test suite's Python dependencies the wheel does not bring (expecttest, psutil),
if the machine lacks them. Make it, on a machine with a checkout or mirror of PyTorch:

    python3 examples/pytorch/run_test_cuda.py TESTS_DIR --prepare-from MIRROR_GIT_DIR [--ref REF]

Each allocator's run has two phases, as PyTorch's run_test.py: the tests not marked
serial on --workers xdist workers, then the serial ones (serialTest: they use most of the
GPU) on one worker. Each run stops at --budget seconds (SIGINT, so that pytest still
writes its XML); tests that ran under only one allocator are counted apart. Files: DIR/
{pytorch,vrampool}-{parallel,serial}.{xml,jsonl,log}, DIR/summary.md.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
TEST_FILE = "test_cuda.py"
VERSION_FILE = "torch_git_version"
# What test_cuda.py and torch.testing._internal import that a torch wheel does not install.
TEST_DEPENDENCIES = ("expecttest", "psutil")
RUNNER_DEPENDENCIES = ("pytest", "xdist")
BAD = ("failed", "error", "timeout", "crashed")
# Tests left out of both runs (--keep-poisoners runs them): each fails under PyTorch's own
# allocator too with 2.11 and the stored test file (a fork's, newer than 2.11), and leaves
# a capture or the generator's capture state behind, which fails every later test of its
# xdist worker; which tests those are depends on scheduling, so they hid the comparison
# (H200, 2026-12-02: PyTorch's own pass count moved by 27 between two runs).
POISONERS = {
    "TestCuda::test_graphsafe_set_get_rng_state": "Attempt to increase offset for a CUDA generator not in capture mode",
    "TestCuda::test_graph_rng_after_failed_capture": "Offset increment outside graph capture encountered unexpectedly",
    "TestCuda::test_graph_rng_concurrent_captures": "Attempt to increase offset for a CUDA generator not in capture mode",
}


# ---- preparing TESTS_DIR from a PyTorch checkout -------------------------------------------


def git(mirror: str, *args: str, binary: bool = False):
    out = subprocess.run(["git", f"--git-dir={mirror}", *args], check=True, capture_output=True)
    return out.stdout if binary else out.stdout.decode()


def imported_top_modules(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def prepare(dest: str, mirror: str, ref: str | None, pylib: bool) -> int:
    """Copy test/test_cuda.py at `ref` (default: the installed torch's commit) and every
    module of PyTorch's test folder it imports (transitively) into `dest`; install the
    test suite's dependencies into dest/pylib."""
    import importlib.util

    if ref is None:
        import torch

        ref = torch.version.git_version
    tree = set(git(mirror, "ls-tree", "-r", "--name-only", ref, "test/").split())
    if f"test/{TEST_FILE}" not in tree:
        sys.exit(f"{mirror} has no test/{TEST_FILE} at {ref}")
    os.makedirs(dest, exist_ok=True)
    wanted, copied, seen = [f"test/{TEST_FILE}"], [], set()
    while wanted:
        path = wanted.pop()
        if path in seen:
            continue
        seen.add(path)
        data = git(mirror, "show", f"{ref}:{path}", binary=True)
        target = os.path.join(dest, os.path.relpath(path, "test"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(data)
        copied.append(path)
        if not path.endswith(".py"):
            continue
        for name in sorted(imported_top_modules(data.decode())):
            if importlib.util.find_spec(name) is not None and f"test/{name}.py" not in tree:
                continue  # installed (torch.testing._internal is in the wheel)
            if f"test/{name}.py" in tree:
                wanted.append(f"test/{name}.py")
            else:
                wanted += [p for p in tree if p.startswith(f"test/{name}/")]
    with open(os.path.join(dest, VERSION_FILE), "w") as f:
        f.write(ref + "\n")
    with open(os.path.join(dest, "SOURCE"), "w") as f:
        f.write(f"PyTorch's repository ({mirror}) at {ref}: {', '.join(copied)}\n")
    print(f"copied {len(copied)} file(s) from {ref} into {dest}: {', '.join(copied)}")
    if pylib:
        target = os.path.join(dest, "pylib")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                        target, *TEST_DEPENDENCIES], check=True)
        print(f"installed {', '.join(TEST_DEPENDENCIES)} into {target}")
    return 0


# ---- running -------------------------------------------------------------------------------


def missing_modules(names, pythonpath: str | None) -> list[str]:
    code = ("import importlib.util, sys; "
            "print(' '.join(n for n in sys.argv[1:] if importlib.util.find_spec(n) is None))")
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, "-c", code, *names], env=env, capture_output=True, text=True)
    return out.stdout.split()


def run_phase(args, alloc: str, phase: str, env: dict, budget: float) -> dict:
    """One pytest run (with xdist) for one allocator and phase, stopped at `budget` s."""
    stem = os.path.join(args.out, f"{alloc}-{phase}")
    for suffix in (".xml", ".jsonl", ".log"):
        if os.path.exists(stem + suffix):
            os.remove(stem + suffix)
    shutil.rmtree(stem + "-timeouts", ignore_errors=True)
    env = dict(env, VP_PYTEST_RESULTS=stem + ".jsonl", VP_PYTEST_TIMEOUTS=stem + "-timeouts")
    marker = "not serial" if phase == "parallel" else "serial"
    workers = args.workers if phase == "parallel" else 1
    cmd = [sys.executable, "-m", "pytest", os.path.join(args.tests, TEST_FILE),
           "-c", args.ini, "--rootdir", args.tests, "-p", "vp_pytest_plugin", "-p", "no:cacheprovider",
           "-n", str(workers), "--dist", "load", "--max-worker-restart", "100000",
           "-m", marker, "--junitxml", stem + ".xml", "-q", "-rN", "--tb=short"]
    if args.k:
        cmd += ["-k", args.k]
    if not args.keep_poisoners:
        cmd += [f"--deselect={os.path.join(args.tests, TEST_FILE)}::{t}" for t in POISONERS]
    t0 = time.perf_counter()
    with open(stem + ".log", "w") as log:
        log.write(" ".join(cmd) + "\n\n")
        log.flush()
        p = subprocess.Popen(cmd, cwd=args.tests, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        stopped = False
        try:
            p.wait(timeout=max(1.0, budget))
        except subprocess.TimeoutExpired:
            stopped = True
            os.killpg(p.pid, signal.SIGINT)  # pytest ends the session and writes its XML
            try:
                p.wait(timeout=45)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    elapsed = time.perf_counter() - t0
    print(f"[{alloc}] {phase}: pytest exited {p.returncode} after {elapsed:.0f} s"
          f"{' (stopped at its budget)' if stopped else ''}; log {stem}.log", flush=True)
    return {"rc": p.returncode, "elapsed_s": elapsed, "stopped_at_budget": stopped, "stem": stem}


def read_results(stem: str) -> dict:
    """nodeid -> {"outcome", "message", "duration"} from the plugin's record of one run:
    a crashed worker's test is "crashed", a failed setup or teardown "error", else the
    call's outcome (or the setup's skip); then the deadline files turn a crash into a
    "timeout" where faulthandler ended the worker."""
    reports: dict = {}
    order: dict = {}  # nodeid -> its first record's place in the file (a worker's order)
    if os.path.exists(stem + ".jsonl"):
        with open(stem + ".jsonl") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a kill
                reports.setdefault(r["nodeid"], []).append(r)
                order.setdefault(r["nodeid"], len(order))
    tests = {}
    for nodeid, rs in reports.items():
        crashed = [r for r in rs if r["outcome"] == "failed" and "crashed while running" in r["message"]]
        errors = [r for r in rs if r["outcome"] == "failed" and r["when"] in ("setup", "teardown")]
        calls = [r for r in rs if r["when"] == "call"]
        skips = [r for r in rs if r["outcome"] == "skipped"]
        if crashed:
            outcome, r = "crashed", crashed[0]
        elif errors:
            outcome, r = "error", errors[0]
        elif calls:
            outcome, r = calls[0]["outcome"], calls[0]
        elif skips:
            outcome, r = "skipped", skips[0]
        else:
            outcome, r = rs[0]["outcome"], rs[0]
        tests[nodeid] = {"outcome": outcome, "message": r["message"],
                         "duration": round(sum(x["duration"] for x in rs), 3),
                         "worker": f"{os.path.basename(stem)}:{rs[0].get('worker', '?')}",
                         "order": order[nodeid]}
    folder = stem + "-timeouts"
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            with open(os.path.join(folder, name), errors="replace") as f:
                lines = f.read().splitlines()
            if len(lines) > 1 and lines[0]:
                stack = [ln.strip() for ln in lines[1:] if ln.strip().startswith("File ")]
                t = tests.setdefault(lines[0], {"outcome": "timeout", "message": "", "duration": 0.0})
                t["outcome"] = "timeout"
                t["message"] = "past the deadline; innermost frames: " + " < ".join(stack[:3])
    return tests


def junit_counts(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    keys = ("tests", "failures", "errors", "skipped")
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in keys}


LIMITS = [
    (re.compile(r"(CUDAPluggableAllocator|pluggable) does not (yet )?support (\w+)"),
     lambda m: f"pluggable-allocator limit: no {m.group(3)}"),
    (re.compile(r"Can't swap an already initialized allocator"),
     lambda m: "pluggable-allocator limit: the allocator cannot change once CUDA is used"),
    (re.compile(r"Trying to free a pointer not allocated here"),
     lambda m: "pluggable-allocator limit: a pointer its map does not hold"),
    (re.compile(r"CUDA graph capture: CUDAPluggableAllocator"),
     lambda m: "pluggable-allocator limit: no graph pools for vrampool"),
    (re.compile(r"vrampool"), lambda m: "vrampool refused a call: investigate"),
]


# Errors after which every later test of the same pytest worker fails: a sticky CUDA error
# (the context is lost) or a capture left open (every later launch is refused).
POISON = re.compile(r"illegal memory access|operation not permitted when stream is capturing|"
                    r"Offset increment outside graph capture|operation failed due to a previous error during capture")


def poisoned_by(results: dict) -> dict:
    """nodeid -> the first test of the same worker that failed with a poisoning error, for
    each test that ran after it (the culprit may be a test before that one: a capture left
    open shows only in the next test's failure)."""
    by_worker: dict = {}
    for nodeid, t in results.items():
        by_worker.setdefault(t.get("worker"), []).append((t.get("order", 0), nodeid))
    out = {}
    for tests in by_worker.values():
        first = None
        for _, nodeid in sorted(tests):
            if first is not None:
                out[nodeid] = first
            elif results[nodeid]["outcome"] in BAD and POISON.search(results[nodeid]["message"]):
                first = nodeid
    return out


def guess(message: str) -> str:
    for pattern, why in LIMITS:
        m = pattern.search(message)
        if m:
            return why(m)
    return "investigate"


def summarize(args, runs: dict, results: dict) -> tuple[list[str], dict]:
    names = list(results)
    import torch

    out = [f"PyTorch {torch.__version__} ({torch.version.git_version[:12]}), {TEST_FILE} from "
           f"{args.test_version or 'an unknown commit'}; {args.workers} workers, {args.timeout:.0f} s a test, "
           f"{args.budget:.0f} s a run{', -k ' + args.k if args.k else ''}"
           + ("" if args.keep_poisoners else f"; left out of both runs: {', '.join(POISONERS)} (see POISONERS)"), ""]
    kinds = ("passed", "failed", "error", "crashed", "timeout", "skipped", "xfailed", "xpassed")
    out += ["| outcome | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    counts = {n: {k: sum(1 for t in results[n].values() if t["outcome"] == k) for k in kinds} for n in names}
    for k in kinds:
        out.append(f"| {k} | " + " | ".join(str(counts[n][k]) for n in names) + " |")
    out.append("| total | " + " | ".join(str(len(results[n])) for n in names) + " |")
    for phase in ("parallel", "serial"):
        cells = []
        for n in names:
            r = runs[n].get(phase)
            j = junit_counts(r["stem"] + ".xml") if r else None
            cells.append("-" if r is None else
                         f"{r['elapsed_s']:.0f} s{' (budget)' if r['stopped_at_budget'] else ''}"
                         + (f"; junit {j['tests']} tests, {j['failures']} failures, {j['errors']} errors, "
                            f"{j['skipped']} skipped" if j else "; no junit XML"))
        out.append(f"| {phase} phase | " + " | ".join(cells) + " |")
    report = {"counts": counts, "runs": runs}
    if len(names) == 2:
        a, b = names
        both = set(results[a]) & set(results[b])
        only = {n: sorted(set(results[n]) - both) for n in names}
        out += ["", f"Ran under both: {len(both)} tests; only under {a}: {len(only[a])}, only under {b}: "
                f"{len(only[b])} (a run stopped at its budget, or a crash)."]
        fails_b = sorted(t for t in both if results[b][t]["outcome"] in BAD and results[a][t]["outcome"] == "passed")
        skipped_a = sorted(t for t in both if results[b][t]["outcome"] in BAD and results[a][t]["outcome"] == "skipped")
        fails_a = sorted(t for t in both if results[a][t]["outcome"] in BAD and results[b][t]["outcome"] == "passed")
        report.update(fails_only_under=fails_b, fails_skipped_under_other=skipped_a, passes_only_under=fails_a)
        out += ["", f"Fail only under {b} (passed under {a}): {len(fails_b)}", ""]
        if fails_b:
            poisoned = poisoned_by(results[b])
            why = {t: (f"ran in a poisoned worker (first seen in {poisoned[t].split('::', 1)[-1]})" if t in poisoned
                       else guess(results[b][t]["message"])) for t in fails_b}
            kinds = {}
            for w in why.values():
                k = "ran in a poisoned worker" if w.startswith("ran in a poisoned") else w
                kinds[k] = kinds.get(k, 0) + 1
            out += ["By reason: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])), ""]
            out += [f"| test | {b} | first guess | message |", "|---|---|---|---|"]
            for t in fails_b:
                r = results[b][t]
                msg = r["message"].replace("|", "/")[:400]
                out.append(f"| {t.split('::', 1)[-1]} | {r['outcome']} | {why[t]} | {msg} |")
            report.update(poisoned=poisoned)
        if skipped_a:
            out += ["", f"Fail under {b}, skipped under {a}: " + ", ".join(t.split("::", 1)[-1] for t in skipped_a)]
        out += ["", f"Fail only under {a} (passed under {b}): {len(fails_a)}"
                + (": " + ", ".join(t.split("::", 1)[-1] for t in fails_a) if fails_a else "")]
    return out, report


def run(args) -> int:
    args.tests = os.path.abspath(args.tests)
    if not os.path.exists(os.path.join(args.tests, TEST_FILE)):
        sys.exit(f"no {TEST_FILE} in {args.tests}: make the folder with --prepare-from (see --help)")
    args.out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="vrampool_test_cuda_"))
    os.makedirs(args.out, exist_ok=True)
    import torch

    version_file = os.path.join(args.tests, VERSION_FILE)
    args.test_version = open(version_file).read().strip() if os.path.exists(version_file) else None
    if args.test_version and args.test_version != torch.version.git_version:
        print(f"warning: {TEST_FILE} is from {args.test_version}, the installed torch from "
              f"{torch.version.git_version}", flush=True)
    pylib = os.path.join(args.tests, "pylib")
    pythonpath = os.pathsep.join([HERE] + ([pylib] if os.path.isdir(pylib) else [])
                                 + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    lacking = missing_modules(TEST_DEPENDENCIES + RUNNER_DEPENDENCIES, pythonpath)
    if lacking:
        sys.exit(f"missing Python modules {lacking}: install them, or put them in {pylib} "
                 f"(pip install --target {pylib} {' '.join(lacking)})")
    if "vrampool" in args.allocators:
        if not args.lib:
            sys.exit("--lib path/to/libvrampool.so is needed for the vrampool run")
        args.lib = os.path.abspath(args.lib)
        if args.hooks == "cpp":
            sys.path.insert(0, HERE)
            import vp_alloc

            t0 = time.perf_counter()
            vp_alloc.build_hooks(args.build_dir)  # once, before the workers load it
            print(f"C++ hooks built in {time.perf_counter() - t0:.1f} s ({args.build_dir})", flush=True)
    args.ini = os.path.join(args.out, "pytest.ini")
    with open(args.ini, "w") as f:  # nothing of the folders above TESTS_DIR configures pytest
        f.write("[pytest]\n")
    # Only the CUDA variants of device-generic tests; failures without PyTorch's repro hint.
    base = dict(os.environ, PYTHONPATH=pythonpath, PYTORCH_TESTING_DEVICE_ONLY_FOR="cuda",
                PYTORCH_PRINT_REPRO_ON_FAILURE="0", VP_PYTEST_TIMEOUT=str(args.timeout))
    base.pop("CI", None)  # PyTorch's tests change what they do under CI
    runs, results = {}, {}
    for alloc in args.allocators:
        env = dict(base, VP_PYTEST_ALLOCATOR=alloc)
        if alloc == "vrampool":
            env.update(VP_PYTEST_LIB=args.lib, VP_PYTEST_HOOKS=args.hooks, VP_PYTEST_BUILD_DIR=args.build_dir)
            env.setdefault("VRAMPOOL_DEVICE", "cuda")
        t0 = time.perf_counter()
        runs[alloc] = {"parallel": run_phase(args, alloc, "parallel", env, args.budget - args.serial_budget)}
        left = args.budget - (time.perf_counter() - t0)
        runs[alloc]["serial"] = run_phase(args, alloc, "serial", env, max(args.serial_budget, left))
        results[alloc] = {}
        for phase in ("parallel", "serial"):
            results[alloc].update(read_results(runs[alloc][phase]["stem"]))
    lines, report = summarize(args, runs, results)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"report": report, "results": results}, f, indent=1)
    print("\n".join(lines))
    print(f"\nfiles in {args.out}")
    return 0 if all(results.values()) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tests", metavar="TESTS_DIR", help=f"the folder with PyTorch's {TEST_FILE}")
    p.add_argument("--lib", help="libvrampool.so (needed for the vrampool run)")
    p.add_argument("--allocators", default="pytorch,vrampool", help="the runs, in order")
    p.add_argument("--hooks", default="cpp", choices=("cpp", "ctypes", "none"),
                   help="how vrampool is wired in (run.py's --hooks)")
    p.add_argument("--build-dir", default=os.path.join(tempfile.gettempdir(), "vrampool_torch_ext"),
                   help="the C++ extension's build folder")
    p.add_argument("--workers", type=int, default=8, help="xdist workers for the tests not marked serial")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds a test may take before its worker is ended")
    p.add_argument("--budget", type=float, default=210.0, help="seconds for each allocator's run (both phases)")
    p.add_argument("--serial-budget", type=float, default=40.0, help="seconds of --budget kept for the serial tests")
    p.add_argument("-k", help="pytest's -k expression: a subset")
    p.add_argument("--keep-poisoners", action="store_true",
                   help="also run the tests of POISONERS (left out of both runs by default)")
    p.add_argument("--out", help="folder for the results (default: a new one under /tmp)")
    p.add_argument("--prepare-from", metavar="MIRROR_GIT_DIR",
                   help=f"make TESTS_DIR: copy test/{TEST_FILE} and what it imports from this git dir")
    p.add_argument("--ref", help="with --prepare-from: the commit (default: torch.version.git_version)")
    p.add_argument("--no-pylib", action="store_true",
                   help=f"with --prepare-from: do not pip-install {', '.join(TEST_DEPENDENCIES)} into TESTS_DIR/pylib")
    args = p.parse_args()
    args.allocators = [a for a in args.allocators.split(",") if a]
    if args.prepare_from:
        return prepare(args.tests, args.prepare_from, args.ref, not args.no_pylib)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
