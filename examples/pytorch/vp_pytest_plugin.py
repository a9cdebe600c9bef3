"""A pytest plugin for running PyTorch's own test files under vrampool (run_test_cuda.py
loads it with ``-p vp_pytest_plugin`` in every pytest process; configured by environment
variables, so that xdist's workers, which pytest starts itself, get it too).

In each xdist worker, before any test module is imported (``pytest_configure``, which runs
before collection: test_cuda.py initialises CUDA at import), it makes vrampool PyTorch's
CUDA allocator when ``VP_PYTEST_ALLOCATOR=vrampool`` (``VP_PYTEST_LIB``: libvrampool.so,
``VP_PYTEST_HOOKS``, ``VP_PYTEST_BUILD_DIR``: as run.py's ``--hooks`` and ``--build-dir``),
as PyTorch's test_cuda_expandable_segments.py changes a setting before it runs test_cuda.py.

Each test runs under a deadline (``VP_PYTEST_TIMEOUT`` seconds): past it, faulthandler
writes every thread's stack to a file of this worker's under ``VP_PYTEST_TIMEOUTS`` and
ends the process, which xdist reports as a crash of that test and replaces; the file names
the test, so the runner tells a timeout from a crash. A hung CUDA call cannot be
interrupted any other way.

The controller (the process without ``workerinput``) writes one JSON line per test phase
report to ``VP_PYTEST_RESULTS`` as it arrives, crashed workers' tests included, so that a
run stopped at its time budget still has every result so far.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

# The controller's results file (None in workers and without VP_PYTEST_RESULTS).
_results = None


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config):
    config.addinivalue_line("markers", "serial: PyTorch's serialTest: run alone (run_test_cuda.py's second phase)")
    if _is_worker(config):
        _install(config)
        timeouts = os.environ.get("VP_PYTEST_TIMEOUTS")
        if timeouts:
            os.makedirs(timeouts, exist_ok=True)
            path = os.path.join(timeouts, f"{config.workerinput['workerid']}-{os.getpid()}.txt")
            config._vp_deadline_file = open(path, "w+")  # noqa: SIM115 - lives as long as the worker
    elif os.environ.get("VP_PYTEST_RESULTS"):
        global _results
        _results = open(os.environ["VP_PYTEST_RESULTS"], "a", buffering=1)  # noqa: SIM115 - closed at unconfigure


def _install(config):
    """Make vrampool the CUDA allocator of this worker, before anything uses CUDA."""
    if os.environ.get("VP_PYTEST_ALLOCATOR", "pytorch") != "vrampool":
        return
    sys.path.insert(0, HERE)
    import torch
    import vp_alloc

    if torch.cuda.is_initialized():
        raise pytest.UsageError("CUDA was initialised before vp_pytest_plugin could install vrampool")
    backend = vp_alloc.install_vrampool(
        os.environ["VP_PYTEST_LIB"],
        os.environ.get("VP_PYTEST_HOOKS", "cpp"),
        os.environ.get("VP_PYTEST_BUILD_DIR", vp_alloc.DEFAULT_BUILD_DIR),
    )
    config._vp_backend = backend


def pytest_report_header(config):
    return f"allocator: {os.environ.get('VP_PYTEST_ALLOCATOR', 'pytorch')} (vp_pytest_plugin)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    f = getattr(item.config, "_vp_deadline_file", None)
    timeout = float(os.environ.get("VP_PYTEST_TIMEOUT", "0") or 0)
    if f is None or timeout <= 0:
        yield
        return
    f.seek(0)
    f.truncate()
    f.write(item.nodeid + "\n")
    f.flush()
    faulthandler.dump_traceback_later(timeout, exit=True, file=f)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        f.seek(0)
        f.truncate()
        f.flush()


def _message(report) -> str:
    if report.passed:
        return ""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    text = getattr(report, "longreprtext", "") or str(report.longrepr or "")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # The exception's own line(s) say most: pytest's "E   ..." lines, else the last ones.
    errors = [ln[1:].strip() for ln in lines if ln.startswith("E ")]
    return " | ".join(errors[:4] if errors else lines[-3:])[:600]


def _worker_of(report) -> str | None:
    try:
        return report.node.gateway.id  # xdist's controller side: the worker that ran it
    except AttributeError:
        return None


def pytest_runtest_logreport(report):
    if _results is None:
        return
    outcome = report.outcome
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    _results.write(json.dumps({
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": outcome,
        "duration": round(getattr(report, "duration", 0.0), 3),
        "message": _message(report),
        "worker": _worker_of(report),
    }) + "\n")


def pytest_unconfigure(config):
    global _results
    if _results is not None:
        _results.close()
        _results = None
    f = getattr(config, "_vp_deadline_file", None)
    if f is not None:
        f.close()
