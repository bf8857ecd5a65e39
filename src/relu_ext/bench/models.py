"""Three small models with each activation: training step time; bytes saved for backward per
element of one activation. Imports no other section's module (real.py builds on this one)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import relu_ext

from . import peers, timing

MODELS = ["mlp", "mlp_dropout", "cnn_maxpool"]
MODEL_IMPLS = ["torch", "seed", "relu_ext"]


def build_model(name: str, impl: str, quick: bool) -> nn.Sequential:
    """The three models; `impl` picks the activation module."""
    act = peers.MODULES[impl]
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


def model_batch(name: str, quick: bool) -> int:
    """Batch size for timing."""
    if quick:
        return 16
    return 512 if name.startswith("mlp") else 64


def model_step(name: str, impl: str, device: str, batch: int, quick: bool,
               seed: int = 0) -> tuple[nn.Module, Tensor, Callable[[], Tensor]]:
    """(model, input, step()) where step runs forward, cross-entropy, backward and SGD."""
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


def saved_bytes(fn: Callable[[], Tensor], exclude: Sequence[Tensor] = ()) -> int:
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
        act = peers.activation(impl)
        with relu_ext.install() if impl == "installed" else contextlib.nullcontext():
            act(x)  # compile / first-call work outside the measurement
            out[impl] = saved_bytes(lambda: act(x)) / n
    return out


def run_models(device: str, impls: list[str], rounds: int, budget_s: float, quick: bool,
               progress: timing.Progress, max_spread: float = timing.MAX_SPREAD) -> list[dict[str, Any]]:
    """Training step time of each model, the activations interleaved in rounds."""
    rows = []
    for name in MODELS:
        batch = model_batch(name, quick)
        steps = {impl: model_step(name, impl, device, batch, quick)[2] for impl in MODEL_IMPLS if impl in impls}
        samples = timing.interleave(steps, device, rounds, budget_s, lambda impl: progress.step(f"models {name} {impl}"))
        results = {impl: timing.summarize(s, max_spread) for impl, s in samples.items()}
        for impl, r in results.items():
            r["vs_torch"] = timing.paired(samples[impl], samples["torch"]) if "torch" in samples else None
        rows.append({"model": name, "batch": batch, "dtype": "float32", "results": results})
    return rows
