"""Which formula reproduces PyTorch's BatchNorm output bit for bit on this device: the question a
BatchNorm replay (save_compact's recompute) must answer before it has a kernel there.

    python bench/bn_probe.py --device cuda --out DIR      # on a GPU machine: writes DIR/bn_probe.json
    python bench/bn_probe.py --device cpu                 # here: the CPU's formula must match everywhere

For each dtype, layout (contiguous, channels_last), mode (training, eval) and, on CUDA, with cuDNN
on and off, it runs ``nn.BatchNorm2d`` (parameters in the input's dtype, as ``model.to(dtype)``
makes them) on random data and records the autograd node it made, what that node saves, and the
fraction of output elements that each candidate formula gives bit for bit. The candidates are the
element-wise forms of PyTorch's kernels (``aten/src/ATen/native/cpu/batch_norm_kernel.cpp``, and
``batch_norm_elementwise`` / ``batch_norm_transform_input_kernel`` / the channels-last transform of
``aten/src/ATen/native/cuda/Normalization.cuh``), each with and without FMA contraction. They are
evaluated in float64 with a rounding to the accumulate type after every operation (float32 for the
16-bit dtypes), so a product is exact and an fma rounds twice (float64, then float32): in about one
case in 2^29 that differs from the hardware's single rounding. Needs only torch: no build of relu_ext.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

# (Not float64: its products are not exact in float64, so this emulation cannot tell the
# formulas apart there; the replay's own verification measures its hit rate.)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ACC = torch.float32  # the accumulate type of every dtype above


def _r(v: Tensor, acc: torch.dtype) -> Tensor:
    """v (float64) rounded to the accumulate type and back: one operation's result."""
    return v.to(acc).double()


def candidates(x: Tensor, w: Tensor, b: Tensor, mean: Tensor, invstd: Tensor, acc: torch.dtype,
               params_in_acc: bool) -> dict[str, Tensor]:
    """Each candidate's output in float64, before the rounding to x's dtype; per-channel values broadcast."""
    shape = [1, -1] + [1] * (x.dim() - 2)
    X = x.double()
    W, B, M, S = (t.double().reshape(shape) for t in (w, b, mean, invstd))
    alpha = _r(S * W, acc)
    beta_fma = _r(B - M * alpha, acc)  # one rounding: an fma of exact float64 terms
    beta_two = _r(B - _r(M * alpha, acc), acc)  # the 16-bit parameters' path: product, then difference
    beta = beta_fma if params_in_acc else beta_two
    d = _r(X - M, acc)
    return {
        # CPU: alpha = invstd * w, beta = b - mean * alpha, out = fma(x, alpha, beta)
        "cpu fma(x, alpha, beta)": _r(X * alpha + beta, acc),
        "cpu x * alpha + beta": _r(_r(X * alpha, acc) + beta, acc),
        # CUDA, TensorIterator (batch_norm_elementwise): ((x - mean) * invstd) * w + b
        "fma((x - mean) * invstd, w, b)": _r(_r(d * S, acc) * W + B, acc),
        "((x - mean) * invstd) * w + b": _r(_r(_r(d * S, acc) * W, acc) + B, acc),
        # CUDA, contiguous and channels-last transforms: w * (x - mean) * invstd + b
        "fma(w * (x - mean), invstd, b)": _r(_r(W * d, acc) * S + B, acc),
        "(w * (x - mean)) * invstd + b": _r(_r(_r(W * d, acc) * S, acc) + B, acc),
    }


def _stats(node: Any, bn: nn.BatchNorm2d, training: bool, acc: torch.dtype) -> tuple[Tensor, Tensor, str]:
    """The mean and invstd the kernel used: what the node saved in training, the running
    statistics in eval (invstd = 1 / sqrt(var + eps), two roundings)."""
    if training:
        for m_name, s_name in (("_saved_result1", "_saved_result2"), ("_saved_save_mean", "_saved_save_invstd")):
            m, s = getattr(node, m_name, None), getattr(node, s_name, None)
            if isinstance(m, Tensor) and isinstance(s, Tensor) and m.numel() == s.numel() == bn.num_features:
                return m.detach(), s.detach(), f"{m_name}, {s_name}"
        raise RuntimeError(f"{node.name()}: no saved mean / invstd found")
    var = bn.running_var.double()
    eps = torch.tensor(bn.eps, dtype=acc).double()  # (PyTorch adds eps in the accumulate type)
    invstd = _r(1.0 / _r(torch.sqrt(_r(var + eps, acc)), acc), acc)
    return bn.running_mean.detach(), invstd, "running statistics"


def probe_case(dtype: torch.dtype, layout: str, training: bool, device: str, seed: int = 0,
               shape: tuple[int, int, int, int] = (8, 24, 17, 19)) -> dict[str, Any]:
    """One configuration: node, saved names and each candidate's fraction of bit-exact elements."""
    g = torch.Generator().manual_seed(seed)
    c = shape[1]
    bn = nn.BatchNorm2d(c)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(c, generator=g) + 0.5)
        bn.bias.copy_(torch.randn(c, generator=g))
        bn.running_mean.copy_(torch.randn(c, generator=g))
        bn.running_var.copy_(torch.rand(c, generator=g) + 0.1)
    bn = bn.to(device=device, dtype=dtype).train(training)
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(device=device, dtype=dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    y = bn(x)
    node = y.grad_fn
    mean, invstd, source = _stats(node, bn, training, ACC)
    params_in_acc = bn.weight.dtype == ACC
    out = {}
    for name, v in candidates(x.detach(), bn.weight.detach(), bn.bias.detach(), mean, invstd, ACC,
                              params_in_acc).items():
        got = v.to(ACC).to(dtype)
        same = got.contiguous().view(-1).view(_int(dtype)) == y.detach().contiguous().view(-1).view(_int(dtype))
        out[name] = round(float(same.double().mean()), 6)
    return {
        "dtype": str(dtype).replace("torch.", ""), "layout": layout, "mode": "train" if training else "eval",
        "node": node.name(), "saved": sorted(a for a in dir(node) if a.startswith("_saved_")),
        "stats_from": source, "match": out,
    }


def _int(dtype: torch.dtype) -> torch.dtype:
    return {2: torch.int16, 4: torch.int32}[dtype.itemsize]


def run(device: str, cudnn_settings: list[bool], log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every case, with each cuDNN setting (CUDA only)."""
    rows = []
    for use_cudnn in cudnn_settings:
        with torch.backends.cudnn.flags(enabled=use_cudnn):
            for dtype in DTYPES:
                for layout in ("contiguous", "channels_last"):
                    for training in (True, False):
                        row = probe_case(dtype, layout, training, device)
                        row["cudnn"] = use_cudnn if device != "cpu" else None
                        rows.append(row)
                        best = max(row["match"].items(), key=lambda kv: kv[1])
                        log(f"{row['dtype']:9} {layout:13} {row['mode']:5} cudnn={row['cudnn']!s:5} "
                            f"{row['node']:28} best: {best[0]} {best[1]:.6f}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, help="folder for bn_probe.json (default: print only)")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("bn_probe: no GPU visible", file=sys.stderr)
        return 3
    rows = run(args.device, [True, False] if cuda else [False])
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        env = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "python": platform.python_version(), "device": args.device,
            "device_name": torch.cuda.get_device_name(args.device) if cuda else platform.processor(),
            "cudnn": torch.backends.cudnn.version() if cuda else None,
        }
        (args.out / "bn_probe.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
