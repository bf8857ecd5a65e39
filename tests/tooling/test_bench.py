"""The benchmark code itself: it runs at tiny sizes, its JSON holds the figures
it claims (every round), its ratios are computed from its own rounds, it marks
figures that cannot be trusted, and its peers compute ReLU (else their
timings would mean nothing)."""

import ast
import ctypes
import importlib.util
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import relu_ext

from conftest import adversarial, assert_bitwise_equal
from relu_ext.bench import cli, models, peers, real, report, timing

# --malloc as-is: the default would retune malloc in this (pytest's) process for the rest of the suite.
TINY = ["--device", "cpu", "--rounds", "3", "--budget", "0.01", "--no-progress", "--no-files", "--malloc", "as-is"]
ROOT = Path(__file__).resolve().parents[2]


# The rounds of `result`'s run: two give a median and ratios of rounds as well as more would.
ROUNDS = 2


# Session-scoped: a module-scoped one is set up again whenever pytest-xdist runs another
# module's test between two of these (their xdist_group keeps them on one worker).
@pytest.fixture(scope="session")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    res = cli.main(["--device", "cpu", "--dtypes", "float32,bfloat16", "--sizes", "1024,4099", "--quick",
                    "--rounds", str(ROUNDS), "--budget", "0.01",
                    "--impls", "torch,torch_out,compile,seed,relu_ext,installed", "--out", str(out),
                    "--name", "t", "--no-progress", "--malloc", "as-is"])
    return res, out


@pytest.mark.full  # the run behind `result` takes minutes
@pytest.mark.xdist_group("bench_result")  # one worker runs it
def test_files_written(result):
    res, out = result
    assert json.loads((out / "t.json").read_text()) == json.loads(json.dumps(res))
    png = (out / "t.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.full  # the run behind `result` takes minutes
@pytest.mark.xdist_group("bench_result")  # one worker runs it
def test_environment_recorded(result):
    env = result[0]["environment"]
    for key in ("date", "device", "torch", "cuda", "cpu", "threads", "python", "relu_ext", "triton", "load_start",
                "load_end", "malloc"):
        assert key in env, key
    assert env["torch"] == torch.__version__ and env["threads"] == torch.get_num_threads()
    assert set(env["load_start"]) == {"load1", "cpus", "busy"}
    assert env["malloc"] == "as is (glibc defaults)" and result[0]["config"]["malloc"] == "as-is"


WHERE = """
import sys, torch
from relu_ext.bench import timing
print(timing.steady_malloc() if sys.argv[1] == "steady" else "as-is")
x = torch.ones(2**24)
p = x.data_ptr()
for line in open("/proc/self/maps"):
    lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
    if lo <= p < hi:
        print("heap" if line.rstrip().endswith("[heap]") else "mapping")
"""


def _malloc_interposed() -> bool:
    """Whether the malloc this process calls is not libc.so.6's (LD_PRELOAD, /etc/ld.so.preload)."""
    used, glibc = (ctypes.cast(lib.malloc, ctypes.c_void_p).value for lib in (ctypes.CDLL(None), ctypes.CDLL("libc.so.6")))
    return used != glibc


@pytest.mark.full  # a process per mode
@pytest.mark.parametrize("mode", ["steady", "as-is"])
def test_steady_malloc_keeps_large_blocks_in_the_heap(mode):
    """glibc's default gives a 64 MiB block its own mmap (fresh pages, one
    fault per 4 KiB, at every allocation); the bench's steady mode takes it
    from the heap, where freed memory is reused."""
    out = subprocess.run([sys.executable, "-c", WHERE, mode], capture_output=True, text=True, check=True).stdout
    first, where = out.splitlines()[0], out.split()[-1]
    if mode == "steady" and _malloc_interposed():
        # The sanitizer leg preloads ASan's malloc, and some images another one, which ignore mallopt:
        # the bench says so.
        assert first == "as is (malloc is not glibc's: interposed)", out
    elif mode == "steady":
        assert first.startswith("steady:") and where == "heap", out
    else:
        assert where == "mapping", out


def check_row(r, rounds, max_spread):
    """Every figure of a row follows from the rounds the JSON holds."""
    copy_r = r["copy"]["rounds_s"]
    assert len(copy_r) == rounds and math.isclose(r["copy_gbs"], r["copy_bytes"] / statistics.median(copy_r) / 1e9)
    torch_r = r["results"]["torch"]["rounds_s"] if "torch" in r["results"] else None  # compact/expand: relu_ext only
    for c in r["results"].values():
        rs = c["rounds_s"]
        assert len(rs) == rounds and c["median_s"] == statistics.median(rs)
        assert c["q25_s"] <= c["median_s"] <= c["q75_s"]
        assert math.isclose(c["spread"], (c["q75_s"] - c["q25_s"]) / c["median_s"])
        assert (timing.NOISY in c["marks"]) == (c["spread"] > max_spread)
        assert math.isclose(c["gbs"], c["bytes"] / c["median_s"] / 1e9)
        # Paired by round: the ratios are medians of per-round ratios, not ratios of medians.
        if torch_r is None:
            assert c["vs_torch"] is None
        else:
            assert math.isclose(c["vs_torch"], statistics.median(a / b for a, b in zip(rs, torch_r)))
        want = c["bytes"] / r["copy_bytes"] * statistics.median(cp / t for cp, t in zip(copy_r, rs))
        assert math.isclose(c["of_copy"], want)


@pytest.mark.full  # the run behind `result` takes minutes
@pytest.mark.xdist_group("bench_result")  # one worker runs it
def test_kernel_rows_schema_and_arithmetic(result):
    res = result[0]
    rows = res["kernels"]
    assert {(r["dtype"], r["numel"]) for r in rows} == {(d, n) for d in ("float32", "bfloat16") for n in (1024, 4099)}
    assert {r["case"] for r in rows} == set(peers.CASES)
    for r in rows:
        check_row(r, ROUNDS, res["config"]["max_spread"])
        e = 4 if r["dtype"] == "float32" else 2
        n, m = r["numel"], (r["numel"] + 7) // 8
        ext = r["results"]["relu_ext"]["bytes"]
        if r["case"] in ("compact", "expand"):  # the tensor, its mask, and the values kept (about half)
            assert n * e + m + 0.3 * n * e < ext < n * e + m + 0.7 * n * e, r["case"]
            assert set(r["results"]) == {"relu_ext"} and r["results"]["relu_ext"]["vs_torch"] is None
            continue
        if r["case"].startswith("bn "):  # a BatchNorm's input and the output, once each
            assert ext == 2 * n * e and set(r["results"]) == {"relu_ext"}
            assert r["results"]["relu_ext"]["vs_torch"] is None and r["results"]["relu_ext"]["vs_copy"] > 0
            continue
        want = {"fwd": 2 * n * e, "fwd (train)": 2 * n * e + m, "bwd": 2 * n * e + m,
                "fwd+bwd": 4 * n * e + 2 * m, "in-place": 2 * n * e}[r["case"]]
        assert ext == want, r["case"]
    fwd = [r for r in rows if r["case"] == "fwd"][0]
    assert set(fwd["results"]) == {"torch", "torch_out", "compile", "seed", "relu_ext"}
    # The cases of one dtype and size share the copy's rounds: they ran interleaved.
    same = [r["copy"]["rounds_s"] for r in rows if (r["dtype"], r["numel"]) == ("float32", 1024)]
    assert len(same) == len(peers.CASES) and all(s == same[0] for s in same)


@pytest.mark.full  # the run behind `result` takes minutes
@pytest.mark.xdist_group("bench_result")  # one worker runs it
def test_small_memory_models_sections(result):
    res = result[0]
    assert [(r["numel"], r["case"]) for r in res["small"]] == [(n, c) for n in cli.QUICK_SMALL_SIZES
                                                              for c in peers.SMALL_CASES]
    for r in res["small"]:
        want = {"torch", "seed", "relu_ext", "installed"} | (set() if r["case"].startswith("module") else {"compile"})
        assert set(r["results"]) == want, r["case"]
        check_row(r, ROUNDS, res["config"]["max_spread"])
    per = {r["dtype"]: r["bytes_per_element"] for r in res["memory"]["saved_per_element"]}
    # nn.ReLU keeps its output, the tutorial Function its input, relu_ext 1 bit.
    assert per["float32"]["torch"] == 4 and per["bfloat16"]["torch"] == 2
    assert per["float32"]["seed"] == 4 and per["float32"]["relu_ext"] == 1 / 8 == per["bfloat16"]["relu_ext"]
    assert per["float32"]["installed"] == 1 / 8  # F.relu under install()
    mem = res["memory"]["models"]
    assert [(r["model"], r["dtype"]) for r in mem] == [(m, d) for m in real.QUICK_MODELS for d in ("float32", "bfloat16")]
    for row in mem:
        assert list(row["results"]) == real.CONFIGS
        base = row["results"]["nn.ReLU"]
        for m in row["results"].values():
            assert m["held_bytes"] > 0 and m["peak_bytes"] >= 0  # tiny quick models can be below RSS resolution
            assert math.isclose(m["held_vs_torch"], m["held_bytes"] / base["held_bytes"])
            assert len(m["rounds_s"]) == ROUNDS
            assert math.isclose(m["vs_torch"], statistics.median(a / b for a, b in zip(m["rounds_s"], base["rounds_s"])))
        # save_compact()'s host time per saved tensor: its configurations have one, the others none.
        timed = {c for c, m in row["results"].items() if m.get("hook_us_per_saved", 0) > 0}
        assert timed == {c for c in real.CONFIGS if real.saving(c) is not None}, row["results"].keys()
    held = {(r["model"], r["dtype"]): {c: m["held_bytes"] for c, m in r["results"].items()} for r in mem}
    cnn = held[("resnet18", "float32")]
    # The next conv keeps the ReLU output: the mask alone frees nothing, compaction does.
    assert cnn["install"] >= cnn["nn.ReLU"] and cnn["install+compact"] < 0.9 * cnn["nn.ReLU"]
    assert cnn["nn.ReLU+compact"] < 0.9 * cnn["nn.ReLU"]
    # Recompute: the BN -> ReLU outputs are rebuilt from what the BatchNorms keep.
    assert cnn["install+recompute"] < cnn["install+compact"]
    # T5: ReLU -> dropout -> linear: nothing else keeps the ReLU output, so the mask alone saves.
    assert held[("t5_relu", "float32")]["install"] < held[("t5_relu", "float32")]["nn.ReLU"]
    # Selective checkpointing, timed in the same rounds: it keeps the matmuls' outputs, recomputes the rest.
    assert held[("t5_relu", "float32")]["sac nn.ReLU"] < held[("t5_relu", "float32")]["nn.ReLU"]
    for row in res["models"]:
        r, t = row["results"]["relu_ext"], row["results"]["torch"]
        assert len(r["rounds_s"]) == ROUNDS
        assert math.isclose(r["vs_torch"], statistics.median(a / b for a, b in zip(r["rounds_s"], t["rounds_s"])))
    text = report.format_tables(res)
    assert "kernels:" in text and "small tensors" in text and "training step" in text and "trust:" in text
    assert "real models, training mode" in text
    hook_line = f"    resnet18 float32: install+compact {mem[0]['results']['install+compact']['hook_us_per_saved']:.1f}"
    assert "host µs per saved tensor" in text and hook_line in text


@pytest.mark.full  # the run behind `result` takes minutes
@pytest.mark.xdist_group("bench_result")  # one worker runs it
def test_tables_fit_120_columns(result):
    """Six implementations (CUDA adds triton), GPU-sized GB/s and a figure far
    above the copy: every line still fits."""
    res = json.loads(json.dumps(result[0]))
    for r in res["kernels"] + res["small"]:
        r["results"]["triton"] = dict(r["results"]["relu_ext"], gbs=3012.5, of_copy=12.3, vs_torch=10.5)
        r["copy_gbs"] = 3100.0
    long_name = "a_rather_long_package.of_models:build_the_model_please"  # a user's --model
    res["memory"]["models"][0]["model"] = long_name
    lines = report.format_tables(res).splitlines()
    assert max(map(len, lines)) <= report.WIDTH, max(lines, key=len)
    assert any("triton" in line for line in lines)
    assert long_name in lines  # on a line of its own, the figures below it


def fake_sample(script):
    """A Sampler.sample that returns script(key, round) instead of timing: a
    measurement made noisy (or the machine made busy) on purpose."""
    rounds = {}

    def sample(self):
        k = rounds[self.key] = rounds.get(self.key, -1) + 1
        return script(self.key, k)

    return sample


def test_noisy_measurement_is_marked(monkeypatch, capsys):
    # Every figure steady, but relu_ext's forward doubles every other round.
    monkeypatch.setattr(timing.Sampler, "sample", fake_sample(
        lambda key, k: 1e-5 * (2 if key == ("fwd", "relu_ext") and k % 2 else 1)))
    res = cli.main(TINY + ["--what", "kernels", "--sizes", "1024,2048", "--dtypes", "float32",
                           "--impls", "torch,relu_ext", "--rounds", "4"])
    marked = {(r["numel"], r["case"], impl) for r in res["kernels"] for impl, c in r["results"].items() if c["marks"]}
    assert marked == {(1024, "fwd", "relu_ext"), (2048, "fwd", "relu_ext")}
    fwd = next(r for r in res["kernels"] if r["case"] == "fwd")["results"]["relu_ext"]
    assert fwd["marks"] == [timing.NOISY] and fwd["spread"] > res["config"]["max_spread"]
    assert res["trust"]["marked"] == 2 and res["trust"]["noisy"] == 2 and res["trust"]["copy_low_rows"] == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines if line.rstrip().endswith("~")] == [["1K", "fwd"], ["2K", "fwd"]]
    assert "trust: 2 of " in "\n".join(lines)


def test_busy_copy_marks_its_rows(monkeypatch, capsys):
    # The copy at 2048 elements ran 10x slower in two of its three rounds: a busy machine.
    monkeypatch.setattr(timing.Sampler, "sample", fake_sample(
        lambda key, k: 1e-5 * (10 if key == ("copy", "copy") and k >= 3 and k != 5 else 1)))
    res = cli.main(TINY + ["--what", "kernels", "--sizes", "1024,2048", "--dtypes", "float32",
                           "--impls", "torch,relu_ext"])
    low = {r["numel"] for r in res["kernels"] if timing.COPY_LOW_MARK in r["marks"]}
    assert low == {2048}
    assert res["trust"]["copy_low_rows"] == len(peers.CASES)
    lines = capsys.readouterr().out.splitlines()
    assert all("!" in line for line in lines if line.startswith("  2K "))
    assert not any("!" in line for line in lines if line.startswith("  1K "))


def test_mark_copy_low_compares_rows_of_the_same_size_across_sections():
    def row(section, gbs_rounds):
        rounds = [2048 / g / 1e9 for g in gbs_rounds]
        return timing.make_row({"section": section, "device": "cpu", "dtype": "float32", "numel": 256,
                                "case": "fwd", "copy_bytes": 2048}, rounds, {"torch": (rounds, 2048)})

    steady, busy, other = row("kernels", [40, 41, 39]), row("small", [12, 15, 14]), row("kernels", [40, 41, 39])
    other["numel"] = 512
    timing.mark_copy_low([steady, busy, other])
    assert busy["marks"] == [timing.COPY_LOW_MARK] and steady["marks"] == [] and other["marks"] == []


def test_load_warning(monkeypatch, capsys):
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (7.5, 3.0, 1.0))
    monkeypatch.setattr(timing.os, "sched_getaffinity", lambda pid: {0, 1})
    res = cli.main(TINY + ["--what", "kernels", "--sizes", "256", "--dtypes", "float32", "--impls", "torch",
                           "--rounds", "1"])
    captured = capsys.readouterr()
    assert captured.err.startswith("warning: load average 7.50 on 2 CPUs before the run: the machine is busy")
    assert res["environment"]["load_start"] == {"load1": 7.5, "cpus": 2, "busy": True}
    assert "warning: load average 7.50" in captured.out  # repeated under the tables
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (0.3, 0.2, 0.1))
    assert timing.load_warning(timing.load_average()) is None


@pytest.mark.full  # the run behind `result` takes minutes
@pytest.mark.xdist_group("bench_result")  # one worker runs it
def test_family_rows(result):
    """Each activation of the family against PyTorch's op: forward, training forward (relu_ext
    writes the mask), backward (PyTorch's *_backward reads the input, relu_ext the mask) and in place."""
    res = result[0]
    rows = res["family"]
    assert {(r["dtype"], r["numel"]) for r in rows} == {(d, n) for d in ("float32", "bfloat16") for n in (1024, 4099)}
    assert {r["case"] for r in rows} == set(peers.FAMILY_CASES)
    for r in rows:
        check_row(r, ROUNDS, res["config"]["max_spread"])
        assert set(r["results"]) == {"torch", "relu_ext"}
        e = 4 if r["dtype"] == "float32" else 2
        n, m = r["numel"], (r["numel"] + 7) // 8
        kind = r["case"].split(" ", 1)[1]
        want = {"fwd": 2 * n * e, "fwd (train)": 2 * n * e + m, "bwd": 2 * n * e + m, "in-place": 2 * n * e}[kind]
        assert r["results"]["relu_ext"]["bytes"] == want, r["case"]
        assert r["results"]["torch"]["bytes"] == (3 if kind == "bwd" else 2) * n * e, r["case"]
    assert "the family's kernels" in report.format_tables(res)


def test_configuration_defaults_quick_and_overrides():
    _, full = cli.configure(["--device", "cpu"])
    assert (full["sizes"], full["rounds"], full["budget_s"]) == (cli.DEFAULT_SIZES["cpu"], 5, 0.25)
    assert full["small_sizes"] == cli.SMALL_SIZES and not full["quick"] and full["malloc"] == "steady"
    assert cli.configure(["--device", "cpu", "--malloc", "as-is"])[1]["malloc"] == "as-is"
    _, quick = cli.configure(["--device", "cpu", "--quick"])
    assert (quick["sizes"], quick["small_sizes"], quick["rounds"]) == (cli.QUICK_SIZES["cpu"], cli.QUICK_SMALL_SIZES, 3)
    assert quick["budget_s"] < full["budget_s"] and quick["quick"]
    _, mine = cli.configure(["--device", "cpu", "--quick", "--rounds", "7", "--budget", "0.5", "--sizes", "100,200",
                             "--max-spread", "0.3"])
    assert (mine["rounds"], mine["budget_s"], mine["small_budget_s"], mine["sizes"], mine["max_spread"]) == \
        (7, 0.5, 0.5, [100, 200], 0.3)


@pytest.mark.parametrize("argv", [["--impls", "torch,nope"], ["--what", "kernels,speed"], ["--rounds", "0"],
                                  ["--dtypes", "int32"], ["--dtypes", "float33"], ["--device", "mps"],
                                  ["--malloc", "jemalloc"], ["--cuda-unroll", "3"], ["--cuda-unroll", "2"],
                                  ["--cuda-waves", "65"], ["--cuda-waves", "-1"], ["--cuda-waves", "2"],
                                  ["--models", "resnet18,alexnet"]])
def test_bad_arguments_are_named(argv, capsys):
    with pytest.raises(SystemExit):
        cli.configure(["--device", "cpu"] + argv)
    assert argv[1].split(",")[-1] in capsys.readouterr().err


def test_help_lists_the_flags():
    text = cli.parser().format_help()
    for flag in ("--rounds", "--budget", "--max-spread", "--quick", "--out", "--no-files", "--what", "--impls",
                 "--cuda-unroll", "--cuda-waves", "--models", "--compile-backend", "--model", "--input-shape"):
        assert flag in text
    assert "interleaved" in text and "marked" in text
    # A user who installed the package has no repository: no git, no make targets.
    assert not re.search(r"\b(git|make)\b", text), re.search(r".*\b(git|make)\b.*", text).group(0)


@pytest.mark.full  # the run behind `result` takes minutes
@pytest.mark.xdist_group("bench_result")  # one worker runs it
def test_table_headers_name_the_columns_and_units(result):
    lines = report.format_tables(result[0]).splitlines()
    kernel_heads = [line for line in lines if line.startswith("size case ") and "GB/s" in line]
    assert len(kernel_heads) == 4  # kernels and family, two dtypes each
    assert kernel_heads[0].split() == ["size", "case", "GB/s"] + ["GB/s", "copy"] + ["GB/s", "copy", "vs", "T"] * 4
    small_head = next(line for line in lines if line.startswith("size case ") and "µs" in line)
    assert small_head.split()[2:] == ["µs", "vs", "T"] * 5
    start = lines.index(next(line for line in lines if line.startswith("real models, training mode")))
    head, tail, units = lines[start + 1:start + 4]
    # (Each configuration's name right-aligned over its two columns, split after its "+".)
    width = report._CELL
    names = [(head[i:i + width].strip() + tail[i:i + width].strip())
             for i in range(len(units) - width * len(real.CONFIGS), len(units), width)]
    assert head.split()[0] == "model" and names == real.CONFIGS, (head, tail)
    assert units.split()[:3] == ["dtype,", "input", "metric"] and units.count("value x vs T") == len(real.CONFIGS)
    assert all(len(line) <= report.WIDTH for line in lines)
    table = lines[start + 5:start + 5 + 3 * len(result[0]["memory"]["models"])]
    assert [line[15:24].strip() for line in table] == ["held MiB", "peak MiB", "step ms"] * (len(table) // 3)


@pytest.mark.full  # the run behind `result` takes minutes
@pytest.mark.xdist_group("bench_result")  # one worker runs it
def test_plot_panels(result, tmp_path):
    panels = report.plot(result[0], str(tmp_path / "p.png"))
    titles = [t for t, _ in panels]
    assert "float32 fwd" in titles and "bfloat16 in-place" in titles
    assert [t for t in titles if t.startswith("per call:")] == [f"per call: float32 {c}" for c in peers.SMALL_CASES]
    assert "saved for backward, per element" in titles and "held by the graph after forward, vs nn.ReLU" in titles
    assert all("(higher is better)" in y or "(lower is better)" in y for _, y in panels)


def test_interleave_shuffles_and_times_each():
    order = []
    fns = {k: (lambda k=k: order.append(k)) for k in "abcdef"}
    samples = timing.interleave(fns, "cpu", 4, 0.004)
    assert set(samples) == set("abcdef") and all(len(v) == 4 and min(v) > 0 for v in samples.values())
    blocks = [k for k, _ in itertools.groupby(order)][-24:]  # one block of calls per fn and round
    rounds = ["".join(blocks[i:i + 6]) for i in range(0, 24, 6)]
    assert all(sorted(r) == list("abcdef") for r in rounds) and len(set(rounds)) > 1, rounds
    assert rounds[0] == "abcdef"


def test_summarize_single_round_and_spread():
    one = timing.summarize([2.0])
    assert (one["median_s"], one["q25_s"], one["q75_s"], one["spread"], one["marks"]) == (2.0, 2.0, 2.0, 0.0, [])
    wide = timing.summarize([1.0, 1.0, 2.0, 2.0], max_spread=0.15)
    assert wide["median_s"] == 1.5 and wide["marks"] == [timing.NOISY]


def test_saved_bytes_counts_distinct_storages():
    x = torch.randn(1000, requires_grad=True)
    w = torch.randn(1000, requires_grad=True)
    assert models.saved_bytes(lambda: (x * w).sum()) == 8000
    assert models.saved_bytes(lambda: (x * x).sum()) == 4000
    assert models.saved_bytes(lambda: (x * w).sum(), exclude=[w]) == 4000


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_seed_peer_computes_relu(dtype):
    x = adversarial(4097, dtype, seed=3).nan_to_num(0.0)
    g = torch.randn_like(x)
    xs, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    peers.SeedReLU.apply(xs).backward(g)
    torch.relu(xt).backward(g)
    assert torch.equal(peers.SeedReLU.apply(x), torch.relu(x).abs())  # clamp gives +0 where relu keeps -0
    keep = x != 0  # at exactly 0 the tutorial passes the gradient, PyTorch does not
    assert torch.equal(xs.grad[keep], xt.grad[keep])


def test_compiled_peer_computes_relu():
    x = adversarial(3001, torch.float32, seed=4)
    assert_bitwise_equal(peers.compiled_relu()(x), torch.relu(x), "compiled forward")


def test_triton_peer_computes_relu(monkeypatch):
    """The Triton kernels, run by Triton's interpreter on CPU tensors."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    peers.triton_relu.cache_clear()
    try:
        fwd, bwd, fn = peers.triton_relu()
        for dtype in (torch.float32, torch.bfloat16):
            x = adversarial(3001, dtype, seed=5)
            x[(x.abs() < torch.finfo(dtype).tiny) & (x != 0)] = 1.0  # the peer may flush denormals; fine for timing
            y = fwd(x)
            assert_bitwise_equal(y, torch.relu(x), "triton forward")
            g = torch.randn_like(x)
            assert_bitwise_equal(bwd(g, y), torch.ops.aten.threshold_backward(g, torch.relu(x), 0), "triton backward")
    finally:
        peers.triton_relu.cache_clear()


def test_sampler_runs_with_torchs_threads():
    """torch.utils.benchmark.Timer defaults to 1 thread; the bench must time
    with the threads torch uses, as the user's code runs."""
    seen = []
    sampler = timing.Sampler("k", lambda: seen.append(torch.get_num_threads()), "cpu", 0.001)
    assert sampler.sample() > 0 and set(seen) == {torch.get_num_threads()}


def test_a_call_as_long_as_a_block_is_sampled_as_its_best_after_an_untimed_one():
    """A training step is a block of one call: a burst of load in that one call would be the sample,
    so the sample is the best of LONG_CALL_BEST_OF timed calls, after an untimed one."""
    durations = iter([0.002, 0.2, 0.01, 0.1])  # calibration; then untimed, timed, timed
    calls = []

    def fn() -> None:
        calls.append(next(durations))
        time.sleep(calls[-1])

    sampler = timing.Sampler("k", fn, "cpu", 0.001)
    assert timing.LONG_CALL_BEST_OF == 2 and sampler.number == 1
    assert 0.01 <= sampler.sample() < 0.08 and len(calls) == 4


def test_default_output_is_the_current_folder_and_never_overwritten(tmp_path, monkeypatch):
    env = {"device": "cpu", "cpu": "AMD EPYC", "threads": 2, "date": "2026-11-23T03:22:54"}
    later = dict(env, date="2026-11-23T05:10:07")
    assert report.default_name(env) == "cpu-amd-epyc-2t-2026-11-23T0322"
    assert report.default_name(later) != report.default_name(env)
    monkeypatch.chdir(tmp_path)
    argv = ["--device", "cpu", "--rounds", "1", "--budget", "0.01", "--no-progress", "--malloc", "as-is",
            "--what", "kernels", "--sizes", "256", "--dtypes", "float32", "--impls", "torch"]
    res = cli.main(argv)
    folder = tmp_path / "relu_ext-bench-results"  # a folder whose name says what it holds
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]
    assert sorted(p.name for p in folder.iterdir()) == [report.default_name(res["environment"]) + s
                                                        for s in (".json", ".png")]
    res = cli.main(argv + ["--out", "kept"])
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == [report.default_name(res["environment"]) + s
                                                                      for s in (".json", ".png")]
    # The repository's own runs (make bench) go to bench/out, which git must ignore.
    out = subprocess.run(["git", "check-ignore", "-q", "bench/out/x.json"], cwd=ROOT)
    if out.returncode != 128:  # 128: not a git checkout (an unpacked sdist)
        assert out.returncode == 0, "bench/out must be ignored by git"


def test_progress_lines_when_stderr_is_not_a_terminal(capsys):
    lines = timing.Progress(3, "lines", interval=0.0)
    for label in ("a", "b", "c"):
        lines.step(label)
    err = capsys.readouterr().err.splitlines()
    assert err == ["progress: 1/3, 0 s, a", "progress: 2/3, 0 s, b", "progress: 3/3, 0 s, c"]
    sparse = timing.Progress(3, "lines", interval=3600.0)
    for label in ("a", "b", "c"):
        sparse.step(label)
    assert capsys.readouterr().err.splitlines() == ["progress: 3/3, 0 s, c"]  # the last step always shows
    off = timing.Progress(3, "off")
    off.step("a")
    assert capsys.readouterr().err == ""


def test_progress_total_matches_the_steps_taken(monkeypatch):
    steps = []
    monkeypatch.setattr(timing.Progress, "step", lambda self, label: steps.append(label))
    argv = TINY + ["--what", "kernels,family,small,models", "--sizes", "512", "--dtypes", "float32", "--impls", "torch,relu_ext",
                   "--rounds", "2", "--quick"]
    _, config = cli.configure(argv)
    cli.main(argv)
    assert len(steps) == cli._steps(config)


def test_slow_peers_stop_at_their_size_on_cpu():
    impls = ["torch", "compile", "seed", "relu_ext"]
    assert cli.impls_at(2**24, impls, 2**24) == impls
    assert cli.impls_at(2**26, impls, 2**24) == ["torch", "relu_ext"]
    assert cli.impls_at(2**28, impls, None) == impls
    _, config = cli.configure(["--device", "cpu"])
    assert config["slow_peers_max"] == 2**24 and max(config["sizes"]) == 2**26


def test_installed_rows_run_under_install_and_only_there():
    """install() is process-wide: the "installed" blocks run with it, every other block without."""
    import relu_ext

    states: dict[str, set[bool]] = {"plain": set(), "installed": set()}
    fns = {"plain": lambda: states["plain"].add(relu_ext.installed()),
           "installed": peers.installed(lambda: states["installed"].add(relu_ext.installed()))}
    timing.interleave(fns, "cpu", rounds=3, budget_s=0.003)
    assert states == {"plain": {False}, "installed": {True}}
    assert not relu_ext.installed()


@pytest.mark.full  # the run behind `result` takes minutes
@pytest.mark.xdist_group("bench_result")  # one worker runs it
def test_small_section_has_installed_rows(result):
    res, _ = result
    cases = {r["case"] for r in res["small"] if "installed" in r["results"]}
    assert cases == set(peers.SMALL_CASES)
    assert not any("installed" in r["results"] for r in res["kernels"])


def test_held_bytes_count_what_the_graph_saves():
    """nn.ReLU's held bytes are exactly the saved storages that models.saved_bytes counts
    (parameters, buffers and inputs aside); compaction's count is what its packed objects keep."""
    model, x = real.build("resnet18", torch.float32, "cpu", quick=True)
    direct = models.saved_bytes(lambda: real.loss_of(model, x), [*model.parameters(), *model.buffers(), x])
    assert real.held_bytes(model, x, "nn.ReLU") == direct
    assert real.held_bytes(model, x, "nn.ReLU+compact") < 0.9 * direct
    counts: dict[str, int] = {}
    real.held_bytes(model, x, "install+recompute", counts)
    assert set(counts) == {"replayed", "replay_misses", "compacted", "concatenated", "pooled", "remade", "narrowed",
                           "two_valued", "kept"}
    # (17 ReLUs: at 64 x 64 one is small, and the first block's would rebuild the pooled max-pool output too)
    assert counts["replayed"] >= 15 and counts["replay_misses"] == 0 and counts["kept"] > 0
    assert counts["narrowed"] == counts["pooled"] == 1  # the max-pool's indices, its output


@pytest.mark.full  # compiles resnet18
def test_compiled_section(monkeypatch):
    """torch.compile of the model with nn.ReLU and with relu_ext's modules: both rows, their
    ratios from their own rounds, and the progress count (aot_eager: seconds, not minutes)."""
    steps = []
    monkeypatch.setattr(timing.Progress, "step", lambda self, label: steps.append(label))
    argv = TINY + ["--what", "compiled", "--quick", "--models", "resnet18", "--dtypes", "float32",
                   "--compile-backend", "aot_eager", "--rounds", "2"]
    _, config = cli.configure(argv)
    assert config["models"] == ["resnet18"] and cli.configure(TINY)[1]["what"] == cli.DEFAULT_SECTIONS
    res = cli.main(argv)
    assert len(steps) == cli._steps(config)
    (row,) = res["compiled"]["models"]
    assert (row["model"], row["dtype"], list(row["results"])) == ("resnet18", "float32", real.COMPILED_CONFIGS)
    base = row["results"]["compile nn.ReLU"]
    for m in row["results"].values():
        assert m["held_bytes"] > 0 and math.isclose(m["held_vs_torch"], m["held_bytes"] / base["held_bytes"])
        assert math.isclose(m["vs_torch"], statistics.median(a / b for a, b in zip(m["rounds_s"], base["rounds_s"])))
        assert m["held_vs_eager"] is None  # (no memory section in this run)
    assert "real models under torch.compile (aot_eager): value and vs compile nn.ReLU" in report.format_tables(res)
    assert "held vs eager" not in report.format_tables(res)


@pytest.mark.full  # compiles two models
def test_compiled_configurations_run_what_they_say():
    """compile relu_ext: a copy with relu_ext's modules (the model itself keeps nn.ReLU), the
    same loss bit for bit as compile nn.ReLU; eager configurations run the model itself."""
    import relu_ext

    model, x = real.build("resnet18", torch.float32, "cpu", quick=True)
    assert real.prepare(model, "install+compact") is model
    plain, ext = (real.prepare(model, c, "aot_eager") for c in ("compile nn.ReLU", "compile relu_ext"))
    kinds = {c: {type(m) for m in mod._orig_mod.modules()} for c, mod in (("plain", plain), ("ext", ext))}
    assert torch.nn.ReLU in kinds["plain"] and relu_ext.ReLU not in kinds["plain"]
    assert relu_ext.ReLU in kinds["ext"] and torch.nn.ReLU not in kinds["ext"]
    assert plain._orig_mod is model
    with torch.no_grad():
        assert_bitwise_equal(real.loss_of(ext, x), real.loss_of(plain, x))


@pytest.mark.quick(cover=())  # (a real model each, at the benchmark's size)
@pytest.mark.parametrize("name", ["resnet18", "t5_relu"])
def test_selective_checkpointing_runs_what_it_says(name):
    """sac nn.ReLU: a copy of the model (same weights) with its blocks under op-level selective
    checkpointing (a transformers model through its own gradient_checkpointing_enable); the same loss
    and gradients bit for bit as the model itself, and less held, counted from the allocator, which
    counts what the hooks count for the model itself (within the graph's own small allocations)."""
    from relu_ext.bench import checkpointing

    model, inputs = real.build(name, torch.float32, "cpu", quick=False)
    sac = real.prepare(model, "sac nn.ReLU")
    assert sac is not model and any(isinstance(m, checkpointing.Checkpointed) for m in sac.modules()) or \
        getattr(sac, "is_gradient_checkpointing", False)
    hooks, allocated = real.held_bytes(model, inputs, "nn.ReLU"), real._allocated_by_forward(model, inputs)
    assert checkpointing.allocated_bytes() is not None and abs(allocated - hooks) < 0.01 * hooks
    assert 0 < real.held_bytes(sac, inputs, "sac nn.ReLU") < 0.9 * hooks
    steps = []
    for m in (model, sac):
        torch.manual_seed(1)
        loss = real.loss_of(m, inputs)
        loss.backward()
        steps.append((loss.detach(), [p.grad for p in m.parameters()]))
        m.zero_grad(set_to_none=True)
    assert_bitwise_equal(steps[1][0], steps[0][0], "loss")
    for a, b in zip(steps[1][1], steps[0][1], strict=True):
        assert_bitwise_equal(a, b, "gradient")


def test_a_transformer_variant_runs_its_model_under_autocast_or_eager_attention():
    """``<model>@autocast``: the float32 model whose forward runs under bfloat16 autocast (the loss of
    the model itself under autocast, bit for bit; selective checkpointing reaches its layers);
    ``@eager``: transformers' eager attention. Another variant is refused by the command line."""
    model, inputs = real.build("gpt2@autocast", torch.float32, "cpu", quick=True)
    assert isinstance(model, real.Autocast) and next(model.parameters()).dtype == torch.float32
    torch.manual_seed(1)  # (the same dropout in both)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        want = real.loss_of(model.model, inputs)
    torch.manual_seed(1)
    with torch.no_grad():
        assert_bitwise_equal(real.loss_of(model, inputs), want, "loss")
    assert real.prepare(model, "sac nn.ReLU").model.is_gradient_checkpointing
    eager, _ = real.build("gpt2@eager", torch.float32, "cpu", quick=True)
    plain, _ = real.build("gpt2", torch.float32, "cpu", quick=True)
    assert (eager.config._attn_implementation, plain.config._attn_implementation) == ("eager", "sdpa")
    assert set(real.VARIANT_MODELS) == {f"{m}@{v}" for m in real.TRANSFORMERS for v in ("autocast", "eager")}
    with pytest.raises(SystemExit):
        cli.configure(["--device", "cpu", "--models", "gpt2@fp8"])


def test_selective_checkpointing_of_a_model_without_blocks_checkpoints_it_whole():
    from relu_ext.bench import checkpointing

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    sac = real.prepare(model, "sac nn.ReLU")
    assert isinstance(sac, checkpointing.Checkpointed) and sac.block is not model
    x = torch.randn(3, 2)
    assert_bitwise_equal(sac(x), model(x), "output")


def test_held_bytes_leave_out_copies_of_parameters():
    """A saved copy of a parameter in another layout (what Inductor keeps of conv weights) is left
    out as the parameter itself is; a saved tensor of a parameter's shape with other values is not."""

    class Conv(torch.nn.Conv2d):
        def __init__(self, layout: torch.memory_format | None, scale: float = 1.0) -> None:
            super().__init__(8, 8, 3, padding=1)
            self.layout, self.scale = layout, scale

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = self.weight if self.layout is None else (self.weight * self.scale).contiguous(memory_format=self.layout)
            return torch.nn.functional.conv2d(torch.relu(x), w, self.bias, padding=1)

    x = torch.randn(4, 8, 16, 16)
    plain, copied, other = Conv(None), Conv(torch.channels_last), Conv(torch.channels_last, 2.0)
    for m in (copied, other):
        m.load_state_dict(plain.state_dict())
    held = {name: real.held_bytes(m, x, "nn.ReLU") for name, m in
            (("plain", plain), ("copied", copied), ("other", other))}
    assert held["copied"] == held["plain"] > 0
    assert held["other"] == held["plain"] + plain.weight.nbytes


USER_MODEL = """
from torch import nn

def build():  # ReLU -> average pool: nothing but the ReLU keeps its output
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 4))

def not_a_module():
    return "a string"

def broken():
    raise RuntimeError("cannot build\\nsecond line")

VALUE = 3
"""


@pytest.fixture
def user_model(tmp_path, monkeypatch):
    """(module name, its folder): a module of models importable from this process only."""
    name = f"bench_user_model_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(USER_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, tmp_path
    sys.modules.pop(name, None)


def test_user_model_runs_every_configuration(user_model, monkeypatch):
    """--model MODULE:CALLABLE: the memory and compiled sections' configurations on the user's model; the
    peak workers are asked for it with its shape and with the import path that found it (faked here:
    test_peak_worker_finds_the_user_model runs a real one)."""
    name, folder = user_model
    target = f"{name}:build"
    specs = []

    def fake_worker(spec):
        specs.append(spec)
        return {f"{m}/{d}": {"peak_bytes": 1000, "peak_method": "fake"} for m in spec["models"] for d in spec["dtypes"]}

    monkeypatch.setattr(real, "run_worker", fake_worker)
    assert cli.configure(["--device", "cpu", "--model", target, "--input-shape", "2,3,8,8"])[1]["what"] == ["memory"]
    both = cli.configure(["--device", "cpu", "--model", target, "--input-shape", "2,3,8,8", "--models", "darknet"])[1]
    assert both["models"] == ["darknet", target]
    res = cli.main(TINY + ["--model", target, "--input-shape", "2,3,8,8", "--what", "memory,compiled", "--dtypes",
                           "float32", "--impls", "torch,relu_ext", "--compile-backend", "aot_eager", "--rounds", "2"])
    assert res["config"]["models"] == [target] and res["config"]["input_shapes"] == {target: [2, 3, 8, 8]}
    (row,) = res["memory"]["models"]
    assert (row["model"], row["dtype"], row["input"], list(row["results"])) == (target, "float32", "2x3x8x8",
                                                                                 real.CONFIGS)
    held = {c: m["held_bytes"] for c, m in row["results"].items()}
    assert held["install"] < 0.5 * held["nn.ReLU"]  # the mask instead of the ReLU's output
    assert all(len(m["rounds_s"]) == 2 and m["peak_bytes"] == 1000 for m in row["results"].values())
    (compiled,) = res["compiled"]["models"]
    assert compiled["model"] == target and list(compiled["results"]) == real.COMPILED_CONFIGS
    # Both sections ran: the compiled rows are also compared with eager nn.ReLU's held bytes.
    for m in compiled["results"].values():
        assert math.isclose(m["held_vs_eager"], m["held_bytes"] / held["nn.ReLU"])
    assert "held vs eager nn.ReLU (memory section), compile nn.ReLU / compile relu_ext:" in report.format_tables(res)
    assert [s["config"] for s in specs] == real.CONFIGS + real.COMPILED_CONFIGS
    assert all(s["models"] == [target] and s["shapes"] == {target: [2, 3, 8, 8]} and str(folder) in s["path"]
               for s in specs)


@pytest.mark.full  # a peak worker's process
def test_peak_worker_finds_the_user_model(user_model):
    """A fresh process, which has the folder only through the spec's path."""
    name, folder = user_model
    target = f"{name}:build"
    spec = {"device": "cpu", "config": "install+compact", "quick": True, "models": [target], "backend": "inductor",
            "dtypes": ["float32"], "shapes": {target: [2, 3, 8, 8]}, "path": [str(folder)]}
    out = real.run_worker(spec)
    assert list(out) == [f"{target}/float32"] and out[f"{target}/float32"]["peak_bytes"] >= 0


def test_user_model_from_a_file(user_model):
    name, folder = user_model
    path = folder / "models_by_path.py"
    path.write_text(USER_MODEL)
    try:
        model, x = real.build(f"{path}:build", torch.bfloat16, "cpu", quick=True, shape=[2, 3, 8, 8])
        assert model.training and model[0].weight.dtype == torch.bfloat16 and x.shape == (2, 3, 8, 8)
        assert real.describe(f"{path}:build", x) == "2x3x8x8"
    finally:
        sys.modules.pop("models_by_path", None)


@pytest.mark.parametrize("argv, message", [
    (["--model", "{m}:nope", "--input-shape", "2,3,8,8"], "--model {m}:nope: {m} has no attribute 'nope'"),
    (["--model", "no_such_module_here:build", "--input-shape", "2,3,8,8"],
     "cannot import no_such_module_here: ModuleNotFoundError: No module named 'no_such_module_here'"),
    (["--model", "/no/such/file.py:build", "--input-shape", "2"], "cannot import /no/such/file.py: FileNotFoundError"),
    (["--model", "{m}:not_a_module", "--input-shape", "2,3,8,8"],
     "not_a_module() returned a value of type str, not a torch.nn.Module"),
    (["--model", "{m}:broken", "--input-shape", "2,3,8,8"], "broken() failed: RuntimeError: cannot build"),
    (["--model", "{m}:VALUE", "--input-shape", "2,3,8,8"], "VALUE is of type int, not callable"),
    (["--model", "{m}", "--input-shape", "2,3,8,8"], "--model {m}: expected MODULE:CALLABLE"),
    (["--model", "{m}:build", "--input-shape", "2,4,8,8"],
     "a forward on a float32 input of shape 2x4x8x8 failed: RuntimeError: Given groups=1"),
    (["--model", "{m}:build", "--input-shape", "2,x"], "--input-shape '2,x': expected positive integers"),
    (["--model", "{m}:build", "--input-shape", "2,3,0,8"], "--input-shape '2,3,0,8': expected positive integers"),
    (["--model", "{m}:build"], "--model needs --input-shape"),
    (["--input-shape", "2,3,8,8"], "--input-shape is the input of a --model; no --model given"),
    (["--model", "{m}:build", "--model", "{m}:VALUE", "--input-shape", "1", "--input-shape", "2", "--input-shape", "3"],
     "--input-shape given 3 times for 2 --model"),
    (["--model", "{m}:build", "--input-shape", "2,3,8,8", "--what", "kernels"], "--what kernels has neither"),
])
def test_user_model_errors_are_one_line(argv, message, user_model, capsys):
    name, _ = user_model
    with pytest.raises(SystemExit) as exc:
        cli.configure(["--device", "cpu"] + [a.format(m=name) for a in argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("python -m relu_ext.bench: error: ") and message.format(m=name) in err, err


def test_user_model_error_from_the_command_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "relu_ext.bench", "--model", "no_such_module_here:build",
                          "--input-shape", "2,3,8,8"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.splitlines()[-1] == ("python -m relu_ext.bench: error: --model no_such_module_here:build: cannot "
                                           "import no_such_module_here: ModuleNotFoundError: No module named "
                                           "'no_such_module_here'")


def test_models_whose_package_is_missing_are_skipped(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # what an import then finds: not installed
    assert real.missing("resnet18") == "torchvision is not installed"
    assert real.missing("darknet") is None and real.missing("t5_relu") is None
    _, config = cli.configure(["--device", "cpu", "--what", "memory", "--models", "resnet18,darknet,mobilenet_v2"])
    assert config["models"] == ["darknet"]
    assert config["skipped_models"] == {m: "torchvision is not installed" for m in ("resnet18", "mobilenet_v2")}
    assert cli.configure(["--device", "cpu", "--what", "kernels", "--models", "resnet18"])[1]["skipped_models"] == {}


@pytest.mark.full  # a --quick run in a process of its own
def test_quick_run_without_torchvision_and_transformers(tmp_path):
    """A whole process tree (the run and any worker) in which neither package imports: the models
    that need them are skipped, each with one line, and the rest runs."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torchvision'] = None\n"
                                               "sys.modules['transformers'] = None\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-m", "relu_ext.bench", "--quick", "--what", "kernels,memory", "--sizes",
                          "1024", "--dtypes", "float32", "--impls", "torch,relu_ext"] + TINY + ["--rounds", "1"],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[:2] == ["skipped resnet18: torchvision is not installed",
                         "skipped t5_relu: transformers is not installed"]
    assert any(line.startswith("  1K fwd ") for line in lines) and "memory saved for backward" in out.stdout
    models = {line.split()[0] for line in lines if line.split() and line.split()[0] in real.MODELS}
    assert models == {"mlp50"}, out.stdout  # (needs neither)


def make_readme():
    """bench/make_readme.py, a script of the repository (not of the package), as a module."""
    spec = importlib.util.spec_from_file_location("make_readme", ROOT / "bench" / "make_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_readme_is_what_make_readme_writes():
    """bench/README.md cannot go stale: after adding a results file, run python bench/make_readme.py."""
    results = ROOT / "bench" / "results"
    if not results.is_dir():
        pytest.skip("no bench/results here (an unpacked sdist leaves the figures out)")
    assert (ROOT / "bench" / "README.md").read_text() == make_readme().render(results), \
        "bench/README.md is stale: run python bench/make_readme.py"


def markdown_rows(text, first_cells):
    """{column: cell} of the markdown table row whose first cells are `first_cells` (a size may carry
    the ! of a slow copy), by its table's header."""
    lines = text.splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] if line.startswith("| ") else [] for line in lines]
    k = next(i for i, row in enumerate(cells) if [c.rstrip("!") for c in row[:len(first_cells)]] == first_cells)
    head = next(i for i in range(k, -1, -1) if lines[i + 1].startswith("| ---"))
    return dict(zip(cells[head], cells[k]))


@pytest.mark.full  # the run behind `result` takes minutes
@pytest.mark.xdist_group("bench_result")  # one worker runs it
def test_make_readme_summarises_each_results_file(result, tmp_path):
    res, _ = result
    mr = make_readme()
    results = tmp_path / "results"
    (results / "gpu-x").mkdir(parents=True)
    (results / "run.json").write_text(json.dumps(res))
    (results / "gpu-x" / "env.json").write_text(json.dumps({"device": "H100"}))  # a GPU check's, not the bench's
    older = json.loads(json.dumps(res))
    older["environment"]["date"] = "2020-01-01T00:00:00"
    (results / "gpu-x" / "older.json").write_text(json.dumps(older))
    text = mr.render(results)
    assert text.index("## run") < text.index("## gpu-x/older")  # newest first, named by its path
    assert "Skipped (not results of `python -m relu_ext.bench`): `results/gpu-x/env.json`." in text
    assert f"{res['environment']['cpu']}, {res['environment']['threads']} threads" in text
    for section, case in (("kernels", "bwd"), ("family", "relu6 bwd"), ("kernels", "compact")):
        rows = [r for r in res[section] if (r["dtype"], r["case"]) == ("float32", case)]
        ext = [r["results"]["relu_ext"] for r in rows]
        fmt, key = (".2f", "vs_torch") if case != "compact" else (".0%", "of_copy")
        low, high = (format(f(c[key] for c in ext), fmt) for f in (min, max))
        want = (low if low == high else f"{low}-{high}") + (" of copy" if case == "compact" else "")
        marked = any(r["marks"] or r["results"]["relu_ext"]["marks"] for r in rows)
        assert len(rows) == 2 and markdown_rows(text, [case])["float32"] == want + ("~" if marked else "")
    m = next(r for r in res["memory"]["models"] if (r["model"], r["dtype"]) == ("resnet18", "float32"))
    cells = markdown_rows(text, ["resnet18", "float32", m["input"]])
    got = m["results"]["install+compact"]
    assert cells["install+compact"].rstrip("~") == \
        f"{got['held_vs_torch']:.2f} · {got['peak_vs_torch']:.2f} · {got['vs_torch']:.2f}"
    assert cells["nn.ReLU held MiB"] == f"{m['results']['nn.ReLU']['held_bytes'] / 2**20:.1f}"
    readme = tmp_path / "README.md"
    check = ["--check", "--results", str(results), "--readme", str(readme)]
    assert mr.main(check) == 1  # missing
    assert mr.main(check[1:]) == 0 and readme.read_text() == text and mr.main(check) == 0
    (results / "run.json").write_text(json.dumps(dict(res, environment=dict(res["environment"], torch="9.9"))))
    assert mr.main(check) == 1  # stale


def test_bench_readme_is_short():
    """bench/README.md summarises the kept runs (the latest per device and section), not every run ever."""
    readme = ROOT / "bench" / "README.md"
    if not readme.exists():
        pytest.skip("no bench/README.md here (an unpacked sdist)")
    assert len(readme.read_text().splitlines()) <= 300


def test_bench_modules_import_no_circle():
    """relu_ext.bench's modules import one another in one direction (function-level imports too)."""
    folder = Path(cli.__file__).parent
    graph = {}
    for path in folder.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("relu_ext.bench."):
                deps.add(node.module.split(".")[2])
        graph[path.stem] = deps & {p.stem for p in folder.glob("*.py")}
    assert graph["real"] >= {"models"} and "real" not in graph["models"]  # the circle there once

    def reaches(start, goal, seen=()):
        return any(d == goal or (d not in seen and reaches(d, goal, (*seen, d))) for d in graph[start])

    assert not [m for m in graph if reaches(m, m)], graph


def bench_script(name: str):
    """bench/<name>.py, one of the GPU sessions' scripts outside the package, as a module."""
    path = ROOT / "bench" / f"{name}.py"
    if not path.exists():
        pytest.skip(f"no bench/{name}.py here (an unpacked sdist)")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bn_probe():
    """bench/bn_probe.py (the BatchNorm formula probe) as a module."""
    return bench_script("bn_probe")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_bn_probe_tells_the_cpu_formula_apart(dtype):
    """On the CPU the probe's emulation of PyTorch's own formula (the replay's: fma(x, alpha, beta))
    must give every element, and in float32 the others must be told apart from it: else a GPU run's
    table of hit rates would say nothing."""
    probe = bn_probe()
    for layout in ("contiguous", "channels_last"):
        for training in (True, False):
            row = probe.probe_case(dtype, layout, training, "cpu")
            assert row["node"] == "NativeBatchNormBackward0"
            assert row["match"]["cpu fma(x, alpha, beta)"] == 1.0, row
            if dtype == torch.float32:
                others = [v for k, v in row["match"].items() if k != "cpu fma(x, alpha, beta)"]
                assert len(others) == 5 and max(others) < 0.9, row


def test_bn_probe_writes_its_table(tmp_path):
    probe = bn_probe()
    lines = []
    assert probe.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bn_probe.json").read_text())
    assert data["env"]["torch"] == torch.__version__
    assert len(data["rows"]) == 3 * 2 * 2  # dtypes x layouts x modes
    assert {r["mode"] for r in data["rows"]} == {"train", "eval"}
    assert all("_saved_input" in r["saved"] for r in data["rows"])
    probe.run("cpu", [False], log=lines.append)
    assert len(lines) == 12 and "best:" in lines[0]


def gpu_models():
    """bench/gpu_models.py (real models at GPU sizes) as a module."""
    return bench_script("gpu_models")


@pytest.mark.full  # minutes on the CPU
def test_gpu_models_runs_every_configuration_on_the_cpu(tmp_path):
    """The GPU models' code path at toy sizes on the CPU (no compile: minutes here): every case and
    configuration has its figures, save_compact() holds less and counts what it did, and the JSON
    records the environment. Peak and host syncs are CUDA's measurements: None here."""
    gm = gpu_models()
    result = gm.main(["--device", "cpu", "--tiny", "--no-compile", "--rounds", "1", "--out", str(tmp_path),
                      "--cases", "resnet50:amp,resnet50:float32,gpt2:amp"])
    assert json.loads((tmp_path / "gpu_models.json").read_text()) == json.loads(json.dumps(result))
    assert result["configs"] == ["nn.ReLU", "install", "install+save_compact", "sac nn.ReLU"]
    assert [(r["model"], r["precision"], r["input"]) for r in result["rows"]] == \
        [("resnet50", "amp", "2x3x64x64"), ("resnet50", "float32", "2x3x64x64"), ("gpt2", "amp", "2x16")]
    for row in result["rows"]:
        for config, r in row["results"].items():
            assert r["held_bytes"] > 0 and r["step_s"] > 0 and r["peak_bytes"] is None, (config, r)
            assert r["host_syncs_per_step"] is None and any("sync" in k for k in r), r
        ours = row["results"]["install+save_compact"]
        # (Under autocast the bfloat16 copies of the weights, which every configuration holds, weigh most at toy sizes.)
        assert ours["held_vs_torch"] < (0.99 if row["precision"] == "amp" else 0.8), ours
        assert ours["save_compact"]["replayed" if row["model"] == "resnet50" else "remade"] > 0, ours
        assert ours["save_compact"]["replay_misses"] == 0, ours
    assert {"date", "torch", "device", "git_commit"} <= set(result["environment"])
    with pytest.raises(SystemExit):
        gm.main(["--device", "cpu", "--cases", "resnet50:float16"])


@pytest.mark.full  # real models through every configuration
def test_gpu_models_goes_on_after_a_failed_configuration(monkeypatch):
    """A configuration that raises (a compile error on some GPU) is recorded, and the others run."""
    gm = gpu_models()
    held = gm.real.held_bytes

    def failing(model, inputs, config, counts=None):
        if config == "install":
            raise RuntimeError("stand-in failure\nmore")
        return held(model, inputs, config, counts)

    monkeypatch.setattr(gm.real, "held_bytes", failing)
    result = gm.main(["--device", "cpu", "--tiny", "--no-compile", "--rounds", "1", "--cases", "resnet50:float32"])
    got = result["rows"][0]["results"]
    assert got["install"] == {"error": "RuntimeError: stand-in failure"}
    assert got["nn.ReLU"]["vs_torch"] == 1.0 and got["install+save_compact"]["held_vs_torch"] < 0.8


def test_hook_time_counts_every_saved_tensor(monkeypatch):
    """real.hook_us: save_compact()'s hooks timed over a step, per tensor saved; none without them.
    The best of `rounds` steps, and of more while they take less than its budget (short steps)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(128, 64)
    assert real.hook_us(model, x, "install") is None and real.hook_us(model, x, "nn.ReLU") is None
    steps = []
    wrap = real.HookTimer.wrap
    monkeypatch.setattr(real.HookTimer, "wrap", lambda self, sc: steps.append(sc) or wrap(self, sc))
    assert 0 < real.hook_us(model, x, "install+compact", rounds=2, budget_s=0) < 1e6 and len(steps) == 2
    steps.clear()
    real.hook_us(model, x, "install+compact", rounds=2, budget_s=0.2)
    assert 2 < len(steps) <= real.HOOK_STEPS
    monkeypatch.undo()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        real.loss_of(model, x)
    timer = real.HookTimer()
    with timer.wrap(relu_ext.save_compact()) as sc:
        loss = real.loss_of(model, x)
    loss.backward()
    assert timer.saved == len(saved) > 0 and timer.spent > 0 and sc.compacted == 1


def test_timed_hooks_make_the_forms_untimed_ones_do():
    """real.HookTimer times the block's hooks without changing what they do: a BatchNorm -> ReLU
    output is a recipe, which reads the BatchNorm's input through the block's own unpack hook."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 3))
    x = torch.randn(4, 3, 24, 24)
    counts = []
    for timer in (None, real.HookTimer()):
        sc = relu_ext.save_compact()
        with timer.wrap(sc) if timer is not None else sc:
            loss = real.loss_of(model, x)
        loss.backward()
        counts.append(real.compact_counts(sc))
    assert counts[0]["replayed"] == 1 and counts[1] == counts[0]
