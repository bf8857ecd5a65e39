"""Random nets, PyTorch against relu_ext: small CNNs and transformer stacks drawn from a table of blocks
(each a pattern some form of save_compact() takes, or one that none takes), on data with ±0,
denormals and values at the activations' thresholds, in four float dtypes and two layouts. A
training step under ``install()`` + ``save_compact()`` (and its variants) gives the loss, the output
and every gradient bit for bit as plain PyTorch does; ``save_compact()`` alone does on data with
NaN and ±inf too (with ``install()``, a NaN reaching hardtanh's gradient or a 16-bit NaN payload
follows PyTorch's scalar loop, not its vectorized one: docs/design.md, tests/activations). The
targeted tests check each form on its own; these check the forms in the orders and mixes a model
puts them in."""

from __future__ import annotations

import math
import random
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import relu_ext
from conftest import assert_bitwise_equal

pytestmark = [pytest.mark.native, pytest.mark.torch_version]  # the risks it checks: see tests/tiers.py

# The activations a block draws from (PyTorch's functions: install() routes them to relu_ext's kernels).
ACTS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu, "relu6": F.relu6, "leaky_relu": lambda x: F.leaky_relu(x, 0.1),
    "hardtanh": lambda x: F.hardtanh(x, 0.0, 2.0), "threshold": lambda x: F.threshold(x, 0.25, 0.0),
    "hardsigmoid": F.hardsigmoid, "relu_": lambda x: F.relu(x * 1.0, inplace=True),
}


class Act(nn.Module):
    """One activation of ACTS, by name."""

    def __init__(self, rng: random.Random, width: int) -> None:
        super().__init__()
        self.name = rng.choice(sorted(ACTS))

    def forward(self, x: Tensor) -> Tensor:
        return ACTS[self.name](x)


class ConvBnAct(nn.Module):
    """Conv, BatchNorm, activation: the activation's output is replayed from the BatchNorm's input."""

    def __init__(self, rng: random.Random, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1, bias=rng.random() < 0.5)
        self.bn, self.act = nn.BatchNorm2d(width), Act(rng, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.bn(self.conv(x)))


class Residual(nn.Module):
    """A ResNet block: BatchNorm, add of the block's input, ReLU (a residual replay)."""

    def __init__(self, rng: random.Random, width: int) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn(self.conv(x)) + x)


class Dense(nn.Module):
    """A DenseNet block of three layers, each on the concatenation of what came before, then back to
    `width` channels (concatenations kept in pieces)."""

    def __init__(self, rng: random.Random, width: int) -> None:
        super().__init__()
        self.bns = nn.ModuleList(nn.BatchNorm2d(width * (i + 1)) for i in range(3))
        self.convs = nn.ModuleList(nn.Conv2d(width * (i + 1), width, 3, padding=1, bias=False) for i in range(3))
        self.out = nn.Conv2d(width * 4, width, 1)

    def forward(self, x: Tensor) -> Tensor:
        features = [x]
        for bn, conv in zip(self.bns, self.convs):
            features.append(conv(F.relu(bn(torch.cat(features, 1)))))
        return self.out(torch.cat(features, 1))


class PoolAct(nn.Module):
    """Activation, then a stride-1 max-pool whose output the next conv keeps (a pooled recipe)."""

    def __init__(self, rng: random.Random, width: int) -> None:
        super().__init__()
        self.act, self.conv = Act(rng, width), nn.Conv2d(width, width, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.max_pool2d(self.act(x), 3, 1, 1))


class Gate(nn.Module):
    """Squeeze-and-excitation-like: x times sigmoid of a 1x1 conv of it (remade mul and sigmoid)."""

    def __init__(self, rng: random.Random, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 1)

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(self.conv(x))


class Dropout(nn.Module):
    """Dropout in training mode (its noise kept as a bitmap)."""

    def __init__(self, rng: random.Random, width: int) -> None:
        super().__init__()
        self.p = rng.choice([0.1, 0.5])

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, True)


class ChannelsLast(nn.Module):
    """The rest of the net in channels_last."""

    def __init__(self, rng: random.Random, width: int) -> None:
        super().__init__()

    def forward(self, x: Tensor) -> Tensor:
        return x.contiguous(memory_format=torch.channels_last)


class Mlp(nn.Module):
    """Linear, activation (GELU of either approximation, SiLU or one of ACTS), Linear."""

    def __init__(self, rng: random.Random, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width, bias=rng.random() < 0.5)
        self.act = rng.choice([F.gelu, lambda x: F.gelu(x, approximate="tanh"), F.silu, Act(rng, width)])

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.act(self.up(x)))


class SwiGlu(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, rng: random.Random, width: int) -> None:
        super().__init__()
        self.gate, self.up, self.down = (nn.Linear(width, width, bias=False) for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GeluNew(nn.Module):
    """GPT-2's GELU in Python (a chain of pow, mul, add, tanh), then a Linear."""

    def __init__(self, rng: random.Random, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        y = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
        return self.linear(y)


class LayerNorm(nn.Module):
    """LayerNorm (with or without its affine terms), then a Linear that keeps its output."""

    def __init__(self, rng: random.Random, width: int) -> None:
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(width, elementwise_affine=rng.random() < 0.7), nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(self.norm(x))


class RmsNorm(nn.Module):
    """HF's RMSNorm in Python (float32, pow, mean, add, rsqrt, mul, cast back, weight), then a Linear."""

    def __init__(self, rng: random.Random, width: int) -> None:
        super().__init__()
        self.weight, self.linear = nn.Parameter(torch.ones(width) + 0.1 * torch.randn(width)), nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.linear(self.weight * h.to(x.dtype))


class Attention(nn.Module):
    """Causal self-attention through SDPA, with a residual add."""

    def __init__(self, rng: random.Random, width: int) -> None:
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(width, 3 * width), nn.Linear(width, width), 2

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in self.qkv(x).split(d, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, t, d))


class Scaled(nn.Module):
    """A division by a number and an add of one (remade with the number found)."""

    def __init__(self, rng: random.Random, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x / 3.0 + 0.5) * x


CNN_BLOCKS = [ConvBnAct, Residual, Dense, PoolAct, Gate, Dropout, ChannelsLast, Act]
TRANSFORMER_BLOCKS = [Mlp, SwiGlu, GeluNew, LayerNorm, RmsNorm, Attention, Scaled, Dropout, Act]


class Net(nn.Module):
    """Blocks drawn from a table by `rng`, the first one of `first` (so that every net has a form-making
    pattern), on inputs of `width` channels or features."""

    def __init__(self, rng: random.Random, blocks: list[type[nn.Module]], first: type[nn.Module], width: int) -> None:
        super().__init__()
        kinds = [first, *(rng.choice(blocks) for _ in range(rng.randint(2, 6)))]
        rng.shuffle(kinds)
        self.blocks = nn.Sequential(*(kind(rng, width) for kind in kinds))

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks(x)


# The values at which an activation's output or gradient turns (thresholds, bounds), and ±0, denormals.
_EDGES = [0.0, -0.0, 0.25, 2.0, 3.0, -3.0, 6.0, 1e-40, -1e-40, 1e-310]
_NON_FINITE = [math.nan, -math.nan, math.inf, -math.inf]


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int, finite: bool) -> Tensor:
    """Normal data with one element in 16 set to one of _EDGES (as `dtype` rounds it); where not
    `finite`, also three set to values of _NON_FINITE (few: a NaN spreads through each layer it meets)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    edges = torch.tensor(_EDGES, dtype=torch.float64)
    pick = torch.randint(0, 16, shape, generator=g) == 0
    x = torch.where(pick, edges[torch.randint(0, len(edges), shape, generator=g)], x)
    if not finite:
        at = torch.randint(0, x.numel(), (3,), generator=g)
        x.view(-1)[at] = torch.tensor(_NON_FINITE, dtype=torch.float64)[torch.randint(0, 4, (3,), generator=g)]
    return x.to(dtype)


def _step(net: Net, x: Tensor, config: str, seed: int) -> tuple[list[Tensor], relu_ext.save_compact | None]:
    """One training step of `net` on `x` under `config`: the loss, the output, the input's gradient and
    the parameters' (in order), and the save_compact context where there is one."""
    net.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # (dropout's noise)
    x = x.detach().requires_grad_(True)
    sc = None if config == "plain" else relu_ext.save_compact(recompute=config != "install+compact")
    installation = relu_ext.install() if config.startswith("install") else None
    try:
        if sc is None:
            y = net(x)
        else:
            with sc:
                y = net(x)
        weights = torch.linspace(-1.0, 1.0, y.numel(), dtype=torch.float64).view(y.shape)
        loss = (y.double() * weights).sum()
        loss.backward()
    finally:
        if installation is not None:
            relu_ext.uninstall()
    return [loss, y, x.grad, *(p.grad for p in net.parameters())], sc


# Each configuration, and whether its data is finite in the transformer nets (in the CNNs it always
# is: a BatchNorm's batch statistics would spread one NaN over its whole channel).
CONFIGS = {"nn+recompute": False, "install+recompute": True, "install+compact": True}
# Groups of seeds: the quick tier runs the first of each kind, CI's --rest leg the others.
GROUPS = range(8)
SEEDS_PER_GROUP = 8


@pytest.mark.quick(cover=("kind",))
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("kind", ["cnn", "transformer"])
def test_random_nets_train_bit_for_bit(kind: str, group: int) -> None:
    """Each net of the group, under each configuration, gives PyTorch's loss, output and gradients bit
    for bit; and the group as a whole reaches the forms its blocks are there for."""
    used: set[str] = set()
    for seed in range(group * SEEDS_PER_GROUP, (group + 1) * SEEDS_PER_GROUP):
        rng = random.Random(f"{kind} {seed}")
        torch.manual_seed(seed)
        if kind == "cnn":
            dtype = rng.choice([torch.float32, torch.float32, torch.float64, torch.bfloat16])
            width = rng.choice([8, 12])  # (at least 4096 elements a tensor: what save_compact takes)
            net = Net(rng, CNN_BLOCKS, [ConvBnAct, Dense, PoolAct][seed % 3], width).to(dtype)
            shape: tuple[int, ...] = (2, width, rng.choice([16, 20]), 16)
        else:
            dtype = rng.choice([torch.float32, torch.float32, torch.float64, torch.bfloat16, torch.float16])
            width = rng.choice([32, 64])
            net = Net(rng, TRANSFORMER_BLOCKS, [SwiGlu, LayerNorm, GeluNew][seed % 3], width).to(dtype)
            shape = (2, 64, width)
        data = {True: _inputs(shape, dtype, seed, finite=True)}
        if kind == "transformer":
            data[False] = _inputs(shape, dtype, seed, finite=False)
        wants = {finite: _step(net, x, "plain", seed)[0] for finite, x in data.items()}
        for config, finite in CONFIGS.items():
            finite = finite or kind == "cnn"
            got, sc = _step(net, data[finite], config, seed)
            want = wants[finite]
            what = f"{kind} seed {seed} ({dtype}, {config}; {[type(b).__name__ for b in net.blocks]})"
            for i, (a, e) in enumerate(zip(got, want, strict=True)):
                if e is None:
                    assert a is None, f"{what}: gradient {i} is None in PyTorch's step"
                else:
                    assert_bitwise_equal(a, e, f"{what}: {['loss', 'output', 'input grad'][i] if i < 3 else f'grad {i}'}")
            counts = {"compacted": sc.compacted, "replayed": sc.replayed, "concatenated": sc.concatenated,
                      "pooled": sc.pooled, "remade": sc.remade, "two_valued": sc.two_valued}
            used |= {form for form, n in counts.items() if n}
    want_forms = {"compacted", "replayed", "concatenated", "pooled"} if kind == "cnn" else {"compacted", "remade"}
    assert want_forms <= used, f"the {kind} nets of group {group} made no {sorted(want_forms - used)}"
