"""Real models (torchvision, transformers; random weights, built from configs) under five
memory configurations: the bytes their autograd graph holds after forward, the peak of one
training step, and its time; with models.py's bytes per element, the memory section (run_memory).

Configurations: ``nn.ReLU`` (PyTorch as it is), ``install`` (relu_ext.install(): every ReLU
is relu_ext's), ``install+compact`` (and relu_ext.save_compact(recompute=False) around the
forward: compaction alone), ``install+recompute`` (and relu_ext.save_compact() as it comes:
activation outputs after a BatchNorm rebuilt from it, the others compacted),
``nn.ReLU+compact`` (save_compact(recompute=False) alone, on PyTorch's own ReLU). Compiled (the ``compiled``
section): ``compile nn.ReLU`` (torch.compile of the model as it is) and ``compile relu_ext``
(of a copy whose nn.ReLU modules relu_ext.convert() swapped; the compiler keeps relu_ext's op
as it is, so it fuses nothing into it). install() and save_compact() change nothing in a
compiled graph (it calls no eager ReLU kernel, and saves no ReLU output of eager autograd),
so they have no compiled configuration.

User models (``--model MODULE:CALLABLE --input-shape 2,3,224,224``): CALLABLE() returns the
nn.Module, whose forward takes one floating-point tensor of that shape; it runs under the same
configurations, named in the rows as MODULE:CALLABLE.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import gc
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

import relu_ext

from . import checkpointing, models, peers, timing

# transformers' decoders and encoders, from their configs (transformer()): ReLU (OPT, T5) and not.
TRANSFORMERS = ["opt", "bert", "gpt2", "llama", "gemma"]
MODELS = ["resnet18", "resnet50", "vgg11", "googlenet", "densenet121", "mobilenet_v2", "darknet", "t5_relu",
          *TRANSFORMERS, "vit_tiny", "mlp50"]
# --quick: one CNN, one transformer, at toy sizes; and mlp50, whose saved tensors are small enough that
# save_compact()'s host time per tensor is its hooks' own cost, not their kernels'.
QUICK_MODELS = ["resnet18", "t5_relu", "mlp50"]
# Variants of TRANSFORMERS, named "<model>@<variant>" (--models): the float32 model run under bfloat16
# autocast, and with eager attention (transformers' own softmax and matmuls) where the others use SDPA.
VARIANTS = ("autocast", "eager")
VARIANT_MODELS = [f"{name}@{variant}" for name in TRANSFORMERS for variant in VARIANTS]
# The memory section's configurations, the last what users pick instead of save_compact() in eager
# mode, op-level selective checkpointing: its step timed in the same interleaved rounds as the others.
CONFIGS = ["nn.ReLU", "install", "install+compact", "install+recompute", "nn.ReLU+compact", "sac nn.ReLU"]
# What users pick instead when they compile: torch.compile, as it is and with relu_ext's modules.
COMPILED_CONFIGS = ["compile nn.ReLU", "compile relu_ext"]
# How long hook_us() times steps of one configuration, 3 at least, and the most steps it times.
HOOK_BUDGET_S, HOOK_STEPS = 1.0, 200
# The package each built-in model needs beyond torch (None: built here); the others need torchvision.
NEEDS = {"darknet": None, "mlp50": None, "t5_relu": "transformers", **dict.fromkeys(TRANSFORMERS, "transformers"), "vit_tiny": "timm"}
# Images (tokens: rows of 256 or 128; mlp50: rows of 64) per batch at 112x112 (64x64 with --quick): what this
# 2-core machine steps through in about a second (mlp50: its hooks' cost).
BATCH = {"resnet18": 16, "resnet50": 8, "vgg11": 8, "googlenet": 16, "densenet121": 8, "mobilenet_v2": 16,
         "darknet": 16, "t5_relu": 8, **dict.fromkeys(TRANSFORMERS, 4), "vit_tiny": 8, "mlp50": 128}


class UserModelError(ValueError):
    """A --model that cannot be benchmarked; the message is one line for the user."""


def missing(name: str) -> str | None:
    """Why a built-in model cannot run here (the package it needs does not import), or None."""
    package = NEEDS.get(name.partition("@")[0], "torchvision")
    if package is None or is_user_model(name):
        return None
    try:
        importlib.import_module(package)
    except ModuleNotFoundError as err:
        if err.name == package:
            return f"{package} is not installed"
        return f"{package} cannot be imported: {_one_line(err)}"
    except Exception as err:  # a broken install (say, built for another torch) fails in many ways
        return f"{package} cannot be imported: {_one_line(err)}"
    return None


def is_user_model(name: str) -> bool:
    """A --model MODULE:CALLABLE (the built-in names have no colon)."""
    return ":" in name


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


def load_user_model(target: str) -> nn.Module:
    """The nn.Module that MODULE:CALLABLE returns; MODULE is importable or a path to a .py file,
    CALLABLE an attribute of it (dots for nested ones), called with no arguments."""
    module_name, _, attr = target.rpartition(":")  # rpartition: a path may hold a drive's colon
    if not module_name or not attr:
        raise UserModelError(f"--model {target}: expected MODULE:CALLABLE, e.g. mypackage.models:build")
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise FileNotFoundError(f"no file {module_name}")
            spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # dataclasses and pickling look classes up there
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as err:
        raise UserModelError(f"--model {target}: cannot import {module_name}: {_one_line(err)}") from None
    try:
        build = functools.reduce(getattr, attr.split("."), module)
    except AttributeError:
        raise UserModelError(f"--model {target}: {module_name} has no attribute {attr!r}") from None
    if not callable(build):
        raise UserModelError(f"--model {target}: {attr} is of type {type(build).__name__}, not callable")
    try:
        model = build()
    except Exception as err:
        raise UserModelError(f"--model {target}: {attr}() failed: {_one_line(err)}") from None
    if not isinstance(model, nn.Module):
        raise UserModelError(f"--model {target}: {attr}() returned a value of type {type(model).__name__}, "
                             "not a torch.nn.Module")
    return model


def check_user_model(target: str, shape: Sequence[int], device: str) -> None:
    """Builds the model and runs one forward (training mode, float32, no grad), so that a model
    that cannot run fails here with one line rather than in a worker process."""
    model = load_user_model(target).to(device).train()
    try:
        with torch.no_grad():
            out = model(torch.randn(*shape, device=device))
    except Exception as err:
        raise UserModelError(f"--model {target}: a forward on a float32 input of shape "
                             f"{'x'.join(map(str, shape))} failed: {_one_line(err)}") from None
    if not isinstance(out, Tensor) or not out.is_floating_point():
        what = f"a {out.dtype} tensor" if isinstance(out, Tensor) else f"a {type(out).__name__}"
        raise UserModelError(f"--model {target}: its forward returned {what}; the benchmark needs a floating-point "
                             f"tensor (its loss is the output's mean square)")


def darknet(width: int = 32, classes: int = 1000) -> nn.Sequential:
    """A darknet-style CNN (conv -> BatchNorm -> LeakyReLU(0.1), 3x3 / 1x1 bottlenecks, max-pools),
    built here so that the benchmark needs no model package for it."""

    def block(c_in: int, c_out: int, k: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, k, padding=k // 2, bias=False), nn.BatchNorm2d(c_out), nn.LeakyReLU(0.1)]

    layers: list[nn.Module] = []
    c = 3
    for i, w in enumerate([width, 2 * width, 4 * width, 8 * width, 16 * width]):
        layers += block(c, w, 3)
        if i >= 2:  # 3x3 -> 1x1 -> 3x3, as darknet-19
            layers += block(w, w // 2, 1) + block(w // 2, w, 3)
        if i < 4:
            layers.append(nn.MaxPool2d(2))
        c = w
    layers += [nn.Conv2d(c, classes, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return nn.Sequential(*layers)


def build(name: str, dtype: torch.dtype, device: str, quick: bool,
          shape: Sequence[int] | None = None) -> tuple[nn.Module, Any]:
    """(model in training mode, its inputs), random weights, seeded; `shape`: a user model's input."""
    torch.manual_seed(0)
    if is_user_model(name):
        model = load_user_model(name)
        inputs = torch.randn(*shape, dtype=dtype, device=device)
    elif name == "t5_relu":
        import transformers

        width = 64 if quick else 256
        config = transformers.T5Config(
            vocab_size=512, d_model=width, d_kv=width // 8, d_ff=4 * width, num_layers=2 if quick else 4,
            num_decoder_layers=2 if quick else 4, num_heads=8, feed_forward_proj="relu", dropout_rate=0.1,
            decoder_start_token_id=0, pad_token_id=0,
        )
        model = transformers.T5ForConditionalGeneration(config)
        batch, length = (2, 16) if quick else (BATCH[name], 128)
        g = torch.Generator().manual_seed(0)
        inputs = {"input_ids": torch.randint(1, 512, (batch, length), generator=g).to(device),
                  "labels": torch.randint(1, 512, (batch, length), generator=g).to(device)}
    elif name.partition("@")[0] in TRANSFORMERS:
        base, _, variant = name.partition("@")
        model = transformer(base, 64 if quick else 256, "eager" if variant == "eager" else "sdpa")
        model = Autocast(model) if variant == "autocast" else model
        batch, length = (2, 16) if quick else (BATCH[base], 256)
        ids = torch.randint(1, 1024, (batch, length), generator=torch.Generator().manual_seed(0)).to(device)
        inputs = {"input_ids": ids, "labels": ids}
    elif name == "vit_tiny":
        import timm

        side = 64 if quick else 224
        model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=side)
        inputs = torch.randn(2 if quick else BATCH[name], 3, side, side, dtype=dtype, device=device)
    elif name == "mlp50":  # 50 x (Linear(64, 64) -> ReLU): 149 small saved tensors a step
        model = nn.Sequential(*(m for _ in range(50) for m in (nn.Linear(64, 64), nn.ReLU())))
        inputs = torch.randn(BATCH[name], 64, dtype=dtype, device=device)
    elif name == "darknet":
        model = darknet(16 if quick else 32)
        batch, side = (2, 64) if quick else (BATCH[name], 112)
        inputs = torch.randn(batch, 3, side, side, dtype=dtype, device=device)
    else:
        import torchvision

        kwargs = {"aux_logits": False, "init_weights": True} if name == "googlenet" else {}
        model = getattr(torchvision.models, name)(weights=None, **kwargs)
        batch, side = (2, 64) if quick else (BATCH[name], 112)
        inputs = torch.randn(batch, 3, side, side, dtype=dtype, device=device)
    return model.to(device=device, dtype=dtype).train(), inputs


def transformer(name: str, width: int, attention: str = "sdpa") -> nn.Module:
    """One of TRANSFORMERS, from transformers' config with random weights: 2 layers of `width` (4 heads,
    feed-forward 4 x `width`, Llama's and Gemma's 2.7 x, as theirs), a vocabulary of 1024, each
    family's own activation, norm and default dropout; `attention`: transformers' attn_implementation."""
    import transformers as tf

    ffn = 4 * width
    common = {"vocab_size": 1024, "attn_implementation": attention}
    if name == "opt":  # ReLU, LayerNorm
        return tf.OPTForCausalLM(tf.OPTConfig(hidden_size=width, num_hidden_layers=2, ffn_dim=ffn,
                                              num_attention_heads=4, max_position_embeddings=256,
                                              word_embed_proj_dim=width, **common))
    if name == "bert":  # GELU, LayerNorm
        return tf.BertForMaskedLM(tf.BertConfig(hidden_size=width, num_hidden_layers=2, intermediate_size=ffn,
                                                num_attention_heads=4, max_position_embeddings=256, **common))
    if name == "gpt2":  # GELU's tanh formula in Python, LayerNorm
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=width, n_layer=2, n_head=4, n_positions=256,
                                                bos_token_id=1, eos_token_id=1, **common))
    ffn = (ffn * 2 // 3 + 15) // 16 * 16
    if name == "llama":  # SwiGLU, RMSNorm in Python
        return tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=width, num_hidden_layers=2, intermediate_size=ffn,
                                                  num_attention_heads=4, num_key_value_heads=4,
                                                  max_position_embeddings=256, **common))
    if name == "gemma":  # GeGLU (GELU's tanh approximation), RMSNorm in Python
        return tf.GemmaForCausalLM(tf.GemmaConfig(hidden_size=width, num_hidden_layers=2, intermediate_size=ffn,
                                                  num_attention_heads=4, num_key_value_heads=4, head_dim=width // 4,
                                                  max_position_embeddings=256, **common))
    raise ValueError(f"unknown transformer {name!r}; choose from {TRANSFORMERS}")


class Autocast(nn.Module):
    """A model (in float32) whose forward runs under autocast to bfloat16 on its inputs' device: mixed
    precision as people train with it (a transformers model's ``@autocast`` variant)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **inputs: Tensor) -> Any:
        device = next(iter(inputs.values())).device.type
        with torch.autocast(device, torch.bfloat16):
            return self.model(**inputs)

    @property
    def supports_gradient_checkpointing(self) -> bool:
        """The model's (selective checkpointing checkpoints its layers, see checkpointing.selective)."""
        return bool(getattr(self.model, "supports_gradient_checkpointing", False))

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        """The model's."""
        self.model.gradient_checkpointing_enable(**kwargs)


def describe(name: str, inputs: Any) -> str:
    """The input, for the table: batch x 3 x side^2, batch x tokens, or a user model's (mlp50's) whole shape."""
    if is_user_model(name) or name == "mlp50":
        return "x".join(map(str, inputs.shape))
    if isinstance(inputs, dict):
        b, n = inputs["input_ids"].shape
        return f"{b}x{n} tok"
    b, _, h, w = inputs.shape
    return f"{b}x{h}x{w}"


def loss_of(model: nn.Module, inputs: Any) -> Tensor:
    if isinstance(inputs, dict):
        return model(**inputs).loss
    return model(inputs).float().square().mean()


def saving(config: str) -> relu_ext.save_compact | None:
    """The save_compact() a configuration's forward runs under, or None."""
    if config.endswith("+recompute"):
        return relu_ext.save_compact()
    if config.endswith("+compact"):
        return relu_ext.save_compact(recompute=False)
    return None


def installing(config: str) -> Callable[[], Any]:
    """What a configuration's blocks run under: install() (process-wide) or nothing."""
    return relu_ext.install if config.startswith("install") else contextlib.nullcontext


def held_bytes(model: nn.Module, inputs: Any, config: str, counts: dict[str, int] | None = None) -> int:
    """Bytes of the distinct storages the graph holds after forward (parameters, copies of them,
    buffers and inputs aside), counted from what the saved-tensor hooks keep: exact, whatever the
    allocator.
    A copy of a parameter (the same shape, dtype and values in another storage: Inductor keeps
    channels-last copies of conv weights) is left out as the parameter is, so that eager and compiled
    graphs count the same thing, their activations. `counts` gets what a configuration's
    save_compact() did (replayed, replay_misses, compacted, concatenated, pooled, remade, narrowed, two_valued, kept).
    Under selective checkpointing (``sac nn.ReLU``), whose saved outputs no hook sees: what the forward
    leaves allocated (checkpointing.allocated_bytes; 0 where that cannot be read)."""
    if config == "sac nn.ReLU":
        return _allocated_by_forward(model, inputs)
    skip = {p.untyped_storage().data_ptr() for p in (*model.parameters(), *model.buffers())}  # (running statistics)
    skip |= {t.untyped_storage().data_ptr() for t in (inputs.values() if isinstance(inputs, dict) else [inputs])}
    params: dict[tuple[Any, ...], list[Tensor]] = {}
    for p in model.parameters():
        params.setdefault((p.shape, p.dtype, p.device), []).append(p.detach())
    seen: dict[int, int] = {}

    def record(tensors: tuple[Tensor, ...]) -> None:
        for t in tensors:
            s = t.untyped_storage()
            if s.data_ptr() in skip:
                continue
            like = params.get((t.shape, t.dtype, t.device), [])
            if any(torch.equal(t, p) for p in like):
                skip.add(s.data_ptr())
                continue
            seen[s.data_ptr()] = s.nbytes()

    inner = saving(config)
    packed: list[Any] = []
    if inner is not None:
        pack = inner.pack_hook
        inner.pack_hook = lambda t: packed.append(pack(t)) or packed[-1]
        hooks = inner  # (its exit settles what it keeps: counted after it)
    else:
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: record((t,)) or t, lambda t: t)
    torch.manual_seed(1)
    with installing(config)(), hooks:
        loss = loss_of(model, inputs)
    for p in packed:
        record(p.held())
    del loss, packed
    if inner is not None and counts is not None:
        counts.update(compact_counts(inner))
    return sum(seen.values())


def _allocated_by_forward(model: nn.Module, inputs: Any) -> int:
    """Bytes a training forward of `model` leaves allocated (on the CPU; CUDA: its allocator's), its
    loss aside: what its graph holds."""
    cuda = any(t.is_cuda for t in (inputs.values() if isinstance(inputs, dict) else [inputs]))
    measure = torch.cuda.memory_allocated if cuda else checkpointing.allocated_bytes
    torch.manual_seed(1)
    gc.collect()  # (and none during the forward: garbage of earlier steps freed there made the count fall)
    gc.disable()
    try:
        before = measure()
        if before is None:
            return 0
        loss = loss_of(model, inputs)
        held = measure() - before - loss.untyped_storage().nbytes()
    finally:
        gc.enable()
    del loss
    return max(held, 0)


class HookTimer:
    """save_compact()'s hooks, timed: the host time spent in them (``spent``, seconds) and the
    tensors packed (``saved``), over the steps run under ``wrap(sc)``."""

    def __init__(self) -> None:
        self.spent, self.saved = 0.0, 0
        self._pack: Callable[[Tensor], Any] = lambda t: t
        self._unpack: Callable[[Any], Tensor] = lambda t: t

    def wrap(self, sc: relu_ext.save_compact) -> relu_ext.save_compact:
        """`sc`, its hooks timed by this (set before it is entered, as held_bytes does). Its packer
        takes the timed unpack hook as its own: a recipe reads what the block saved as it is by the
        unpack hook autograd holds (``SavedTensor.unpack_hook is``), so that the timed block makes
        the forms the untimed one does."""
        self._pack, self._unpack = sc.pack_hook, sc.unpack_hook
        sc.pack_hook = self.pack
        sc.unpack_hook = sc._packer.unpack = self.unpack
        return sc

    def pack(self, t: Tensor) -> Any:
        start = time.perf_counter()
        packed = self._pack(t)
        self.spent += time.perf_counter() - start
        self.saved += 1
        return packed

    def unpack(self, packed: Any) -> Tensor:
        start = time.perf_counter()
        t = self._unpack(packed)
        self.spent += time.perf_counter() - start
        return t


def hook_us(model: nn.Module, inputs: Any, config: str, rounds: int = 3,
            budget_s: float = HOOK_BUDGET_S) -> float | None:
    """Host time in a configuration's save_compact() hooks per tensor saved for backward, pack and
    unpack together, in µs: the best of at least `rounds` training steps, more while they take less
    than `budget_s` in all (at most HOOK_STEPS): a step of a few ms (mlp50's) is noise-bound at 3.
    The hooks' own cost, which a GPU waits for where the host falls behind. None for a configuration
    without save_compact()."""
    if saving(config) is None:
        return None
    best, done, start = float("inf"), 0, time.perf_counter()
    while done < rounds or (time.perf_counter() - start < budget_s and done < HOOK_STEPS):
        timer = HookTimer()
        torch.manual_seed(1)
        with installing(config)():
            with timer.wrap(saving(config)):
                loss = loss_of(model, inputs)
            loss.backward()
        model.zero_grad(set_to_none=True)
        best = min(best, timer.spent / max(timer.saved, 1) * 1e6)
        done += 1
    return best


def compact_counts(sc: relu_ext.save_compact) -> dict[str, int]:
    """What a save_compact() did, as the results record it."""
    return dict(replayed=sc.replayed, replay_misses=sc.replay_misses, compacted=sc.compacted,
                concatenated=sc.concatenated, pooled=sc.pooled, remade=sc.remade, narrowed=sc.narrowed,
                two_valued=sc.two_valued, kept=sc.kept)


def prepare(model: nn.Module, config: str, backend: str = "inductor") -> nn.Module:
    """What a configuration runs: the model itself, torch.compile of it (``compile relu_ext``: of a
    copy, same weights, with relu_ext.convert()'s modules), or (``sac nn.ReLU``) a copy, same weights,
    with its blocks under selective checkpointing (checkpointing.selective)."""
    if config == "sac nn.ReLU":
        return checkpointing.selective(copy.deepcopy(model))
    if not config.startswith("compile "):
        return model
    if config == "compile relu_ext":
        model = relu_ext.convert(copy.deepcopy(model))
    return torch.compile(model, backend=backend)


def step_fn(model: nn.Module, inputs: Any, config: str) -> Callable[[], Tensor]:
    """One training step (forward under the configuration, backward, SGD), for the timer."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> Tensor:
        opt.zero_grad(set_to_none=False)
        with saving(config) or contextlib.nullcontext():
            loss = loss_of(model, inputs)
        loss.backward()
        opt.step()
        return loss

    step.context = installing(config)  # type: ignore[attr-defined]  (see timing.Sampler)
    return step


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{field} not in /proc/self/status")


def peak_of(step: Callable[[], Tensor], device: str) -> dict[str, Any]:
    """The peak memory of one call of `step` above what was live before it.

    CUDA: torch.cuda.max_memory_allocated. CPU: growth of the resident-set
    high-water mark (VmHWM, reset through /proc/self/clear_refs); the caller
    tells glibc to mmap every block of 64 KiB or more, so that freed tensors
    leave the process at once and the RSS follows the live tensors.
    """
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return {"peak_bytes": torch.cuda.max_memory_allocated() - before, "peak_method": "torch.cuda.max_memory_allocated"}
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        before = _rss_bytes("VmRSS")
        step()
        # Linux syncs per-thread RSS counters every 64 page faults, so the
        # figures are good to about 256 KiB per thread: tiny models can read
        # slightly below zero, which means "below resolution".
        return {"peak_bytes": max(0, _rss_bytes("VmHWM") - before),
                "peak_method": "VmHWM growth (resolution ~256 KiB), glibc mmap threshold 64 KiB"}
    except OSError as err:
        return {"peak_bytes": None, "peak_method": f"unavailable: {err}"}


def peak_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """In this (fresh) process, for one configuration: the peak of one training step of each
    model and dtype above what was live before it (peak_of)."""
    device, config, quick = spec["device"], spec["config"], spec["quick"]
    # The parent's import path, after this process's own: where the parent found a user's module.
    sys.path.extend(p for p in spec.get("path", []) if p not in sys.path)
    if device == "cpu":
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: freed tensors leave at once
    out: dict[str, Any] = {}
    for name in spec["models"]:
        for dtype in spec["dtypes"]:
            model, inputs = build(name, getattr(torch, dtype), device, quick, spec.get("shapes", {}).get(name))
            model = prepare(model, config, spec["backend"])
            step = step_fn(model, inputs, config)
            with step.context():
                step()  # gradients exist from here on (and a compiled model is compiled)
                out[f"{name}/{dtype}"] = peak_of(step, device)
            del model, inputs, step
            forget_compiled()
    return out


def forget_compiled() -> None:
    """Drops the compiled code of the model just measured, so the next one starts clean. Without a
    compiled configuration torch._dynamo was never imported (and importing it takes seconds)."""
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """peak_worker(spec) in a fresh process (`python -m relu_ext.bench --peak-worker SPEC`)."""
    out = subprocess.run([sys.executable, "-m", "relu_ext.bench", "--peak-worker", json.dumps(spec)],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"memory peak worker for {spec['config']} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(device: str, dtypes: list[torch.dtype], names: list[str], quick: bool, rounds: int, budget_s: float,
        max_spread: float, progress: timing.Progress, configs: list[str] = CONFIGS,
        backend: str = "inductor", shapes: dict[str, list[int]] | None = None) -> list[dict[str, Any]]:
    """One row per model and dtype: held bytes, peak and step time of each configuration,
    and each vs the first configuration's (nn.ReLU, or compile nn.ReLU). Step times run
    interleaved in rounds; peaks come from one fresh process per configuration.
    `shapes`: the input shape of each user model (MODULE:CALLABLE) among `names`."""
    if not names:
        return []
    shapes = shapes or {}
    peaks = {}
    for config in configs:
        progress.step(f"memory peak {config}")
        peaks[config] = run_worker({"device": device, "config": config, "quick": quick, "models": names,
                                    "backend": backend, "dtypes": [peers.dtype_name(d) for d in dtypes],
                                    "shapes": shapes, "path": sys.path})
    base = configs[0]
    rows = []
    for name in names:
        for dtype in dtypes:
            model, inputs = build(name, dtype, device, quick, shapes.get(name))
            key = f"{name}/{peers.dtype_name(dtype)}"
            run_as = {config: prepare(model, config, backend) for config in configs}
            held, counts = {}, {config: {} for config in configs}
            for config in configs:
                progress.step(f"memory held {key} {config}")
                held[config] = held_bytes(run_as[config], inputs, config, counts[config])
            # (--quick: a smoke run of toy sizes, whose hook time is no figure to keep: 3 steps.)
            hooks = {config: hook_us(run_as[config], inputs, config, budget_s=0.0 if quick else HOOK_BUDGET_S)
                     for config in configs}
            steps = {config: step_fn(run_as[config], inputs, config) for config in configs}
            samples = timing.interleave(steps, device, rounds, budget_s, lambda c: progress.step(f"memory time {key} {c}"))
            results = {}
            for config in configs:
                r = timing.summarize(samples[config], max_spread)
                r.update(held_bytes=held[config], held_vs_torch=held[config] / held[base],
                         vs_torch=timing.paired(samples[config], samples[base]), **peaks[config][key])
                if counts[config]:
                    r["save_compact"] = counts[config]
                if hooks[config] is not None:
                    r["hook_us_per_saved"] = hooks[config]
                first = peaks[base][key]["peak_bytes"]
                r["peak_vs_torch"] = r["peak_bytes"] / first if first and r["peak_bytes"] is not None else None
                results[config] = r
            rows.append({"model": name, "dtype": peers.dtype_name(dtype), "input": describe(name, inputs),
                         "results": results})
            del model, inputs, run_as, steps
            forget_compiled()
    return rows


def run_memory(device: str, dtypes: list[torch.dtype], impls: list[str], names: list[str], quick: bool, rounds: int,
               budget_s: float, max_spread: float, progress: timing.Progress,
               shapes: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """Bytes saved per element of one activation for each dtype and implementation, and the
    real models' held bytes, peak and step time under each memory configuration (run();
    `shapes`: the input shape of each user model among `names`)."""
    per_element = []
    for dtype in dtypes:
        progress.step(f"memory saved bytes {peers.dtype_name(dtype)}")
        per_element.append({"dtype": peers.dtype_name(dtype),
                            "bytes_per_element": models.saved_bytes_per_element(device, dtype, impls)})
    rows = run(device, dtypes, names, quick, rounds, budget_s, max_spread, progress, shapes=shapes)
    return {"saved_per_element": per_element, "models": rows}


def vs_eager(compiled: list[dict[str, Any]], eager: list[dict[str, Any]]) -> None:
    """Gives each compiled configuration its held bytes vs eager nn.ReLU's (``held_vs_eager``) where
    the memory section of the same run measured that model and dtype: what a user choosing between
    compiling and eager relu_ext compares (held bytes are counted exactly, so the ratio is too)."""
    base = {(r["model"], r["dtype"]): r["results"][CONFIGS[0]]["held_bytes"] for r in eager}
    for row in compiled:
        held = base.get((row["model"], row["dtype"]))
        for m in row["results"].values():
            m["held_vs_eager"] = m["held_bytes"] / held if held else None


def steps(dtypes: int, models: int, configs: int, rounds: int) -> int:
    """Progress steps of run()."""
    return (configs + models * dtypes * configs * (1 + rounds)) if models else 0
