"""Real models at GPU sizes, one training step each under four configurations: what a user
training on a GPU compares.

    python bench/gpu_models.py --device cuda --out DIR [--deadline S]   # a GPU machine: DIR/gpu_models.json
    python bench/gpu_models.py --device cpu --tiny --no-compile          # here: the same code at toy sizes

Configurations: ``nn.ReLU`` (PyTorch as it is), ``install`` (relu_ext.install()), ``install+save_compact``
(and relu_ext.save_compact() around the forward), ``compile nn.ReLU`` (torch.compile of the model as it
is), ``sac nn.ReLU`` (op-level selective activation checkpointing, relu_ext.bench.checkpointing). Cases:
resnet50 at 224x224 in float32 and in bfloat16 autocast with channels_last (as people train),
transformers' Llama and GPT-2 in bfloat16 autocast, mobilenet_v2, densenet121 and T5 (ReLU
feed-forward) in bfloat16 autocast, then OPT, BERT and Gemma in bfloat16 autocast and Llama in float32
(the benchmark's transformers, relu_ext.bench.real.transformer, 2 layers of 512, 256 tokens; what the
GPU plan's deadline leaves time for).

For each case and configuration, after warm-up steps (where the compiled model compiles):
``peak_bytes`` (``torch.cuda.max_memory_allocated`` over one step, above what was allocated before it),
``held_bytes`` (what autograd holds after the forward, counted exactly: relu_ext.bench.real.held_bytes),
``step_s`` (the median of interleaved timed steps), ``host_syncs_per_step`` (synchronizing CUDA calls in
one step, counted with ``torch.cuda.set_sync_debug_mode("warn")``), and save_compact()'s counts
(``replay_misses`` among them). On the CPU the peak and the syncs are None: nothing here measures them.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import relu_ext
from relu_ext.bench import real

CONFIGS = ["nn.ReLU", "install", "install+save_compact", "compile nn.ReLU", "sac nn.ReLU"]
# relu_ext.bench.real's name of each configuration (its held_bytes counts the same way).
_REAL = {"nn.ReLU": "nn.ReLU", "install": "install", "install+save_compact": "install+recompute",
         "compile nn.ReLU": "compile nn.ReLU", "sac nn.ReLU": "sac nn.ReLU"}
# (model, precision, batch): "float32", or "amp" (float32 weights, channels_last, bfloat16 autocast).
CASES = [("resnet50", "float32", 64), ("resnet50", "amp", 128), ("llama", "amp", 16), ("gpt2", "amp", 16),
         ("mobilenet_v2", "amp", 128), ("densenet121", "amp", 64), ("t5_relu", "amp", 32), ("opt", "amp", 16),
         ("bert", "amp", 16), ("gemma", "amp", 16), ("llama", "float32", 16)]
SIDE, TOKENS = 224, 256
TINY = {"batch": 2, "side": 64, "tokens": 16}  # --tiny: the code path at toy sizes (tests, the CPU)


def build(name: str, precision: str, batch: int, device: str, tiny: bool) -> tuple[nn.Module, Any]:
    """(model in training mode, its inputs): random weights, seeded."""
    torch.manual_seed(0)
    batch = TINY["batch"] if tiny else batch
    if name == "t5_relu":
        import transformers

        width = 64 if tiny else 512  # t5-small's shape, with the ReLU feed-forward
        config = transformers.T5Config(
            vocab_size=32128 if not tiny else 512, d_model=width, d_kv=width // 8, d_ff=4 * width,
            num_layers=2 if tiny else 6, num_decoder_layers=2 if tiny else 6, num_heads=8,
            feed_forward_proj="relu", dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0)
        model = transformers.T5ForConditionalGeneration(config)
        tokens = TINY["tokens"] if tiny else TOKENS
        g = torch.Generator().manual_seed(0)
        inputs = {k: torch.randint(1, config.vocab_size, (batch, tokens), generator=g).to(device)
                  for k in ("input_ids", "labels")}
        return model.to(device).train(), inputs
    if name in real.TRANSFORMERS:
        model = real.transformer(name, 64 if tiny else 512)
        tokens = TINY["tokens"] if tiny else TOKENS
        ids = torch.randint(1, 1024, (batch, tokens), generator=torch.Generator().manual_seed(0)).to(device)
        return model.to(device).train(), {"input_ids": ids, "labels": ids}
    import torchvision

    model = getattr(torchvision.models, name)(weights=None).to(device).train()
    side = TINY["side"] if tiny else SIDE
    x = torch.randn(batch, 3, side, side, device=device)
    if precision == "amp":
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    return model, x


def autocast(precision: str, device: str) -> contextlib.AbstractContextManager:
    """The forward's autocast: bfloat16 for "amp", none for "float32"."""
    return torch.autocast(device, torch.bfloat16) if precision == "amp" else contextlib.nullcontext()


def step_fn(model: nn.Module, inputs: Any, config: str, precision: str, device: str,
            counts: dict[str, int]) -> Callable[[], None]:
    """One training step under `config`: forward (autocast, save_compact()), backward, SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        saving = relu_ext.save_compact() if config == "install+save_compact" else contextlib.nullcontext()
        with autocast(precision, device), saving as sc:
            loss = real.loss_of(model, inputs)
        loss.backward()
        opt.step()
        if sc is not None:
            counts.update(real.compact_counts(sc))

    return step


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_bytes(step: Callable[[], None], device: str) -> int | None:
    """torch.cuda.max_memory_allocated over one step, above what was allocated before it (real.peak_of)."""
    return real.peak_of(step, device)["peak_bytes"] if device == "cuda" else None


def host_syncs(step: Callable[[], None], device: str) -> int | None:
    """The synchronizing CUDA calls of one step, as torch's sync debug mode warns of them."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught)


def run_case(name: str, precision: str, batch: int, device: str, tiny: bool, configs: list[str],
             rounds: int) -> dict[str, Any]:
    """One case's row: each configuration's figures, and its ratios to nn.ReLU's."""
    model, inputs = build(name, precision, batch, device, tiny)
    results: dict[str, dict[str, Any]] = {}
    steps = {}
    for config in configs:
        counts: dict[str, int] = {}
        try:
            run_as = real.prepare(model, _REAL[config])
            with real.installing(_REAL[config])():
                with autocast(precision, device):
                    held = real.held_bytes(run_as, inputs, _REAL[config])
                step = step_fn(run_as, inputs, config, precision, device, counts)
                start = time.perf_counter()
                step()  # the first step: compiles, allocates the gradients and the optimizer's state
                sync(device)
                first_s = time.perf_counter() - start
                step()
                results[config] = {"held_bytes": held, "peak_bytes": peak_bytes(step, device),
                                   "host_syncs_per_step": host_syncs(step, device), "first_step_s": first_s}
        except Exception as err:  # noqa: BLE001  (one configuration's failure is a figure too: the others go on)
            results[config] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]}
            print(f"gpu_models: {name} {precision} {config}: {results[config]['error']}", file=sys.stderr, flush=True)
            continue
        if counts:
            results[config]["save_compact"] = dict(counts)
        steps[config] = step
    times: dict[str, list[float]] = {config: [] for config in steps}
    for _ in range(rounds):  # interleaved: a slow moment of the machine hits every configuration
        for config in steps:
            with real.installing(_REAL[config])():
                sync(device)
                start = time.perf_counter()
                steps[config]()
                sync(device)
                times[config].append(time.perf_counter() - start)
    base = results[configs[0]]
    for config in steps:
        r = results[config]
        r["step_s"] = statistics.median(times[config])
        r["vs_torch"] = r["step_s"] / statistics.median(times[configs[0]]) if configs[0] in steps else None
        r["held_vs_torch"] = r["held_bytes"] / base["held_bytes"] if base.get("held_bytes") else None
        r["peak_vs_torch"] = r["peak_bytes"] / base["peak_bytes"] if base.get("peak_bytes") else None
    real.forget_compiled()
    shape = "x".join(map(str, (inputs["input_ids"] if isinstance(inputs, dict) else inputs).shape))
    return {"model": name, "precision": precision, "input": shape, "results": results}


def environment(device: str) -> dict[str, Any]:
    """Device, driver, torch, date and commit of the run."""
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "python": platform.python_version(), "device": device,
           "relu_ext_build": relu_ext.build_info()}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            env["driver"] = None
        env["cuda"] = torch.version.cuda
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                           cwd=Path(__file__).parent, timeout=30).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        env["git_commit"] = None
    return env


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as text: per case and configuration, held / peak / step vs nn.ReLU and host syncs."""
    lines = [f"{'model':<13} {'precision':<8} {'input':<14} {'configuration':<21} {'held':>6} {'peak':>6} "
             f"{'step':>6} {'syncs':>6} {'step ms':>8}"]
    ratio = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for row in rows:
        for config, r in row["results"].items():
            if "error" in r:
                lines.append(f"{row['model']:<13} {row['precision']:<8} {row['input']:<14} {config:<21} {r['error']}")
                continue
            lines.append(f"{row['model']:<13} {row['precision']:<8} {row['input']:<14} {config:<21} "
                         f"{ratio(r['held_vs_torch']):>6} {ratio(r['peak_vs_torch']):>6} {ratio(r['vs_torch']):>6} "
                         f"{'-' if r['host_syncs_per_step'] is None else r['host_syncs_per_step']:>6} "
                         f"{1000 * r['step_s']:>8.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", metavar="DIR", help="write DIR/gpu_models.json")
    p.add_argument("--cases", help="model:precision[:batch],... (default: " +
                   ",".join(f"{m}:{pr}:{b}" for m, pr, b in CASES) + ")")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"from {CONFIGS}; the first is the baseline")
    p.add_argument("--no-compile", action="store_true", help="leave out compile nn.ReLU")
    p.add_argument("--rounds", type=int, default=5, help="timed steps per configuration, interleaved")
    p.add_argument("--deadline", type=float, default=0, help="seconds: start no case after this (0: none)")
    p.add_argument("--tiny", action="store_true", help="toy sizes: the code path, not figures")
    args = p.parse_args(argv)
    cases = CASES
    if args.cases:
        cases = []
        for text in args.cases.split(","):
            parts = text.split(":")
            if len(parts) not in (2, 3) or parts[1] not in ("float32", "amp"):
                p.error(f"--cases {text!r}: expected model:float32|amp[:batch]")
            cases.append((parts[0], parts[1], int(parts[2]) if len(parts) == 3 else 64))
    configs = [c for c in args.configs.split(",") if not (args.no_compile and c.startswith("compile"))]
    if set(configs) - set(CONFIGS) or not configs:
        p.error(f"--configs {args.configs!r}: choose from {CONFIGS}")
    if args.device == "cuda" and not relu_ext.cuda_available():
        p.error("--device cuda: relu_ext has no CUDA kernels here, or torch sees no GPU")
    start, rows, skipped = time.monotonic(), [], []
    result = {"environment": environment(args.device), "tiny": args.tiny, "configs": configs, "rows": rows,
              "skipped": skipped}
    for name, precision, batch in cases:
        if args.deadline and time.monotonic() - start > args.deadline:
            skipped.append(f"{name}:{precision} (deadline)")
            continue
        print(f"gpu_models: {name} {precision} batch {batch}", file=sys.stderr, flush=True)
        rows.append(run_case(name, precision, batch, args.device, args.tiny, configs, args.rounds))
        write(result, args.out)  # after each case: a run stopped at a time limit keeps what it measured
    write(result, args.out)
    print(table(rows))
    if skipped:
        print("skipped: " + ", ".join(skipped))
    return result


def write(result: dict[str, Any], out: str | None) -> None:
    """OUT/gpu_models.json, where --out was given."""
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_models.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
