"""Timing that holds up on a busy machine.

Every implementation of a row (and the copy that serves as its ceiling) is
timed interleaved, in rounds: each round runs one block of calls of each, in
an order shuffled from round to round, so load that comes and goes hits all
alike, and what ran just before (cache, where an output lands) varies. A figure is the median over the rounds; ratios (time vs torch,
fraction of the copy) are medians of the per-round ratios, so drift between
rounds cancels. A figure is marked when its rounds disagree (interquartile
range / median above ``max_spread``) or when its row's copy ran far below the
best copy this run measured at that dtype and size.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import statistics
import sys
import time
import timeit
from typing import Any, Callable, Hashable, TypeVar

import torch
from torch.utils import benchmark

MAX_SPREAD = 0.25
COPY_LOW = 0.5
NOISY, COPY_LOW_MARK = "noisy", "copy low"
# A call at least a block long (a real model's training step) is a block of one call, which one
# burst of another process's load decides: such a sample is the best of this many calls, after an
# untimed one (as many calls as torch's Timer runs for a block of one: two to warm up, one timed).
LONG_CALL_BEST_OF = 2
K = TypeVar("K", bound=Hashable)


class Sampler:
    """Times one callable: warmed up (and compiled) once, calibrated once,
    then one block of calls about ``block_s`` long per sample.

    CPU: torch.utils.benchmark's Timer with the threads torch uses (Timer's
    own default is 1 thread); a call as long as a block, the best of
    LONG_CALL_BEST_OF calls after an untimed one (timed in this thread, so with
    torch's threads too). CUDA: triton.testing.do_bench, which flushes L2
    before each call, or CUDA events after an L2 flush without triton.
    """

    def __init__(self, key: Hashable, fn: Callable[[], object], device: str, block_s: float) -> None:
        self.key, self.fn, self.device, self.block_s = key, fn, device, block_s
        # fn.context (optional): a context manager entered around each block,
        # not timed (relu_ext.install(), which the other callables must not see).
        self.context = getattr(fn, "context", contextlib.nullcontext)
        with self.context():
            self._calibrate()

    def _calibrate(self) -> None:
        fn, device, block_s = self.fn, self.device, self.block_s
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
            return
        first = time.perf_counter() - start
        self.timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
        # A first call as long as a block means one call per block (a 64M-element
        # call can take a second); else calibrate on a warm call.
        one = first if first >= block_s else self.timer.timeit(1).median
        self.number = max(1, int(block_s / max(one, 1e-9)))

    def sample(self) -> float:
        """Seconds per call, over one block."""
        with self.context():
            return self._sample()

    def _sample(self) -> float:
        if self.device != "cuda":
            if self.number == 1:
                return min(timeit.Timer(self.fn).repeat(1 + LONG_CALL_BEST_OF, number=1)[1:])
            return self.timer.timeit(self.number).median
        try:
            from triton.testing import do_bench
        except ImportError:
            return self._sample_events()
        ms = do_bench(self.fn, warmup=0, rep=max(1.0, self.block_s * 1e3), quantiles=[0.5])
        return (ms[0] if isinstance(ms, (list, tuple)) else ms) / 1e3

    def _sample_events(self) -> float:
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
        times, start_s = [], time.perf_counter()
        while not times or time.perf_counter() - start_s < self.block_s:
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)


def interleave(fns: dict[K, Callable[[], object]], device: str, rounds: int, budget_s: float,
               step: Callable[[K], None] = lambda key: None) -> dict[K, list[float]]:
    """Seconds per call of each callable in each of `rounds` rounds; each
    callable gets about `budget_s` in all. `step(key)` after every sample."""
    samplers = {k: Sampler(k, fn, device, budget_s / rounds) for k, fn in fns.items()}
    keys = list(fns)
    out: dict[K, list[float]] = {k: [] for k in keys}
    for r in range(rounds):
        # A new order each round (seeded: runs repeat): what ran just before a
        # callable, and so where its output lands in memory and what is in
        # cache, changes from round to round instead of biasing one figure.
        order = keys if r == 0 else random.Random(r).sample(keys, len(keys))
        for k in order:
            out[k].append(samplers[k].sample())
            step(k)
    return out


def summarize(samples: list[float], max_spread: float = MAX_SPREAD) -> dict[str, Any]:
    """Median over the rounds, quartiles, spread (IQR / median) and the marks."""
    med = statistics.median(samples)
    q25, _, q75 = statistics.quantiles(samples, n=4, method="inclusive") if len(samples) > 1 else samples * 3
    spread = (q75 - q25) / med if med > 0 else float("inf")
    return {"median_s": med, "q25_s": q25, "q75_s": q75, "spread": spread, "rounds_s": list(samples),
            "marks": [NOISY] if spread > max_spread else []}


def paired(num: list[float], den: list[float]) -> float:
    """Median of the per-round ratios num / den."""
    return statistics.median(a / b for a, b in zip(num, den))


def make_row(meta: dict[str, Any], copy_s: list[float], results: dict[str, tuple[list[float], int]],
             max_spread: float = MAX_SPREAD) -> dict[str, Any]:
    """One table row: for each implementation (rounds, bytes it moves) its
    time, GB/s, fraction of the copy's GB/s and time vs torch, both paired by
    round, and its time vs the copy's (vs_copy). meta needs copy_bytes."""
    copy = summarize(copy_s, max_spread)
    row = dict(meta, copy=copy, copy_gbs=meta["copy_bytes"] / copy["median_s"] / 1e9, marks=[], results={})
    torch_s = results["torch"][0] if "torch" in results else None
    for impl, (samples, nbytes) in results.items():
        s = summarize(samples, max_spread)
        of_copy = nbytes / meta["copy_bytes"] * paired(copy_s, samples)
        row["results"][impl] = dict(s, bytes=nbytes, gbs=nbytes / s["median_s"] / 1e9, of_copy=of_copy,
                                    vs_torch=paired(samples, torch_s) if torch_s else None,
                                    vs_copy=paired(samples, copy_s))
    return row


def mark_copy_low(rows: list[dict[str, Any]], copy_low: float = COPY_LOW) -> None:
    """Marks each row whose copy GB/s is below `copy_low` times the best copy
    round this run measured at the same device, dtype and size (any section):
    the machine was busier then than it can be."""
    best: dict[tuple, float] = {}
    for r in rows:
        key = (r["device"], r["dtype"], r["numel"])
        best[key] = max(best.get(key, 0.0), r["copy_bytes"] / min(r["copy"]["rounds_s"]) / 1e9)
    for r in rows:
        if r["copy_gbs"] < copy_low * best[(r["device"], r["dtype"], r["numel"])] and COPY_LOW_MARK not in r["marks"]:
            r["marks"].append(COPY_LOW_MARK)


def trust_summary(rows: list[dict[str, Any]], models: list[dict[str, Any]]) -> dict[str, int]:
    """How many figures (one per implementation and row) carry a mark."""
    figures = [(r["marks"], c["marks"]) for r in rows for c in r["results"].values()]
    figures += [([], m["marks"]) for r in models for m in r["results"].values()]
    return {"figures": len(figures), "marked": sum(bool(a or b) for a, b in figures),
            "noisy": sum(NOISY in b for _, b in figures), "copy_low_rows": sum(COPY_LOW_MARK in r["marks"] for r in rows)}


def steady_malloc() -> str:
    """Makes glibc's malloc reuse freed memory for every size, as a caching
    allocator (jemalloc, tcmalloc; on GPU, PyTorch's CUDA caching allocator)
    does: no mmap (M_MMAP_MAX 0), heap top trimmed only above 2 GiB (M_TRIM_THRESHOLD, an int).

    By default glibc hands blocks of 32 MiB and more back to the system at
    every free, and adapts its thresholds for smaller ones to the recent
    pattern. Interleaving many implementations keeps resetting that, and then
    a call pays page faults on its fresh output or not depending on what ran
    before it (fwd+bwd of 1M float32 elements measured 3-4x slower than in a
    loop of its own, and a 64 MiB output sometimes fit in the heap's free top
    and sometimes not). With every block reused, the figures are the kernels'
    and alike for every implementation. `--malloc as-is` keeps glibc's
    defaults (allocating ops of 16M+ float32 elements then run at the speed
    of page faults, for torch and relu_ext alike). Not perfect: PyTorch asks
    for 64-byte-aligned blocks, which a freed block of the same size does not
    always fit, so the heap can grow (and fault) for a few calls before it
    settles. Returns what was done."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        used, glibc = (ctypes.cast(lib.malloc, ctypes.c_void_p).value for lib in (ctypes.CDLL(None), libc))
        if used != glibc:  # LD_PRELOAD-ed jemalloc, tcmalloc, ASan: mallopt would do nothing
            return "as is (malloc is not glibc's: interposed)"
        if libc.mallopt(-4, 0) == 1 and libc.mallopt(-1, 2**31 - 1) == 1:  # M_MMAP_MAX, M_TRIM_THRESHOLD
            return "steady: glibc mallopt M_MMAP_MAX 0, M_TRIM_THRESHOLD 2 GiB (freed memory reused)"
    except (OSError, AttributeError):
        pass
    return "as is (not glibc)"


def load_average() -> dict[str, Any]:
    """1-minute load average against the CPUs this process may use."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        load1 = os.getloadavg()[0]
    except OSError:
        return {"load1": None, "cpus": cpus, "busy": False}
    # Half the CPUs already busy: the benchmark's threads would share cores.
    return {"load1": load1, "cpus": cpus, "busy": load1 >= 0.5 * cpus}


def load_warning(load: dict[str, Any]) -> str | None:
    """The warning to print before a run on a busy machine, or None."""
    if not load["busy"]:
        return None
    return (f"warning: load average {load['load1']:.2f} on {load['cpus']} CPUs before the run: the machine is busy; "
            f"figures will be noisy (rows whose rounds disagree are marked), a quieter moment gives better ones")


class Progress:
    """Progress on stderr: a one-line bar on a terminal, else a plain line every
    ``interval`` seconds (so a log shows the run is alive); ``mode`` "off" is silent."""

    def __init__(self, total: int, mode: str, interval: float = 15.0) -> None:
        self.total, self.done, self.mode, self.interval = total, 0, mode, interval
        self.t0 = self.last = time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        now = time.perf_counter()
        if self.mode == "bar":
            width = 30
            filled = width * self.done // max(1, self.total)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                             f"{now - self.t0:5.0f}s {label[:50]:50}")
            if self.done >= self.total:
                sys.stderr.write("\n")
        elif self.mode == "lines" and (now - self.last >= self.interval or self.done >= self.total):
            self.last = now
            sys.stderr.write(f"progress: {self.done}/{self.total}, {now - self.t0:.0f} s, {label}\n")
        sys.stderr.flush()
