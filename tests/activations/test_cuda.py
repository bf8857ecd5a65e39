"""CUDA-only checks (issue 10) that the device-parametrized suite does not make.

Already covered on CUDA through ``conftest.DEVICES`` (run wherever a GPU is
visible): every float dtype and the integer dtypes, sizes 0, 1, 31, 33, 1023,
4097 and 1,000,003, unaligned ``x[1:]``, channels_last and the other layouts
of ``conftest.layouts``, in place, gradients against ``torch.relu``,
opcheck, the transforms, the conv net and ``torch.compile`` (inductor).

Added here, for a GPU only:
- the CUDA kernels against relu_ext's CPU kernels, bit for bit (values, mask
  bytes, gradients), at every tile boundary of the vector kernels and at a size
  that needs several passes of the grid-stride loops, aligned and unaligned,
  with outputs written into poisoned memory (an unwritten element shows);
- a side stream (work must follow the current stream, not the default one);
- CUDA graph capture and replay with new data (ops, in place, autograd);
- ``torch.compile(mode="reduce-overhead")`` (inductor + CUDA graphs);
- the device guard on a second GPU (skipped with one GPU);
- tensors of more than 2^31 elements on the GPU (bfloat16 and int8);
- relu(-0.0) is -0.0 in every op, and, where this torch's CUDA relu gives
  +0.0 (torch 2.11), that that is its only difference from relu_ext;
- the benchmark's CUDA path (do_bench rounds, the Triton peer, peak memory)
  at tiny sizes.

Every test compares with relu_ext's own eager / CPU result first (which
isolates the feature under test) and with ``torch.relu`` / ``nn.ReLU`` second
(the contract).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

import relu_ext
from cases import ONE_PER_OP
from conftest import (DTYPES, INT_OF, adversarial, assert_bitwise_equal, known_torch_cuda_zero_difference,
                      torch_cuda_relu_clears_negative_zero)

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible"), pytest.mark.native]

ops = torch.ops.relu_ext

# Launch geometry of csrc/core/cuda_launch.cuh: kThreads, at most 2048 threads per SM
# resident (the grid's limit), 16-byte vectors, the unrolls it compiles.
THREADS, MAX_BLOCKS_PER_SM, UNROLLS = 256, 8, (1, 2, 4)


def _caching_allocator_enabled() -> bool:
    """False under PYTORCH_NO_CUDA_MEMORY_CACHING (the memcheck run of bench/gpu_check.sh
    sets it, so that memcheck sees every allocation's real bounds)."""
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") not in ("", "0"):
        return False
    probe = getattr(torch._C, "_cuda_cudaCachingAllocator_is_enabled", None)
    if probe is not None and torch.cuda.is_available():
        try:
            return bool(probe())
        except RuntimeError:
            pass
    return True


needs_caching_allocator = pytest.mark.skipif(
    torch.cuda.is_available() and not _caching_allocator_enabled(),
    reason="CUDA graphs need PyTorch's caching allocator (PYTORCH_NO_CUDA_MEMORY_CACHING is set)",
)


@pytest.fixture(autouse=True)
def _synchronize_after_each_test():
    """Asynchronous CUDA errors surface in the test that caused them."""
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _raw(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(INT_OF[t.dtype]) if t.dtype in INT_OF else t


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str, nan_equal: bool = False,
                     vs_torch: bool = False) -> None:
    """Bit for bit, NaN payloads included, across devices (compared on the CPU).
    For two relu_ext results: unlike conftest's helper, no exception for CPU
    half-precision NaNs, since relu_ext keeps every payload on both devices.
    nan_equal: a NaN only has to meet a NaN (for results that also went
    through other ops, whose NaN payloads are not relu_ext's business).
    vs_torch: `expected` is PyTorch's, so the one known difference of torch
    2.11's CUDA relu (+0.0 for -0.0, see conftest) is accepted."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = _raw(actual).cpu().flatten(), _raw(expected).cpu().flatten()
    if nan_equal and actual.is_floating_point():
        both = (actual.detach().isnan() & expected.detach().isnan()).cpu().flatten()
        a, e = a.masked_fill(both, 0), e.masked_fill(both, 0)
    if vs_torch:
        known = known_torch_cuda_zero_difference(a, e, expected)
        a, e = a.masked_fill(known, 0), e.masked_fill(known, 0)
    diff = (a != e).nonzero()
    if diff.numel():
        i = diff[0].item()
        raise AssertionError(
            f"{what}: {diff.numel()} of {a.numel()} elements differ; first at flat index {i}: "
            f"got bits {a[i].item():#x}, want {e[i].item():#x}"
        )


def _poison(*nbytes: int) -> None:
    """Leave the caching allocator holding freed blocks of these sizes, in this
    order, filled with 0xFF bytes. The allocator is deterministic, so the next
    allocations of the same sizes in the same order (the op's outputs) get
    these blocks: an element or mask byte that a kernel fails to write then
    reads as 0xFF.. instead of a stale value that may happen to be right."""
    blocks = [torch.full((max(1, n),), 0xFF, dtype=torch.uint8, device="cuda") for n in nbytes]
    del blocks


def _grid_stride_size(dtype: torch.dtype, unroll: int) -> int:
    """More elements than two passes of the largest grid the vector kernels
    can have (V = 16 / itemsize elements per vector, `unroll` vectors per
    thread and pass), not a multiple of 8."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    v = 16 // torch.empty(0, dtype=dtype).element_size()
    return 2 * sms * MAX_BLOCKS_PER_SM * THREADS * v * unroll + 77


@pytest.fixture(params=UNROLLS, ids=lambda k: f"unroll{k}")
def unroll(request):
    """Runs a test once per compiled unroll of the CUDA vector kernels."""
    previous = relu_ext._C.cuda_unroll()
    relu_ext._C.set_cuda_unroll(request.param)
    yield request.param
    relu_ext._C.set_cuda_unroll(previous)


# Around every edge of the vector kernels: a warp's row is 32 * V elements
# (V = 2, 4, 8 for float64, float32, 16-bit types), its group of rows per
# iteration 32 * V * K (K = 1, 2, 4: up to 1024), a mask word 32 elements.
EDGE_SIZES = [1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513,
              1000, 1023, 1024, 1025, 2047, 2048, 2049, 4099]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernels_match_cpu_kernels(dtype, unroll):
    """relu, relu_fwd (values and mask bytes), relu_bwd, relu_ and relu_fwd_ on
    CUDA equal relu_ext's CPU kernels bit for bit (these equal torch.relu on
    the CPU, tested elsewhere), aligned and unaligned (x[1:]: scalar kernels),
    at tile edges and past several grid-stride passes, for every unroll."""
    isz = torch.empty(0, dtype=dtype).element_size()
    for n in EDGE_SIZES + [_grid_stride_size(dtype, unroll)]:
        base = adversarial(n + 1, dtype, seed=n)
        g_base = adversarial(n + 1, dtype, seed=n + 1)
        for off in (0, 1):
            what = f"n={n} offset={off}"
            x_cpu, g_cpu = base[off : off + n], g_base[1:]
            y_ref, m_ref = ops.relu_fwd(x_cpu)
            gi_ref = ops.relu_bwd(g_cpu, m_ref)

            x = base.cuda()[off : off + n]
            assert (x.data_ptr() % 16 == 0) == (off == 0)
            _poison(n * isz)
            assert_same_bits(relu_ext.relu(x), y_ref, f"relu {what}")
            _poison((n + 7) // 8, n * isz)
            y, m = ops.relu_fwd(x)
            assert_same_bits(y, y_ref, f"relu_fwd values {what}")
            assert_same_bits(m, m_ref, f"relu_fwd mask bytes {what}")
            for g_name, g in (("aligned", g_cpu.cuda()), ("unaligned", g_base.cuda()[1:])):
                _poison(n * isz)
                assert_same_bits(ops.relu_bwd(g, m), gi_ref, f"relu_bwd {what}, {g_name} grad")

            whole = base.cuda()
            ops.relu_(whole[off : off + n])
            assert_same_bits(whole[off : off + n], y_ref, f"relu_ {what}")
            assert_same_bits(whole[:off], base[:off], f"relu_ wrote before the view {what}")
            assert_same_bits(whole[off + n :], base[off + n :], f"relu_ wrote past the view {what}")
            whole = base.cuda()
            _poison((n + 7) // 8)
            m2 = ops.relu_fwd_(whole[off : off + n])
            assert_same_bits(whole[off : off + n], y_ref, f"relu_fwd_ values {what}")
            assert_same_bits(m2, m_ref, f"relu_fwd_ mask bytes {what}")
            assert_same_bits(whole[off + n :], base[off + n :], f"relu_fwd_ wrote past the view {what}")


@pytest.fixture
def waves():
    """Restores the CUDA grid cap (set_cuda_waves) after the test."""
    previous = relu_ext._C.cuda_waves()
    yield
    relu_ext._C.set_cuda_waves(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_uncapped_grid_gives_the_same_bits(dtype, waves):
    """set_cuda_waves(0) (no grid cap: one group of rows per warp, as PyTorch
    launches) writes the same bits as the default one wave of grid-stride
    blocks, in every kernel: ReLU's, the family's, compaction, nonzero_mask
    and integers; aligned and unaligned, past several grid-stride passes,
    outputs poisoned first."""
    n = _grid_stride_size(dtype, 4)
    base, g_base = adversarial(n + 1, dtype, seed=3).cuda(), adversarial(n + 1, dtype, seed=4).cuda()
    ints = torch.randint(-100, 100, (n,), dtype=torch.int8, device="cuda")

    def family(x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for name, args in ((c.op, c.args) for c in ONE_PER_OP):  # every op of the table
            y, m = getattr(ops, f"{name}_fwd")(x, *args)
            out += [y, m, getattr(ops, f"{name}_bwd")(g, m, *args)]
        values, missed = ops.compact(out[0], out[1])
        return out + [values, missed, ops.expand(values, out[1], list(x.shape), list(x.stride())),
                      ops.nonzero_mask(out[0]), ops.relu(ints)]

    for off in (0, 1):
        x, g = base[off : off + n], g_base[1 - off : 1 - off + n]
        relu_ext._C.set_cuda_waves(1)
        want = family(x, g)
        relu_ext._C.set_cuda_waves(0)
        assert relu_ext._C.cuda_waves() == 0
        _poison(*(t.numel() * t.element_size() for t in want))
        got = family(x, g)
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same_bits(a, b, f"output {i}, offset {off}, waves 0 vs 1")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_side_stream(dtype):
    """On a side stream, the kernels must run on the current stream: the input
    is written on that stream behind a ~50 ms sleep, so a kernel launched on
    the default stream would read the old contents (1.5 everywhere)."""
    n = 1_000_003
    src = adversarial(n, dtype, "cuda", seed=11)
    grad = adversarial(n, dtype, "cuda", seed=12)
    x = torch.full_like(src, 1.5)
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    side.wait_stream(main)  # src, grad, x are ready
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        x.copy_(src)
        y = relu_ext.relu(x)
        y_fwd, mask = ops.relu_fwd(x)
        grad_in = ops.relu_bwd(grad, mask)
        y_inplace = x.clone()
        relu_ext.relu(y_inplace, inplace=True)
        leaf = x.detach().clone().requires_grad_()
        relu_ext.relu(leaf).backward(grad)  # autograd runs backward on the forward's stream
    for t in (src, grad, x):  # made on main, used on side
        t.record_stream(side)
    main.wait_stream(side)
    for t in (y, y_fwd, mask, grad_in, y_inplace, leaf.grad):  # made on side, used on main
        t.record_stream(main)

    want_y, want_mask = ops.relu_fwd(src)  # the same kernels, on the default stream
    want_grad = ops.relu_bwd(grad, want_mask)
    for got, want, what in ((y, want_y, "relu"), (y_fwd, want_y, "relu_fwd"), (mask, want_mask, "mask"),
                            (grad_in, want_grad, "relu_bwd"), (y_inplace, want_y, "relu in place"),
                            (leaf.grad, want_grad, "autograd gradient")):
        assert_same_bits(got, want, f"side stream vs default stream: {what}")

    ref = src.clone().requires_grad_()
    torch.relu(ref).backward(grad)
    assert_bitwise_equal(leaf.grad, ref.grad, "side stream gradient vs torch.relu")
    assert_bitwise_equal(y, torch.relu(src), "side stream forward vs torch.relu")


def _warm_up(fn, times: int = 3) -> None:
    """As torch.cuda.graphs' docs ask: a few eager runs on a side stream before capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(side)


@needs_caching_allocator
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_graph_replay_ops(dtype):
    """The ops captured in a CUDA graph, replayed on new input data: the same
    bits as eager calls on that data (aligned and unaligned, in place too)."""
    n = 1_000_003
    x = adversarial(n, dtype, "cuda", seed=1)
    grad = adversarial(n, dtype, "cuda", seed=2)
    buf = torch.empty_like(x)

    def body():
        y = relu_ext.relu(x)
        y_fwd, mask = ops.relu_fwd(x)
        grad_in = ops.relu_bwd(grad, mask)
        y_unaligned = relu_ext.relu(x[1:])
        buf.copy_(x)
        relu_ext.relu(buf, inplace=True)
        return y, y_fwd, mask, grad_in, y_unaligned

    with torch.no_grad():
        _warm_up(body)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = body()
        for seed in (21, 22, 23):
            x.copy_(adversarial(n, dtype, "cuda", seed))
            grad.copy_(adversarial(n, dtype, "cuda", seed + 100))
            graph.replay()
            y, y_fwd, mask, grad_in, y_unaligned = outs
            want_y, want_mask = ops.relu_fwd(x)
            for got, want, what in ((y, want_y, "relu"), (y_fwd, want_y, "relu_fwd"), (mask, want_mask, "mask"),
                                    (grad_in, ops.relu_bwd(grad, want_mask), "relu_bwd"),
                                    (y_unaligned, relu_ext.relu(x[1:]), "relu of x[1:]"),
                                    (buf, want_y, "relu in place")):
                assert_same_bits(got, want, f"graph replay {seed} vs eager: {what}")
            assert_bitwise_equal(y, torch.relu(x), f"graph replay {seed} vs torch.relu")
    del graph


@needs_caching_allocator
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
def test_cuda_graph_replay_autograd(dtype, inplace):
    """Forward and backward of relu_ext.relu on a grad-requiring input,
    captured whole (as in the whole-network example of torch.cuda.graphs),
    replayed on new data: the output and x.grad equal eager ones bit for bit."""
    n = 1_000_003
    static_x = adversarial(n, dtype, "cuda", seed=3).requires_grad_()
    static_g = adversarial(n, dtype, "cuda", seed=4)

    def act(t, relu=relu_ext.relu):
        return relu(t * 1, inplace=True) if inplace else relu(t)

    def torch_relu(t, inplace=False):
        return torch.relu_(t) if inplace else torch.relu(t)

    def step():
        y = act(static_x)
        y.backward(static_g)
        return y

    def warm():
        static_x.grad = None
        step()

    _warm_up(warm)
    static_x.grad = None  # so that backward allocates x.grad from the graph's pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()
    static_grad = static_x.grad
    for seed in (31, 32, 33):
        with torch.no_grad():
            static_x.copy_(adversarial(n, dtype, "cuda", seed))
            static_g.copy_(adversarial(n, dtype, "cuda", seed + 100))
        graph.replay()
        assert static_x.grad is static_grad
        ref = static_x.detach().clone().requires_grad_()
        want_y = act(ref)
        want_y.backward(static_g)
        assert_same_bits(static_y, want_y, f"graph replay {seed} vs eager: forward")
        assert_same_bits(static_grad, ref.grad, f"graph replay {seed} vs eager: gradient")
        # Through the same graph (t * 1 when in place): on a GPU the product quiets NaN payloads.
        torch_x = static_x.detach().clone().requires_grad_()
        act(torch_x, torch_relu).backward(static_g)
        assert_bitwise_equal(static_grad, torch_x.grad, f"graph replay {seed} vs torch.relu: gradient")
        assert_bitwise_equal(static_y.detach(), act(static_x.detach(), torch_relu), f"graph replay {seed} vs torch.relu")
    del graph


class _Scaled(nn.Module):
    """x * s1 -> ReLU -> * s2 -> ReLU(inplace). Only single multiplications
    between the activations (no reductions, no mul-add that could become an
    FMA), so compiled and eager results can be compared bit for bit."""

    def __init__(self, act: type[nn.Module], width: int, dtype: torch.dtype):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("s1", torch.randn(width, generator=g).to(dtype))
        self.register_buffer("s2", torch.randn(width, generator=g).to(dtype))
        self.act1, self.act2 = act(), act(inplace=True)

    def forward(self, x):
        return self.act2(self.act1(x * self.s1) * self.s2)


@needs_caching_allocator
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compile_reduce_overhead(dtype):
    """torch.compile(mode="reduce-overhead"): inductor with CUDA graphs (no
    graph break, no CUDA-graph skip); every call (warm-up, record, replays)
    gives the eager relu_ext model's output and input gradient bit for bit,
    and the eager nn.ReLU model's. NaNs only have to meet NaNs: the model's
    multiplications may set NaN payloads differently when compiled (seen with
    inductor's CPU bf16 code)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    batch, width = 64, 1000
    ours = _Scaled(relu_ext.ReLU, width, dtype).cuda()
    ref = _Scaled(nn.ReLU, width, dtype).cuda()
    compiled = torch.compile(ours, mode="reduce-overhead", fullgraph=True)

    def run(model, data, grad):
        x = data.clone().requires_grad_()
        out = model(x)
        out.backward(grad)
        return out.detach().clone(), x.grad.clone()

    for it in range(5):
        data = adversarial(batch * width, dtype, "cuda", seed=40 + it).view(batch, width)
        grad = adversarial(batch * width, dtype, "cuda", seed=50 + it).view(batch, width)
        torch.compiler.cudagraph_mark_step_begin()
        out, x_grad = run(compiled, data, grad)
        eager_out, eager_grad = run(ours, data, grad)
        assert_same_bits(out, eager_out, f"call {it}: compiled vs eager relu_ext, forward", nan_equal=True)
        assert_same_bits(x_grad, eager_grad, f"call {it}: compiled vs eager relu_ext, input gradient", nan_equal=True)
        ref_out, ref_grad = run(ref, data, grad)
        assert_same_bits(out, ref_out, f"call {it}: compiled relu_ext vs eager nn.ReLU, forward", nan_equal=True, vs_torch=True)
        assert_same_bits(x_grad, ref_grad, f"call {it}: compiled relu_ext vs eager nn.ReLU, input gradient",
                         nan_equal=True, vs_torch=True)
    assert counters["inductor"]["cudagraph_skips"] == 0, "inductor did not use CUDA graphs (see its warning)"
    torch._dynamo.reset()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_second_gpu_device_guard(dtype):
    """A tensor on cuda:1 while cuda:0 is current (and the other way round):
    outputs on the input's device, right values, current device unchanged."""
    n = 1_000_003
    previous = torch.cuda.current_device()
    try:
        for current, dev in ((0, 1), (1, 0)):
            torch.cuda.set_device(current)
            src = adversarial(n, dtype, f"cuda:{dev}", seed=60 + dev)
            grad = adversarial(n, dtype, f"cuda:{dev}", seed=70 + dev)
            x = torch.full_like(src, 1.5)
            with torch.cuda.device(dev):
                torch.cuda._sleep(100_000_000)  # on dev's current stream: the kernels must queue behind it
            x.copy_(src)
            y = relu_ext.relu(x)
            y_fwd, mask = ops.relu_fwd(x)
            grad_in = ops.relu_bwd(grad, mask)
            leaf = x.detach().clone().requires_grad_()
            relu_ext.relu(leaf).backward(grad)
            inplace = x.clone()
            relu_ext.relu(inplace, inplace=True)
            assert torch.cuda.current_device() == current, "the op changed the current device"
            for t in (y, y_fwd, mask, grad_in, leaf.grad, inplace):
                assert t.device == x.device
            want_y, want_mask = ops.relu_fwd(src.cpu())
            want_grad = ops.relu_bwd(grad.cpu(), want_mask)
            for got, want, what in ((y, want_y, "relu"), (y_fwd, want_y, "relu_fwd"), (mask, want_mask, "mask"),
                                    (grad_in, want_grad, "relu_bwd"), (leaf.grad, want_grad, "autograd"),
                                    (inplace, want_y, "in place")):
                assert_same_bits(got, want, f"cuda:{dev} with cuda:{current} current: {what}")
            assert_bitwise_equal(y, torch.relu(src), f"cuda:{dev}: forward vs torch.relu")
            with pytest.raises(RuntimeError, match="same device"):
                ops.relu_bwd(grad.to(f"cuda:{current}"), mask)
    finally:
        torch.cuda.set_device(previous)


P = 1_000_003  # period of the big inputs: prime to 2^32, so a wrapped index breaks the period
N = 2**31 + 77  # past 2^31, not a multiple of 8 or 64: the tail paths run


def _assert_periodic(big: torch.Tensor, period: torch.Tensor, what: str, shift: int = 0) -> None:
    """big[i] has the bits of period[(i + shift) % P] for every i; checked on
    the GPU in blocks of 64 periods (no copy of the big tensor)."""
    b, p = _raw(big).view(-1), _raw(period).view(-1)
    if shift:
        p = torch.roll(p, -shift)
    rows = b.numel() // P
    for r0 in range(0, rows, 64):
        r1 = min(rows, r0 + 64)
        bad = b[r0 * P : r1 * P].view(r1 - r0, P).ne(p)
        if bad.any():
            i = r0 * P + bad.flatten().nonzero()[0].item()
            raise AssertionError(f"{what}: element {i} differs from element {(i + shift) % P} of the period")
    tail = b[rows * P :]
    if not torch.equal(tail, p[: tail.numel()]):
        raise AssertionError(f"{what}: the last {tail.numel()} elements differ from the period")


def _skip_without(need_bytes: int) -> None:
    free, _ = torch.cuda.mem_get_info()
    if free < need_bytes:
        pytest.skip(f"needs {need_bytes / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} GiB free")


def test_more_than_2_to_the_31_elements_cuda_bfloat16():
    """bfloat16, 2^31 + 77 elements (4.3 GB each): forward and mask, backward,
    x[1:] (the unaligned scalar kernel) and in place, against the period
    computed by the CPU kernels. Peak about 9.2 GB."""
    copies = N // P + 1
    need = 2 * copies * P * 2 + N // 8 + 2**30
    _skip_without(need)
    base_cpu = adversarial(P, torch.bfloat16, seed=31)
    y_ref, mask_ref = ops.relu_fwd(base_cpu)
    g_ref = ops.relu_bwd(base_cpu, mask_ref)  # base as the incoming gradient

    x = base_cpu.cuda().repeat(copies)[:N]
    assert x.is_contiguous() and x.numel() > 2**31
    y, mask = ops.relu_fwd(x)
    assert mask.numel() == (N + 7) // 8
    y_period = y_ref.cuda()
    _assert_periodic(y, y_period, "forward")
    del y
    # Mask bytes: 8 elements per byte and P odd, so check them through the backward.
    grad_in = ops.relu_bwd(x, mask)
    _assert_periodic(grad_in, g_ref.cuda(), "backward")
    del grad_in, mask
    y_unaligned = relu_ext.relu(x[1:])
    _assert_periodic(y_unaligned, y_period, "forward of x[1:]", shift=1)
    del y_unaligned
    relu_ext.relu(x, inplace=True)
    _assert_periodic(x, y_period, "in place")


def test_more_than_2_to_the_31_elements_cuda_int8():
    """int8 (the integer kernel), 2^31 + 77 elements: forward and in place."""
    copies = N // P + 1
    need = 2 * copies * P + 2**30
    _skip_without(need)
    base = torch.randint(-128, 128, (P,), dtype=torch.int8, generator=torch.Generator().manual_seed(8))
    want = torch.relu(base).cuda()
    x = base.cuda().repeat(copies)[:N]
    y = relu_ext.relu(x)
    _assert_periodic(y, want, "int8 forward")
    del y
    relu_ext.relu(x, inplace=True)
    _assert_periodic(x, want, "int8 in place")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_zero_on_cuda(dtype):
    """relu(-0.0) is -0.0 on CUDA, as on the CPU (PyTorch's CPU kernel, and its
    CUDA kernel since pytorch/pytorch#185354), in every op. Where this torch's
    CUDA relu gives +0.0 (torch 2.11), that is the only difference from it, and
    the test says so in a warning."""
    tiny = torch.finfo(dtype).tiny
    x = torch.tensor([-0.0, 0.0, -1.0, 1.0, -tiny / 4, tiny / 4, float("nan")], dtype=dtype, device="cuda")
    want = ops.relu_fwd(x.cpu())[0]
    assert torch.signbit(want[0]) and not torch.signbit(want[1]) and not torch.signbit(want[2])
    inplace = x.clone()
    ops.relu_(inplace)
    fwd_inplace = x.clone()
    ops.relu_fwd_(fwd_inplace)
    for got, what in ((relu_ext.relu(x), "relu"), (ops.relu_fwd(x)[0], "relu_fwd"), (inplace, "relu_"),
                      (fwd_inplace, "relu_fwd_")):
        assert_same_bits(got, want, f"{what} on CUDA vs relu_ext's CPU kernel")
    torch_y = torch.relu(x)
    assert_bitwise_equal(relu_ext.relu(x), torch_y, "relu vs torch.relu on CUDA")
    if torch_cuda_relu_clears_negative_zero(dtype):
        assert not torch.signbit(torch_y[0])
        different = (_raw(torch_y) != _raw(want.cuda())).nonzero().flatten().tolist()
        assert different == [0], f"torch.relu on CUDA differs at {different}, expected only at the -0.0 input"
        warnings.warn(f"torch {torch.__version__}'s CUDA relu gives +0.0 for -0.0 ({dtype}); relu_ext keeps -0.0 "
                      "(PyTorch's CPU kernel and its fixed CUDA kernel, pytorch/pytorch#185354)")


def test_bench_runs_on_cuda(tmp_path):
    """The CUDA timing path of the benchmark, every section, at tiny sizes:
    figures follow from their rounds, and the memory worker uses CUDA's counters."""
    import math
    import statistics

    from relu_ext.bench import cli

    previous = relu_ext._C.cuda_unroll(), relu_ext._C.cuda_waves()
    try:
        res = cli.main(["--device", "cuda", "--sizes", "4096,65537", "--rounds", "2", "--budget", "0.01", "--quick",
                        "--cuda-unroll", "1", "--cuda-waves", "0", "--out", str(tmp_path), "--name", "cuda",
                        "--no-progress"])
    finally:
        relu_ext._C.set_cuda_unroll(previous[0])
        relu_ext._C.set_cuda_waves(previous[1])
    assert res["environment"]["gpu"] and (tmp_path / "cuda.json").exists()
    assert res["environment"]["relu_ext"]["cuda_unroll"] == 1 and res["environment"]["relu_ext"]["cuda_waves"] == 0
    for r in res["kernels"] + res["small"]:
        for c in r["results"].values():
            assert len(c["rounds_s"]) == 2 and c["median_s"] > 0
            assert math.isclose(c["gbs"], c["bytes"] / statistics.median(c["rounds_s"]) / 1e9)
    if res["environment"]["triton"]:
        assert any("triton" in r["results"] for r in res["kernels"])
    methods = {m["peak_method"] for r in res["memory"]["models"] for m in r["results"].values()}
    assert methods == {"torch.cuda.max_memory_allocated"}
