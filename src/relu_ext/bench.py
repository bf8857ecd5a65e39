"""relu_ext benchmark: every peer timed in the same run, against a copy's bandwidth.

    python -m relu_ext.bench [--device cpu|cuda] [--dtypes float32,bfloat16]
                             [--sizes 4096,...] [--what kernels,small,memory,models]
                             [--impls torch,torch_out,compile,triton,seed,relu_ext]
                             [--out DIR] [--name NAME] [--repeat N] [--quick]

Sections (--what):
  kernels  per dtype and size: fwd (no grad), fwd (train: what a training
           forward writes), bwd (from what the forward saved), fwd+bwd
           (autograd.grad) and in-place, for every implementation, plus a
           copy_ into a preallocated buffer: the bandwidth ceiling.
  small    per call at 1K-64K elements, the fixed cost of a call: no-grad
           forward and fwd+bwd (autograd.grad), of the function
           (torch.relu / relu_ext.relu) and of the module (nn.ReLU /
           relu_ext.ReLU); implementations interleaved in 10 short rounds (the
           budget split among them); the median round, with the rounds' spread.
  memory   bytes saved for backward per element, and the peak memory of one
           training step of three small models, each in a fresh process.
  models   time of one training step (forward, loss, backward, SGD) of the
           same models with each activation.

Implementations (--impls): torch (torch.relu / nn.ReLU), torch_out (torch.clamp
with out=, forward only), compile (torch.compile of F.relu), triton (a Triton
ReLU, CUDA only), seed (the tutorial autograd.Function: clamp, then
grad[x < 0] = 0), relu_ext.

Timing: median of repeated calls after warm-up with its 10-90% spread
(torch.utils.benchmark's Timer, blocks of calls, on CPU; triton.testing.do_bench, or
CUDA events after an L2 flush, on GPU). GB/s counts the bytes each implementation must move at least (the
relu_ext mask: 1 bit per element); "of copy" divides by the copy's GB/s from
the same run; "vs torch" is time / torch's time for the same row (<1: faster).

Writes NAME.json (every figure and the environment) and NAME.png (GB/s vs size
per implementation, the copy as the ceiling) into --out.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import functools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils import benchmark

import relu_ext

ops = torch.ops.relu_ext
IMPLS = ["torch", "torch_out", "compile", "triton", "seed", "relu_ext"]
CASES = ["fwd", "fwd (train)", "bwd", "fwd+bwd", "in-place"]
SMALL_CASES = ["fwd", "fwd+bwd", "module fwd", "module fwd+bwd"]
SMALL_ROUNDS = 10
MODELS = ["mlp", "mlp_dropout", "cnn_maxpool"]
SECTIONS = ["kernels", "small", "memory", "models"]
SMALL_SIZES = [2**k for k in range(10, 17)]
DEFAULT_SIZES = {"cpu": [4**k for k in range(6, 14)], "cuda": [4**k for k in range(8, 15)]}


# --- peers -------------------------------------------------------------------


class SeedReLU(torch.autograd.Function):
    """The tutorial ReLU: saves its input and masks the gradient by indexing."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return seed_grad(grad, x)


def seed_grad(grad: Tensor, x: Tensor) -> Tensor:
    grad = grad.clone()
    grad[x < 0] = 0
    return grad


class SeedReLUModule(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return SeedReLU.apply(x)


@functools.lru_cache(maxsize=None)
def _compiled_relu() -> Callable[[Tensor], Tensor]:
    return torch.compile(F.relu)


@functools.lru_cache(maxsize=None)
def triton_relu() -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor, Tensor], Tensor], type] | None:
    """(forward, backward(grad, y), autograd.Function) of a plain Triton ReLU,
    or None without triton. Contiguous tensors only. Runs on CPU tensors under
    TRITON_INTERPRET=1 (how the tests check it)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    block = 1024

    @triton.jit
    def fwd_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < n
        x = tl.load(x_ptr + offs, mask=keep)
        tl.store(y_ptr + offs, tl.where(x < 0, 0.0, x).to(x.dtype), mask=keep)

    @triton.jit
    def bwd_kernel(g_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < n
        g = tl.load(g_ptr + offs, mask=keep)
        y = tl.load(y_ptr + offs, mask=keep)
        tl.store(out_ptr + offs, tl.where(y <= 0, 0.0, g).to(g.dtype), mask=keep)

    def forward(x: Tensor) -> Tensor:
        assert x.is_contiguous()
        y = torch.empty_like(x)
        fwd_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), BLOCK=block)
        return y

    def backward(grad: Tensor, y: Tensor) -> Tensor:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        bwd_kernel[(triton.cdiv(grad.numel(), block),)](grad, y, out, grad.numel(), BLOCK=block)
        return out

    class TritonReLU(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> Tensor:
            y = forward(x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx: Any, grad: Tensor) -> Tensor:
            return backward(grad, ctx.saved_tensors[0])

    return forward, backward, TritonReLU


def available_impls(device: str) -> list[str]:
    out = list(IMPLS)
    if device != "cuda" or triton_relu() is None:
        out.remove("triton")
    return out


def _activation(impl: str) -> Callable[[Tensor], Tensor]:
    """The differentiable activation of each implementation."""
    if impl == "torch":
        return torch.relu
    if impl == "compile":
        return _compiled_relu()
    if impl == "triton":
        return triton_relu()[2].apply
    if impl == "seed":
        return SeedReLU.apply
    if impl == "relu_ext":
        return relu_ext.relu
    raise ValueError(f"{impl} has no autograd path")


def _no_grad(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with torch.no_grad():
            return fn()

    return run


def kernel_cases(x: Tensor, impls: list[str]) -> dict[str, dict[str, tuple[Callable[[], object], int]]]:
    """{case: {impl: (fn, bytes it must move)}} for one input."""
    n, e = x.numel(), x.element_size()
    mask_bytes = (n + 7) // 8
    g = torch.randn_like(x)
    y_ref = torch.relu(x)
    _, mask = ops.relu_fwd(x)
    xg = x.detach().clone().requires_grad_()
    buf = x.clone()
    out = torch.empty_like(x)
    cases: dict[str, dict[str, tuple[Callable[[], object], int]]] = {c: {} for c in CASES}

    def fwd_bwd(act: Callable[[Tensor], Tensor]) -> Callable[[], object]:
        return lambda: torch.autograd.grad(act(xg), xg, g)

    for impl in impls:
        if impl == "torch_out":
            cases["fwd"][impl] = (_no_grad(lambda: torch.clamp(x, min=0, out=out)), 2 * n * e)
            continue
        act = _activation(impl)
        cases["fwd"][impl] = (_no_grad(functools.partial(act, x)), 2 * n * e)
        cases["fwd+bwd"][impl] = (fwd_bwd(act), 5 * n * e if impl != "relu_ext" else 4 * n * e + 2 * mask_bytes)
        if impl == "torch":
            cases["fwd (train)"][impl] = (functools.partial(torch.relu, xg), 2 * n * e)
            cases["bwd"][impl] = (lambda: torch.ops.aten.threshold_backward(g, y_ref, 0), 3 * n * e)
            cases["in-place"][impl] = (_no_grad(lambda: torch.relu_(buf)), 2 * n * e)
        elif impl == "seed":
            cases["fwd (train)"][impl] = (functools.partial(SeedReLU.apply, xg), 2 * n * e)
            cases["bwd"][impl] = (lambda: seed_grad(g, x), 3 * n * e)
        elif impl == "triton":
            cases["bwd"][impl] = (lambda: triton_relu()[1](g, y_ref), 3 * n * e)
        elif impl == "relu_ext":
            cases["fwd (train)"][impl] = (lambda: ops.relu_fwd(x), 2 * n * e + mask_bytes)
            cases["bwd"][impl] = (lambda: ops.relu_bwd(g, mask), 2 * n * e + mask_bytes)
            cases["in-place"][impl] = (_no_grad(lambda: relu_ext.relu(buf, inplace=True)), 2 * n * e)
    return {c: v for c, v in cases.items() if v}


_MODULES = {"torch": nn.ReLU, "relu_ext": relu_ext.ReLU, "seed": SeedReLUModule}


def small_cases(x: Tensor, impls: list[str]) -> dict[str, dict[str, tuple[Callable[[], object], int]]]:
    """{case: {impl: (fn, bytes)}} for the per-call table: function and module,
    no-grad forward and forward+backward."""
    n, e = x.numel(), x.element_size()
    fwd_bwd_bytes = {impl: 4 * n * e + 2 * ((n + 7) // 8) if impl == "relu_ext" else 5 * n * e for impl in impls}
    g = torch.randn_like(x)
    xg = x.detach().clone().requires_grad_()
    cases: dict[str, dict[str, tuple[Callable[[], object], int]]] = {c: {} for c in SMALL_CASES}
    for impl in impls:
        if impl == "torch_out":
            continue
        act = _activation(impl)
        # x needs no grad: the plain call is the no-grad forward (no no_grad() context to time).
        # Lambdas, not partials, so that every implementation is called from Python code, as users do.
        cases["fwd"][impl] = (lambda act=act: act(x), 2 * n * e)
        cases["fwd+bwd"][impl] = (lambda act=act: torch.autograd.grad(act(xg), xg, g), fwd_bwd_bytes[impl])
        if impl in _MODULES:
            module = _MODULES[impl]()
            cases["module fwd"][impl] = (lambda m=module: m(x), 2 * n * e)
            cases["module fwd+bwd"][impl] = (lambda m=module: torch.autograd.grad(m(xg), xg, g), fwd_bwd_bytes[impl])
    return cases


# --- timing ------------------------------------------------------------------


def _stats(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    q = lambda p: samples[min(len(samples) - 1, int(p * len(samples)))]  # noqa: E731
    return {"median_s": statistics.median(samples), "p10_s": q(0.1), "p90_s": q(0.9), "samples": len(samples)}


def measure(fn: Callable[[], object], device: str, repeat: int, budget_s: float) -> dict[str, float]:
    """Median and spread of fn's time per call.

    CPU: torch.utils.benchmark's Timer, in blocks of calls about a tenth of
    `budget_s` long (so that the clock's own cost vanishes), after a warm-up
    that also compiles; each block is one sample: at least 5, at most
    `repeat`, until `budget_s` is spent. (blocked_autorange would make every
    block at least 0.2 s long.) CUDA: see _measure_cuda.
    """
    if device == "cuda":
        return _measure_cuda(fn, repeat, budget_s)
    fn()
    # Timer runs on 1 thread unless told otherwise; measure with the threads torch uses.
    timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    one = timer.timeit(1).median
    number = max(1, int(budget_s / 10 / max(one, 1e-9)))
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < 5 or (len(samples) < repeat and time.perf_counter() - start < budget_s):
        samples.append(timer.timeit(number).median)
    return _stats(samples)


def _measure_cuda(fn: Callable[[], object], repeat: int, budget_s: float) -> dict[str, float]:
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        # Flushes L2 between calls; returns milliseconds at the quantiles.
        med, p10, p90 = do_bench(fn, warmup=25, rep=max(1, int(budget_s * 1e3)), quantiles=[0.5, 0.1, 0.9])
        return {"median_s": med / 1e3, "p10_s": p10 / 1e3, "p90_s": p90 / 1e3, "samples": None}
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeat):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return _stats(samples)


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


def _row(numel_case: dict[str, Any], copy: dict[str, float], results: dict[str, tuple[dict[str, float], int]]) -> dict[str, Any]:
    """A result row: per implementation time, GB/s, fraction of copy, time vs torch."""
    copy_gbs = numel_case["copy_bytes"] / copy["median_s"] / 1e9
    torch_s = results["torch"][0]["median_s"] if "torch" in results else None
    row = dict(numel_case, copy=copy, copy_gbs=copy_gbs, results={})
    for impl, (t, nbytes) in results.items():
        gbs = nbytes / t["median_s"] / 1e9
        row["results"][impl] = dict(t, bytes=nbytes, gbs=gbs, of_copy=gbs / copy_gbs,
                                    vs_torch=t["median_s"] / torch_s if torch_s else None)
    return row


def run_kernels(device: str, dtypes: list[torch.dtype], sizes: list[int], impls: list[str], repeat: int,
                budget_s: float, progress: Progress, section: str = "kernels") -> list[dict[str, Any]]:
    """One row per dtype, size and case. The small section runs the
    implementations of a row interleaved, in SMALL_ROUNDS short rounds that
    share the time budget, and reports each one's median round: load that
    comes and goes then hits all alike, and a few microseconds can be compared."""
    cases_of, rounds = (small_cases, SMALL_ROUNDS) if section == "small" else (kernel_cases, 1)
    rows = []
    for dtype in dtypes:
        for n in sizes:
            x = torch.randn(n, dtype=dtype, device=device)
            buf = torch.empty_like(x)
            copy = measure(lambda: buf.copy_(x), device, repeat, budget_s)
            for case, fns in cases_of(x, impls).items():
                per_round: dict[str, list[dict[str, float]]] = {impl: [] for impl in fns}
                for _ in range(rounds):
                    for impl, (fn, _) in fns.items():
                        progress.step(f"{section} {_dt(dtype)} {n} {case} {impl}")
                        per_round[impl].append(measure(fn, device, repeat, budget_s / rounds))
                results = {impl: (_of_rounds(per_round[impl]), nbytes) for impl, (_, nbytes) in fns.items()}
                rows.append(_row({"section": section, "device": device, "dtype": _dt(dtype), "numel": n, "case": case,
                                  "copy_bytes": 2 * n * x.element_size()}, copy, results))
    return rows


def _of_rounds(rounds: list[dict[str, float]]) -> dict[str, float]:
    """The median round (by its median), with the spread of the round medians."""
    if len(rounds) == 1:
        return rounds[0]
    medians = sorted(r["median_s"] for r in rounds)
    return {"median_s": statistics.median(medians), "p10_s": medians[int(0.1 * len(medians))],
            "p90_s": medians[min(len(medians) - 1, int(0.9 * len(medians)))], "samples": len(rounds),
            "rounds": len(rounds)}


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# --- models: training step time and memory -------------------------------------


def build_model(name: str, impl: str, quick: bool) -> nn.Sequential:
    """The three models; `impl` picks the activation module."""
    act = {"torch": nn.ReLU, "relu_ext": relu_ext.ReLU, "seed": SeedReLUModule}[impl]
    w = 256 if quick else 2048
    if name == "mlp":  # ReLU -> Linear: Linear saves the ReLU output anyway
        return nn.Sequential(nn.Linear(256, w), act(), nn.Linear(w, w), act(), nn.Linear(w, 10))
    if name == "mlp_dropout":  # ReLU -> Dropout: the ReLU output is saved by nothing else
        return nn.Sequential(nn.Linear(256, w), act(), nn.Dropout(0.1), nn.Linear(w, w), act(), nn.Dropout(0.1),
                             nn.Linear(w, 10))
    if name == "cnn_maxpool":  # ReLU -> MaxPool2d: max-pool saves its input (the ReLU output) itself
        c = 8 if quick else 32
        return nn.Sequential(nn.Conv2d(3, c, 3, padding=1), act(), nn.MaxPool2d(2), nn.Conv2d(c, 2 * c, 3, padding=1),
                             act(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(2 * c * 8 * 8, 10))
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def model_batch(name: str, purpose: str, quick: bool) -> int:
    if quick:
        return 16
    big = purpose == "memory"
    return (8192 if big else 512) if name.startswith("mlp") else (256 if big else 64)


def model_step(name: str, impl: str, device: str, batch: int, quick: bool, seed: int = 0):
    """(model, step()) where step runs forward, cross-entropy, backward and SGD."""
    torch.manual_seed(seed)
    model = build_model(name, impl, quick).to(device)
    shape = (batch, 256) if name.startswith("mlp") else (batch, 3, 32, 32)
    x = torch.randn(shape, device=device)
    target = torch.randint(0, 10, (batch,), device=device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> Tensor:
        opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x), target)
        loss.backward()
        opt.step()
        return loss

    return model, x, step


def saved_bytes(fn: Callable[[], Tensor], exclude: list[Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves for backward while fn runs
    (storages of `exclude`, e.g. parameters and the input batch, not counted)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def saved_bytes_per_element(device: str, dtype: torch.dtype, impls: list[str], n: int = 1 << 20) -> dict[str, float]:
    """What one activation keeps for backward, per element of its input."""
    out = {}
    for impl in impls:
        if impl == "torch_out":
            continue
        x = torch.randn(n, dtype=dtype, device=device).requires_grad_()
        act = _activation(impl)
        act(x)  # compile / first-call work outside the measurement
        out[impl] = saved_bytes(lambda: act(x)) / n
    return out


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{field} not in /proc/self/status")


def peak_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One training step of one model in this (fresh) process: its peak memory
    above what was live before it, and the bytes saved for backward.

    CUDA: torch.cuda.max_memory_allocated. CPU: growth of the resident-set
    high-water mark (VmHWM, reset through /proc/self/clear_refs), with glibc
    told to mmap every block of 64 KiB or more, so that freed tensors leave the
    process at once and the RSS follows the live tensors.
    """
    device = spec["device"]
    if device == "cpu":
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    model, x, step = model_step(spec["model"], spec["impl"], device, spec["batch"], spec["quick"])
    step()  # gradients and optimizer buffers exist from here on
    params = list(model.parameters())
    saved = saved_bytes(lambda: F.cross_entropy(model(x), torch.zeros(len(x), dtype=torch.long, device=device)),
                        params + [x])
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak, method = torch.cuda.max_memory_allocated() - before, "torch.cuda.max_memory_allocated"
    else:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            before = _rss_bytes("VmRSS")
            step()
            # Linux syncs per-thread RSS counters every 64 page faults, so the
            # figures are good to about 256 KiB per thread: tiny models can read
            # slightly negative, which means "below resolution".
            peak = max(0, _rss_bytes("VmHWM") - before)
            method = "VmHWM growth (resolution ~256 KiB), glibc mmap threshold 64 KiB"
        except OSError as err:
            peak, method = None, f"unavailable: {err}"
    return {"saved_bytes": saved, "peak_bytes": peak, "peak_method": method}


def run_memory(device: str, dtypes: list[torch.dtype], impls: list[str], quick: bool, progress: Progress) -> dict[str, Any]:
    per_element = []
    for dtype in dtypes:
        progress.step(f"memory saved bytes {_dt(dtype)}")
        per_element.append({"dtype": _dt(dtype), "bytes_per_element": saved_bytes_per_element(device, dtype, impls)})
    models = []
    for name in MODELS:
        row = {"model": name, "batch": model_batch(name, "memory", quick), "dtype": "float32", "results": {}}
        for impl in [i for i in ("torch", "seed", "relu_ext") if i in impls]:
            progress.step(f"memory {name} {impl}")
            spec = {"model": name, "impl": impl, "device": device, "batch": row["batch"], "quick": quick}
            out = subprocess.run([sys.executable, "-m", "relu_ext.bench", "--peak-worker", json.dumps(spec)],
                                 capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise RuntimeError(f"memory worker for {spec} failed:\n{out.stderr[-3000:]}")
            row["results"][impl] = json.loads(out.stdout.strip().splitlines()[-1])
        base = row["results"].get("torch")
        for r in row["results"].values():
            r["saved_vs_torch"] = r["saved_bytes"] / base["saved_bytes"] if base else None
            r["peak_vs_torch"] = r["peak_bytes"] / base["peak_bytes"] if base and base["peak_bytes"] and r["peak_bytes"] else None
        models.append(row)
    return {"saved_per_element": per_element, "models": models}


def run_models(device: str, impls: list[str], repeat: int, budget_s: float, quick: bool, progress: Progress) -> list[dict[str, Any]]:
    rows = []
    for name in MODELS:
        batch = model_batch(name, "time", quick)
        results = {}
        for impl in [i for i in ("torch", "seed", "relu_ext") if i in impls]:
            progress.step(f"models {name} {impl}")
            _, _, step = model_step(name, impl, device, batch, quick)
            results[impl] = measure(step, device, repeat, budget_s)
        torch_s = results["torch"]["median_s"] if "torch" in results else None
        for r in results.values():
            r["vs_torch"] = r["median_s"] / torch_s if torch_s else None
        rows.append({"model": name, "batch": batch, "dtype": "float32", "results": results})
    return rows


# --- environment and output ----------------------------------------------------------


def environment(device: str) -> dict[str, Any]:
    env = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "relu_ext": relu_ext.build_info(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "threads": torch.get_num_threads(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sms=props.multi_processor_count, gpu_memory_bytes=props.total_memory, driver=_driver())
    return env


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def default_name(env: dict[str, Any]) -> str:
    what = env.get("gpu") if env["device"] == "cuda" else f"{env['cpu']} {env['threads']}t"
    slug = re.sub(r"[^a-z0-9]+", "-", what.lower()).strip("-")
    # Date and time: a new run never overwrites an earlier one.
    return f"{env['device']}-{slug}-{env['date'][:16].replace(':', '')}"


def _size(n: int) -> str:
    for unit, div in (("M", 2**20), ("K", 2**10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def _grid(rows: list[dict[str, Any]], title: str, lead: Callable[[dict[str, Any]], str], lead_head: str, width: int,
          cell: Callable[[dict[str, Any]], str]) -> list[str]:
    """A table with one line per row and one column per implementation present."""
    if not rows:
        return []
    impls = [i for i in IMPLS if any(i in r["results"] for r in rows)]
    head = f"{'dtype':9} {'numel':>6} {lead_head}" + " ".join(f"{i:>{width}}" for i in impls)
    lines = ["", title, head, "-" * len(head)]
    for r in rows:
        cells = [cell(r["results"][i]).rjust(width) if i in r["results"] else " " * width for i in impls]
        lines.append(f"{r['dtype']:9} {_size(r['numel']):>6} {lead(r)}" + " ".join(cells))
    return lines


def format_tables(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [f"relu_ext benchmark: {env.get('gpu') or env['cpu']} ({env['device']}), torch {env['torch']}, "
             f"{env['threads']} CPU threads, CPU kernels {env['relu_ext']['cpu_isa']}, {env['date']}"]
    lines += _grid(result.get("kernels", []), "kernels: GB/s (fraction of copy) [time vs torch, <1 faster]",
                   lambda r: f"{r['case']:12} {r['copy_gbs']:6.1f} ", f"{'case':12} {'copy':>6} ", 22,
                   lambda c: f"{c['gbs']:7.1f} ({c['of_copy']:4.0%}) [{c['vs_torch']:4.2f}]")
    lines += _grid(result.get("small", []), "small tensors, per call: microseconds [time vs torch, <1 faster]",
                   lambda r: f"{r['case']:15} ", f"{'case':15} ", 17, lambda c: f"{c['median_s'] * 1e6:8.2f} [{c['vs_torch']:4.2f}]")
    memory = result.get("memory")
    if memory:
        lines += ["", "memory saved for backward, bytes per element of one activation"]
        for r in memory["saved_per_element"]:
            lines.append(f"  {r['dtype']:9} " + "  ".join(f"{k} {v:.3f}" for k, v in r["bytes_per_element"].items()))
        lines += ["", "one training step (float32): saved for backward / peak above the live set, MiB [vs torch]"]
        for r in memory["models"]:
            cells = []
            for impl, m in r["results"].items():
                peak = f"{m['peak_bytes'] / 2**20:.1f}" if m["peak_bytes"] is not None else "n/a"
                vs = f"{m['saved_vs_torch']:.2f}/{m['peak_vs_torch']:.2f}" if m["peak_vs_torch"] else "-"
                cells.append(f"{impl} {m['saved_bytes'] / 2**20:.1f}/{peak} [{vs}]")
            lines.append(f"  {r['model']:12} batch {r['batch']:5}  " + "   ".join(cells))
        methods = {m["peak_method"] for r in memory["models"] for m in r["results"].values()}
        lines.append(f"  peak measured by: {', '.join(sorted(methods))}")
    models = result.get("models", [])
    if models:
        lines += ["", "training step time (forward, loss, backward, SGD), ms [time vs torch]"]
        for r in models:
            lines.append(f"  {r['model']:12} batch {r['batch']:4}  " + "   ".join(
                f"{i} {m['median_s'] * 1e3:.2f} [{m['vs_torch']:.2f}]" for i, m in r["results"].items()))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> bool:
    """GB/s vs size per implementation, one panel per dtype and case, the copy
    as the ceiling. False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["kernels"]
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    cases = [c for c in CASES if any(r["case"] == c for r in rows)]
    fig, axes = plt.subplots(len(dtypes), len(cases), figsize=(4 * len(cases), 3.3 * len(dtypes)), squeeze=False)
    env = result["environment"]
    for i, dtype in enumerate(dtypes):
        for j, case in enumerate(cases):
            ax = axes[i][j]
            sel = sorted((r for r in rows if r["dtype"] == dtype and r["case"] == case), key=lambda r: r["numel"])
            sizes = [r["numel"] for r in sel]
            ax.plot(sizes, [r["copy_gbs"] for r in sel], "k--", label="copy (ceiling)")
            for k, impl in enumerate(IMPLS):
                pts = [(r["numel"], r["results"][impl]["gbs"]) for r in sel if impl in r["results"]]
                if pts:  # one colour per implementation in every panel
                    ax.plot(*zip(*pts), marker="o", ms=3, label=impl, color=f"C{k}", lw=2.2 if impl == "relu_ext" else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{dtype} {case}", fontsize=10)
            ax.set_xlabel("elements")
            ax.set_ylabel("GB/s")
            ax.grid(alpha=0.3)
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_lines()}
    fig.legend(handles.values(), handles.keys(), loc="upper right", fontsize=8, ncol=len(handles))
    fig.suptitle(f"relu_ext vs peers: {env.get('gpu') or env['cpu']}, torch {env['torch']}, {env['date'][:10]}", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m relu_ext.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--sizes", help="comma-separated element counts (default: 4K-64M on CPU, 64K-256M on CUDA)")
    p.add_argument("--what", default=",".join(SECTIONS), help=f"sections, from {SECTIONS}")
    p.add_argument("--impls", default=",".join(IMPLS), help="implementations (triton: CUDA only)")
    p.add_argument("--repeat", type=int, default=50, help="most samples per measurement")
    p.add_argument("--budget", type=float, default=0.4, help="seconds per measurement (at least 5 samples)")
    p.add_argument("--quick", action="store_true", help="tiny models (for tests and smoke runs)")
    p.add_argument("--out", default=os.path.join("bench", "out"),
                   help="folder for NAME.json and NAME.png (default: bench/out, which git ignores; "
                        "`make bench-results` writes to the committed bench/results on purpose)")
    p.add_argument("--name", help="file name stem (default: device-model-dateTtime)")
    p.add_argument("--no-files", action="store_true", help="print the tables only")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress on stderr (default: a bar on a terminal, else a line every 15 s)")
    p.add_argument("--peak-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peak_worker:
        print(json.dumps(peak_worker(json.loads(args.peak_worker))))
        return {}

    what = args.what.split(",")
    unknown = set(what) - set(SECTIONS) | set(args.impls.split(",")) - set(IMPLS)
    if unknown:
        p.error(f"unknown section or implementation: {sorted(unknown)}")
    if args.device == "cuda" and not relu_ext.cuda_available():
        p.error("--device cuda needs a relu_ext built with its CUDA kernels")
    impls = [i for i in args.impls.split(",") if i in available_impls(args.device)]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else DEFAULT_SIZES[args.device]
    small_sizes = [s for s in SMALL_SIZES if not args.quick or s <= 4096]

    per_size = sum(len(v) for v in kernel_cases(torch.zeros(8, device=args.device), impls).values())
    per_small = sum(len(v) for v in small_cases(torch.zeros(8, device=args.device), impls).values())
    model_impls = [i for i in ("torch", "seed", "relu_ext") if i in impls]
    total = (("kernels" in what) * len(dtypes) * len(sizes) * per_size
             + ("small" in what) * len(small_sizes) * per_small * SMALL_ROUNDS
             + ("memory" in what) * (len(dtypes) + len(MODELS) * len(model_impls))
             + ("models" in what) * len(MODELS) * len(model_impls))
    mode = ("bar" if sys.stderr.isatty() else "lines") if args.progress is not False else "off"
    progress = Progress(total, mode)

    result: dict[str, Any] = {"environment": environment(args.device),
                              "config": {"dtypes": args.dtypes.split(","), "sizes": sizes, "what": what, "impls": impls,
                                         "repeat": args.repeat, "budget_s": args.budget, "quick": args.quick}}
    if "kernels" in what:
        result["kernels"] = run_kernels(args.device, dtypes, sizes, impls, args.repeat, args.budget, progress)
    if "small" in what:
        result["small"] = run_kernels(args.device, dtypes[:1], small_sizes, impls, args.repeat, args.budget,
                                      progress, section="small")
    if "memory" in what:
        result["memory"] = run_memory(args.device, dtypes, impls, args.quick, progress)
    if "models" in what:
        result["models"] = run_models(args.device, impls, args.repeat, args.budget, args.quick, progress)

    print(format_tables(result))
    if not args.no_files:
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, args.name or default_name(result["environment"]))
        with open(stem + ".json", "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {stem}.json")
        if "kernels" in result and plot(result, stem + ".png"):
            print(f"wrote {stem}.png")
        elif "kernels" in result:
            print("no plot: matplotlib is not installed (pip install matplotlib)")
    return result


if __name__ == "__main__":
    main()
