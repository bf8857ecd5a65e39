"""Kernel benchmark: relu_ext against PyTorch, measured in the same run.

    python bench/run.py [--device cpu|cuda] [--dtypes float32,bfloat16] [--sizes 65536,16777216]
                        [--repeat 30] [--json out.json]

For every size and dtype it times, with warm-up, the median (and the 10-90%
spread) of:
  copy            x.copy_() into a preallocated buffer: the bandwidth ceiling
  fwd (infer)     relu_ext.relu(x) vs torch.relu(x), no grad
  fwd (train)     relu_ext's forward that also writes the mask vs torch.relu(x)
  bwd             relu_ext's backward from the mask vs aten.threshold_backward(grad, y, 0)
  fwd+bwd         autograd.grad through relu_ext.relu vs torch.relu
GB/s counts the bytes each implementation must move (mask: 1 bit/element);
"of copy" is that bandwidth over the copy's, from the same run; "ratio" is
torch time / relu_ext time (>1: relu_ext faster).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from typing import Callable

import torch

import relu_ext

ops = torch.ops.relu_ext


def timer(device: str) -> Callable[[Callable[[], object], int], list[float]]:
    """Returns time(fn, repeat) -> seconds per call, one sample per repeat."""
    if device == "cuda":

        def run(fn, repeat):
            samples = []
            for _ in range(repeat):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            return samples

        return run

    def run(fn, repeat):
        samples = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return samples

    return run


def measure(fn: Callable[[], object], repeat: int, device: str) -> dict[str, float]:
    for _ in range(3):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    samples = sorted(timer(device)(fn, repeat))
    q = lambda p: samples[min(len(samples) - 1, int(p * len(samples)))]  # noqa: E731
    return {"median_s": statistics.median(samples), "p10_s": q(0.1), "p90_s": q(0.9)}


def cases(x: torch.Tensor) -> list[tuple[str, int, int, Callable[[], object], Callable[[], object]]]:
    """(name, relu_ext bytes, torch bytes, relu_ext fn, torch fn) for one input."""
    n, e = x.numel(), x.element_size()
    mask_bytes = (n + 7) // 8
    g = torch.randn_like(x)
    y_ref = torch.relu(x)
    _, mask = ops.relu_fwd(x)
    xg = x.detach().clone().requires_grad_()

    def ext_fwd_bwd():
        return torch.autograd.grad(relu_ext.relu(xg), xg, g)

    def ref_fwd_bwd():
        return torch.autograd.grad(torch.relu(xg), xg, g)

    return [
        ("fwd (infer)", 2 * n * e, 2 * n * e, lambda: relu_ext.relu(x), lambda: torch.relu(x)),
        ("fwd (train)", 2 * n * e + mask_bytes, 2 * n * e, lambda: ops.relu_fwd(x), lambda: torch.relu(x)),
        ("bwd", 2 * n * e + mask_bytes, 3 * n * e, lambda: ops.relu_bwd(g, mask),
         lambda: torch.ops.aten.threshold_backward(g, y_ref, 0)),
        ("fwd+bwd", 4 * n * e + 2 * mask_bytes, 5 * n * e, ext_fwd_bwd, ref_fwd_bwd),
    ]


def environment(device: str) -> dict[str, object]:
    env = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "relu_ext": relu_ext.build_info(),
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu": _cpu_model(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sms=props.multi_processor_count, cuda=torch.version.cuda, driver=_driver())
    return env


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _driver() -> str | None:
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run(device: str, dtypes: list[torch.dtype], sizes: list[int], repeat: int) -> dict[str, object]:
    rows = []
    for dtype in dtypes:
        for n in sizes:
            x = torch.randn(n, dtype=dtype, device=device)
            buf = torch.empty_like(x)
            copy = measure(lambda: buf.copy_(x), repeat, device)
            copy_gbs = 2 * n * x.element_size() / copy["median_s"] / 1e9
            for name, ext_bytes, ref_bytes, ext_fn, ref_fn in cases(x):
                ext = measure(ext_fn, repeat, device)
                ref = measure(ref_fn, repeat, device)
                rows.append({
                    "device": device, "dtype": str(dtype).replace("torch.", ""), "numel": n, "case": name,
                    "copy": copy, "copy_gbs": copy_gbs,
                    "relu_ext": ext, "torch": ref,
                    "relu_ext_gbs": ext_bytes / ext["median_s"] / 1e9,
                    "torch_gbs": ref_bytes / ref["median_s"] / 1e9,
                    "relu_ext_bytes": ext_bytes, "torch_bytes": ref_bytes,
                    "ratio": ref["median_s"] / ext["median_s"],
                })
    return {"environment": environment(device), "rows": rows}


def table(result: dict[str, object]) -> str:
    head = (f"{'dtype':9} {'numel':>11} {'case':12} {'relu_ext ms':>12} {'torch ms':>10} "
            f"{'ext GB/s':>9} {'of copy':>8} {'torch GB/s':>10} {'of copy':>8} {'ratio':>6}")
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        lines.append(
            f"{r['dtype']:9} {r['numel']:>11} {r['case']:12} {r['relu_ext']['median_s'] * 1e3:>12.4f} "
            f"{r['torch']['median_s'] * 1e3:>10.4f} {r['relu_ext_gbs']:>9.1f} {r['relu_ext_gbs'] / r['copy_gbs']:>8.0%} "
            f"{r['torch_gbs']:>10.1f} {r['torch_gbs'] / r['copy_gbs']:>8.0%} {r['ratio']:>6.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--sizes", default="65536,1048576,16777216,67108864")
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--json", help="write every figure and the environment here")
    args = p.parse_args(argv)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    result = run(args.device, dtypes, sizes, args.repeat)
    env = result["environment"]
    print(f"relu_ext benchmark on {env.get('gpu') or env['cpu']} ({args.device}), torch {env['torch']}, "
          f"{env['threads']} threads, CPU kernels {env['relu_ext']['cpu_isa']}, {env['date']}")
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
