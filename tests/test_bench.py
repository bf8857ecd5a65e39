"""The benchmark code itself: it runs at tiny sizes, its JSON holds the figures
it claims (every round), its ratios are computed from its own rounds, it marks
figures that cannot be trusted, and its peers compute ReLU (else their
timings would mean nothing)."""

import itertools
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import adversarial, assert_bitwise_equal
from relu_ext.bench import cli, models, peers, real, report, timing

# --malloc as-is: the default would retune malloc in this (pytest's) process for the rest of the suite.
TINY = ["--device", "cpu", "--rounds", "3", "--budget", "0.01", "--no-progress", "--no-files", "--malloc", "as-is"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    res = cli.main(["--device", "cpu", "--dtypes", "float32,bfloat16", "--sizes", "1024,4099", "--quick",
                    "--rounds", "3", "--budget", "0.01", "--impls", "torch,torch_out,compile,seed,relu_ext,installed",
                    "--out", str(out), "--name", "t", "--no-progress", "--malloc", "as-is"])
    return res, out


def test_files_written(result):
    res, out = result
    assert json.loads((out / "t.json").read_text()) == json.loads(json.dumps(res))
    png = (out / "t.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


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


@pytest.mark.parametrize("mode", ["steady", "as-is"])
def test_steady_malloc_keeps_large_blocks_in_the_heap(mode):
    """glibc's default gives a 64 MiB block its own mmap (fresh pages, one
    fault per 4 KiB, at every allocation); the bench's steady mode takes it
    from the heap, where freed memory is reused."""
    out = subprocess.run([sys.executable, "-c", WHERE, mode], capture_output=True, text=True, check=True).stdout
    first, where = out.splitlines()[0], out.split()[-1]
    if mode == "steady" and "LD_PRELOAD" in os.environ and first.startswith("as is"):
        # The sanitizer leg preloads ASan's malloc, which ignores mallopt: the bench says so.
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


def test_kernel_rows_schema_and_arithmetic(result):
    res = result[0]
    rows = res["kernels"]
    assert {(r["dtype"], r["numel"]) for r in rows} == {(d, n) for d in ("float32", "bfloat16") for n in (1024, 4099)}
    assert {r["case"] for r in rows} == set(peers.CASES)
    for r in rows:
        check_row(r, 3, res["config"]["max_spread"])
        e = 4 if r["dtype"] == "float32" else 2
        n, m = r["numel"], (r["numel"] + 7) // 8
        ext = r["results"]["relu_ext"]["bytes"]
        if r["case"] in ("compact", "expand"):  # the tensor, its mask, and the values kept (about half)
            assert n * e + m + 0.3 * n * e < ext < n * e + m + 0.7 * n * e, r["case"]
            assert set(r["results"]) == {"relu_ext"} and r["results"]["relu_ext"]["vs_torch"] is None
            continue
        want = {"fwd": 2 * n * e, "fwd (train)": 2 * n * e + m, "bwd": 2 * n * e + m,
                "fwd+bwd": 4 * n * e + 2 * m, "in-place": 2 * n * e}[r["case"]]
        assert ext == want, r["case"]
    fwd = [r for r in rows if r["case"] == "fwd"][0]
    assert set(fwd["results"]) == {"torch", "torch_out", "compile", "seed", "relu_ext"}
    # The cases of one dtype and size share the copy's rounds: they ran interleaved.
    same = [r["copy"]["rounds_s"] for r in rows if (r["dtype"], r["numel"]) == ("float32", 1024)]
    assert len(same) == len(peers.CASES) and all(s == same[0] for s in same)


def test_small_memory_models_sections(result):
    res = result[0]
    assert [(r["numel"], r["case"]) for r in res["small"]] == [(n, c) for n in cli.QUICK_SMALL_SIZES
                                                              for c in peers.SMALL_CASES]
    for r in res["small"]:
        want = {"torch", "seed", "relu_ext", "installed"} | (set() if r["case"].startswith("module") else {"compile"})
        assert set(r["results"]) == want, r["case"]
        check_row(r, 3, res["config"]["max_spread"])
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
            assert len(m["rounds_s"]) == 3
            assert math.isclose(m["vs_torch"], statistics.median(a / b for a, b in zip(m["rounds_s"], base["rounds_s"])))
    held = {(r["model"], r["dtype"]): {c: m["held_bytes"] for c, m in r["results"].items()} for r in mem}
    cnn = held[("resnet18", "float32")]
    # The next conv keeps the ReLU output: the mask alone frees nothing, compaction does.
    assert cnn["install"] >= cnn["nn.ReLU"] and cnn["install+compact"] < 0.9 * cnn["nn.ReLU"]
    assert cnn["nn.ReLU+compact"] < 0.9 * cnn["nn.ReLU"]
    # T5: ReLU -> dropout -> linear: nothing else keeps the ReLU output, so the mask alone saves.
    assert held[("t5_relu", "float32")]["install"] < held[("t5_relu", "float32")]["nn.ReLU"]
    for row in res["models"]:
        r, t = row["results"]["relu_ext"], row["results"]["torch"]
        assert len(r["rounds_s"]) == 3
        assert math.isclose(r["vs_torch"], statistics.median(a / b for a, b in zip(r["rounds_s"], t["rounds_s"])))
    text = report.format_tables(res)
    assert "kernels:" in text and "small tensors" in text and "training step" in text and "trust:" in text
    assert "real models, training mode" in text


def test_tables_fit_120_columns(result):
    """Six implementations (CUDA adds triton), GPU-sized GB/s and a figure far
    above the copy: every line still fits."""
    res = json.loads(json.dumps(result[0]))
    for r in res["kernels"] + res["small"]:
        r["results"]["triton"] = dict(r["results"]["relu_ext"], gbs=3012.5, of_copy=12.3, vs_torch=10.5)
        r["copy_gbs"] = 3100.0
    lines = report.format_tables(res).splitlines()
    assert max(map(len, lines)) <= report.WIDTH, max(lines, key=len)
    assert any("triton" in line for line in lines)


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


def test_family_rows(result):
    """Each activation of the family against PyTorch's op: forward, training forward (relu_ext
    writes the mask), backward (PyTorch's *_backward reads the input, relu_ext the mask) and in place."""
    res = result[0]
    rows = res["family"]
    assert {(r["dtype"], r["numel"]) for r in rows} == {(d, n) for d in ("float32", "bfloat16") for n in (1024, 4099)}
    assert {r["case"] for r in rows} == set(peers.FAMILY_CASES)
    for r in rows:
        check_row(r, 3, res["config"]["max_spread"])
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
                                  ["--models", "resnet18,alexnet"]])
def test_bad_arguments_are_named(argv, capsys):
    with pytest.raises(SystemExit):
        cli.configure(["--device", "cpu"] + argv)
    assert argv[1].split(",")[-1] in capsys.readouterr().err


def test_help_lists_the_flags():
    text = cli.parser().format_help()
    for flag in ("--rounds", "--budget", "--max-spread", "--quick", "--out", "--no-files", "--what", "--impls",
                 "--cuda-unroll", "--models", "--compile-backend"):
        assert flag in text
    assert "interleaved" in text and "marked" in text


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


def test_default_output_is_untracked_and_never_overwritten():
    env = {"device": "cpu", "cpu": "AMD EPYC", "threads": 2, "date": "2026-11-23T03:22:54"}
    later = dict(env, date="2026-11-23T05:10:07")
    assert report.default_name(env) == "cpu-amd-epyc-2t-2026-11-23T0322"
    assert report.default_name(later) != report.default_name(env)
    assert cli.parser().parse_args([]).out == "bench/out"
    out = subprocess.run(["git", "check-ignore", "-q", "bench/out/x.json"], cwd=Path(__file__).resolve().parents[1])
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


def test_small_section_has_installed_rows(result):
    res, _ = result
    cases = {r["case"] for r in res["small"] if "installed" in r["results"]}
    assert cases == set(peers.SMALL_CASES)
    assert not any("installed" in r["results"] for r in res["kernels"])


def test_held_bytes_count_what_the_graph_saves():
    """nn.ReLU's held bytes are exactly the saved storages that models.saved_bytes counts
    (parameters and inputs aside); compaction's count is what its packed objects keep."""
    model, x = real.build("resnet18", torch.float32, "cpu", quick=True)
    direct = models.saved_bytes(lambda: real.loss_of(model, x), list(model.parameters()) + [x])
    assert real.held_bytes(model, x, "nn.ReLU") == direct
    assert real.held_bytes(model, x, "nn.ReLU+compact") < 0.9 * direct


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
    assert "real models under torch.compile (aot_eager): value and vs compile nn.ReLU" in report.format_tables(res)


def test_compiled_configurations_run_what_they_say():
    """compile relu_ext: a copy with relu_ext's modules (the model itself keeps nn.ReLU), the
    same loss bit for bit as compile nn.ReLU; eager configurations run the model itself."""
    import relu_ext

    model, x = real.build("resnet18", torch.float32, "cpu", quick=True)
    assert real.prepare(model, "install+compact") is model
    plain, ext = (real.prepare(model, c, "aot_eager") for c in real.COMPILED_CONFIGS)
    kinds = {c: {type(m) for m in mod._orig_mod.modules()} for c, mod in (("plain", plain), ("ext", ext))}
    assert torch.nn.ReLU in kinds["plain"] and relu_ext.ReLU not in kinds["plain"]
    assert relu_ext.ReLU in kinds["ext"] and torch.nn.ReLU not in kinds["ext"]
    assert plain._orig_mod is model
    with torch.no_grad():
        assert_bitwise_equal(real.loss_of(ext, x), real.loss_of(plain, x))
