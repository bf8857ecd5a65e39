"""The benchmark code itself: it runs at tiny sizes, its JSON holds the figures
it claims, its ratios are computed from its own times, and its peers compute
ReLU (else their timings would mean nothing)."""

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import adversarial, assert_bitwise_equal
from relu_ext import bench


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    res = bench.main(["--device", "cpu", "--dtypes", "float32,bfloat16", "--sizes", "1024,4099", "--quick",
                      "--repeat", "5", "--budget", "0.01", "--impls", "torch,torch_out,compile,seed,relu_ext",
                      "--out", str(out), "--name", "t", "--no-progress"])
    return res, out


def test_files_written(result):
    res, out = result
    assert json.loads((out / "t.json").read_text()) == json.loads(json.dumps(res))
    png = (out / "t.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_environment_recorded(result):
    env = result[0]["environment"]
    for key in ("date", "device", "torch", "cuda", "cpu", "threads", "python", "relu_ext", "triton"):
        assert key in env, key
    assert env["torch"] == torch.__version__ and env["threads"] == torch.get_num_threads()


def test_kernel_rows_schema_and_arithmetic(result):
    rows = result[0]["kernels"]
    assert {(r["dtype"], r["numel"]) for r in rows} == {(d, n) for d in ("float32", "bfloat16") for n in (1024, 4099)}
    assert {r["case"] for r in rows} == set(bench.CASES)
    for r in rows:
        e = 4 if r["dtype"] == "float32" else 2
        n, m = r["numel"], (r["numel"] + 7) // 8
        assert math.isclose(r["copy_gbs"], 2 * n * e / r["copy"]["median_s"] / 1e9)
        torch_s = r["results"]["torch"]["median_s"]
        for impl, c in r["results"].items():
            assert c["p10_s"] <= c["median_s"] <= c["p90_s"] and c["samples"] >= 5
            assert math.isclose(c["gbs"], c["bytes"] / c["median_s"] / 1e9)
            assert math.isclose(c["of_copy"], c["gbs"] / r["copy_gbs"])
            assert math.isclose(c["vs_torch"], c["median_s"] / torch_s)
        ext = r["results"]["relu_ext"]["bytes"]
        want = {"fwd": 2 * n * e, "fwd (train)": 2 * n * e + m, "bwd": 2 * n * e + m,
                "fwd+bwd": 4 * n * e + 2 * m, "in-place": 2 * n * e}[r["case"]]
        assert ext == want, r["case"]
    fwd = [r for r in rows if r["case"] == "fwd"][0]
    assert set(fwd["results"]) == {"torch", "torch_out", "compile", "seed", "relu_ext"}


def test_small_memory_models_sections(result):
    res = result[0]
    assert [(r["numel"], r["case"]) for r in res["small"]] == [(n, c) for n in (1024, 2048, 4096) for c in bench.SMALL_CASES]
    for r in res["small"]:
        want = {"torch", "compile", "seed", "relu_ext"} if not r["case"].startswith("module") else {"torch", "seed", "relu_ext"}
        assert set(r["results"]) == want, r["case"]
        for c in r["results"].values():
            assert math.isclose(c["vs_torch"], c["median_s"] / r["results"]["torch"]["median_s"])
    per = {r["dtype"]: r["bytes_per_element"] for r in res["memory"]["saved_per_element"]}
    # nn.ReLU keeps its output, the tutorial Function its input, relu_ext 1 bit.
    assert per["float32"]["torch"] == 4 and per["bfloat16"]["torch"] == 2
    assert per["float32"]["seed"] == 4 and per["float32"]["relu_ext"] == 1 / 8 == per["bfloat16"]["relu_ext"]
    for row in res["memory"]["models"]:
        assert set(row["results"]) == {"torch", "seed", "relu_ext"}
        for m in row["results"].values():
            assert m["saved_bytes"] > 0 and m["peak_bytes"] >= 0  # tiny quick models can be below RSS resolution
    drop = {k: v["saved_bytes"] for k, v in res["memory"]["models"][1]["results"].items()}
    assert drop["relu_ext"] < drop["torch"], "with dropout after ReLU, relu_ext must save less"
    for row in res["models"]:
        assert math.isclose(row["results"]["relu_ext"]["vs_torch"],
                            row["results"]["relu_ext"]["median_s"] / row["results"]["torch"]["median_s"])
    text = bench.format_tables(res)
    assert "kernels:" in text and "small tensors" in text and "training step" in text


def test_saved_bytes_counts_distinct_storages():
    x = torch.randn(1000, requires_grad=True)
    w = torch.randn(1000, requires_grad=True)
    assert bench.saved_bytes(lambda: (x * w).sum()) == 8000
    assert bench.saved_bytes(lambda: (x * x).sum()) == 4000
    assert bench.saved_bytes(lambda: (x * w).sum(), exclude=[w]) == 4000


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_seed_peer_computes_relu(dtype):
    x = adversarial(4097, dtype, seed=3).nan_to_num(0.0)
    g = torch.randn_like(x)
    xs, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    bench.SeedReLU.apply(xs).backward(g)
    torch.relu(xt).backward(g)
    assert torch.equal(bench.SeedReLU.apply(x), torch.relu(x).abs())  # clamp gives +0 where relu keeps -0
    keep = x != 0  # at exactly 0 the tutorial passes the gradient, PyTorch does not
    assert torch.equal(xs.grad[keep], xt.grad[keep])


def test_triton_peer_computes_relu(monkeypatch):
    """The Triton kernels, run by Triton's interpreter on CPU tensors."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bench.triton_relu.cache_clear()
    try:
        fwd, bwd, fn = bench.triton_relu()
        for dtype in (torch.float32, torch.bfloat16):
            x = adversarial(3001, dtype, seed=5)
            x[(x.abs() < torch.finfo(dtype).tiny) & (x != 0)] = 1.0  # the peer may flush denormals; fine for timing
            y = fwd(x)
            assert_bitwise_equal(y, torch.relu(x), "triton forward")
            g = torch.randn_like(x)
            assert_bitwise_equal(bwd(g, y), torch.ops.aten.threshold_backward(g, torch.relu(x), 0), "triton backward")
    finally:
        bench.triton_relu.cache_clear()


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit):
        bench.main(["--impls", "torch,nope", "--no-files"])


def test_measure_runs_with_torchs_threads():
    """torch.utils.benchmark.Timer defaults to 1 thread; the bench must time
    with the threads torch uses, as the user's code runs."""
    seen = []
    stats = bench.measure(lambda: seen.append(torch.get_num_threads()), "cpu", 5, 0.01)
    assert stats["samples"] >= 5 and set(seen) == {torch.get_num_threads()}


def test_default_output_is_untracked_and_never_overwritten():
    env = {"device": "cpu", "cpu": "AMD EPYC", "threads": 2, "date": "2026-11-23T03:22:54"}
    later = dict(env, date="2026-11-23T05:10:07")
    assert bench.default_name(env) == "cpu-amd-epyc-2t-2026-11-23T0322"
    assert bench.default_name(later) != bench.default_name(env)
    out = subprocess.run(["git", "check-ignore", "-q", "bench/out/x.json"], cwd=Path(__file__).resolve().parents[1])
    if out.returncode != 128:  # 128: not a git checkout (an unpacked sdist)
        assert out.returncode == 0, "bench/out must be ignored by git"


def test_progress_lines_when_stderr_is_not_a_terminal(capsys):
    lines = bench.Progress(3, "lines", interval=0.0)
    for label in ("a", "b", "c"):
        lines.step(label)
    err = capsys.readouterr().err.splitlines()
    assert err == ["progress: 1/3, 0 s, a", "progress: 2/3, 0 s, b", "progress: 3/3, 0 s, c"]
    sparse = bench.Progress(3, "lines", interval=3600.0)
    for label in ("a", "b", "c"):
        sparse.step(label)
    assert capsys.readouterr().err.splitlines() == ["progress: 3/3, 0 s, c"]  # the last step always shows
    off = bench.Progress(3, "off")
    off.step("a")
    assert capsys.readouterr().err == ""
