"""The command line: `python -m relu_ext.bench` (see relu_ext/bench/__init__.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

import relu_ext

from . import __doc__ as DOC
from . import models, peers, real, report, timing

# Where results go unless --out says otherwise: a folder whose name says what it holds.
DEFAULT_OUT = "relu_ext-bench-results"

SECTIONS = ["kernels", "family", "small", "memory", "models", "compiled"]
DEFAULT_SECTIONS = ["kernels", "family", "small", "memory", "models"]  # compiled: on request (minutes of compiling)
SMALL_SIZES = [2**k for k in range(10, 17)]
DEFAULT_SIZES = {"cpu": [4**k for k in range(8, 14)], "cuda": [4**k for k in range(8, 15)]}
# On CPU the seed and compile peers run 2-25x slower than torch (a call of
# theirs at 64M elements takes up to a second): timed up to this size.
SLOW_PEERS = ("seed", "compile")
SLOW_PEERS_MAX = {"cpu": 2**24, "cuda": None}
QUICK_SIZES = {"cpu": [2**16, 2**20, 2**22], "cuda": [2**20, 2**24, 2**28]}
QUICK_SMALL_SIZES = [2**10, 2**14, 2**16]
DEFAULTS = {"rounds": 5, "budget": 0.25, "small_budget": 0.1}
QUICK = {"rounds": 3, "budget": 0.04, "small_budget": 0.03}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m relu_ext.bench", description=DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--sizes", help="comma-separated element counts for the kernel section "
                                   "(default: 64K-64M on CPU, 64K-256M on CUDA; --quick: three sizes). "
                                   "On CPU, seed and compile are timed up to 16M elements")
    p.add_argument("--what", help=f"sections, from {SECTIONS} (default: all but compiled; with --model: memory)")
    p.add_argument("--models", help=f"real models of the memory and compiled sections, from {real.MODELS} (default: "
                                    f"all; --quick: {','.join(real.QUICK_MODELS)}; with --model: none of them), and "
                                    f"variants of the transformers: <name>@{{{','.join(real.VARIANTS)}}}. "
                                    "A model whose package (torchvision, transformers) is missing is skipped")
    p.add_argument("--model", action="append", default=[], metavar="MODULE:CALLABLE",
                   help="your own model in the memory and compiled sections (repeatable): CALLABLE() in MODULE (a "
                        "module name, or a path to a .py file) returns the nn.Module, whose forward takes one "
                        "floating-point tensor of --input-shape and returns a tensor; random input, its loss the "
                        "output's mean square")
    p.add_argument("--input-shape", action="append", default=[], metavar="N,C,H,W",
                   help="the input's shape for --model, e.g. 2,3,224,224: once for every --model, or once per "
                        "--model in the same order")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compiled section (default inductor)")
    p.add_argument("--impls", default=",".join(peers.IMPLS), help="implementations (triton: CUDA only)")
    p.add_argument("--rounds", type=int, help=f"interleaved rounds per row (default {DEFAULTS['rounds']}, "
                                              f"--quick {QUICK['rounds']})")
    p.add_argument("--budget", type=float, help=f"seconds per figure, split over the rounds (default "
                                                f"{DEFAULTS['budget']}, small section {DEFAULTS['small_budget']}; "
                                                f"--quick {QUICK['budget']})")
    p.add_argument("--max-spread", type=float, default=timing.MAX_SPREAD,
                   help="mark a figure whose rounds' interquartile range exceeds this fraction of its median")
    p.add_argument("--malloc", choices=["steady", "as-is"], default="steady",
                   help="steady (default): glibc reuses freed memory of every size, as a caching allocator does, "
                        "so the figures are the kernels'; as-is: glibc's defaults, where allocating ops of 32 MiB "
                        "and more pay page faults on every call")
    p.add_argument("--cuda-unroll", type=int, choices=[1, 2, 4],
                   help="rows of 16-byte vectors each warp of relu_ext's CUDA kernels loads per iteration "
                        "(tuning: compare the compiled choices; default: the built-in one)")
    p.add_argument("--cuda-waves", type=cuda_waves, metavar="0..64",
                   help="cap relu_ext's CUDA grids at this many waves of the blocks that fit on the device at "
                        "once; 0: no cap, one group of rows per warp, as PyTorch launches (the default; tuning)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run in under a minute on 2 cores: three sizes per section, fewer and shorter "
                        "rounds, tiny models")
    p.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                   help=f"folder for NAME.json and NAME.png (default: {DEFAULT_OUT} in the current folder)")
    p.add_argument("--name", help="file name stem (default: device-model-dateTtime, e.g. "
                                  "cpu-amd-epyc-2t-2026-11-24T2325)")
    p.add_argument("--no-files", action="store_true", help="print the tables only")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress on stderr (default: a bar on a terminal, else a line every 15 s)")
    p.add_argument("--peak-worker", help=argparse.SUPPRESS)
    return p


def cuda_waves(text: str) -> int:
    """--cuda-waves: a whole number of waves, 0 (no grid cap) to 64."""
    if not text.isdigit() or int(text) > 64:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of waves, 0 (no cap) to 64")
    return int(text)


def fail(p: argparse.ArgumentParser, message: str) -> None:
    """Exits with one line (p.error would print the whole usage above it)."""
    p.exit(2, f"{p.prog}: error: {message}\n")


def parse_shape(text: str) -> list[int]:
    """"2,3,224,224" -> [2, 3, 224, 224]; ValueError unless positive integers."""
    shape = [int(v) for v in text.split(",")]
    if not shape or min(shape) < 1:
        raise ValueError(text)
    return shape


def user_models(p: argparse.ArgumentParser, args: argparse.Namespace, what: list[str]) -> dict[str, list[int]]:
    """Each --model and its input shape, the model built and run once (a model that cannot run
    fails here, in one line, rather than in a worker process minutes later)."""
    if not args.model:
        if args.input_shape:
            fail(p, "--input-shape is the input of a --model; no --model given")
        return {}
    if not {"memory", "compiled"} & set(what):
        fail(p, f"--model runs in the memory and compiled sections; --what {','.join(what)} has neither")
    if not args.input_shape:
        fail(p, "--model needs --input-shape, the shape of the model's input, e.g. --input-shape 2,3,224,224")
    if len(args.input_shape) not in (1, len(args.model)):
        fail(p, f"--input-shape given {len(args.input_shape)} times for {len(args.model)} --model: give it once "
                "for all, or once per --model")
    shapes = []
    for text in args.input_shape:
        try:
            shapes.append(parse_shape(text))
        except ValueError:
            fail(p, f"--input-shape {text!r}: expected positive integers separated by commas, e.g. 2,3,224,224")
    pairs = dict(zip(args.model, shapes * len(args.model) if len(shapes) == 1 else shapes))
    for target, shape in pairs.items():
        try:
            real.check_user_model(target, shape, args.device)
        except real.UserModelError as err:
            fail(p, str(err))
    return pairs


def configure(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict[str, Any]]:
    """Parsed arguments and the run's configuration, defaults filled in."""
    p = parser()
    args = p.parse_args(argv)
    if args.peak_worker:
        return args, {}
    what = (args.what or ("memory" if args.model else ",".join(DEFAULT_SECTIONS))).split(",")
    unknown = (set(what) - set(SECTIONS)) | (set(args.impls.split(",")) - set(peers.IMPLS))
    if unknown:
        p.error(f"unknown section or implementation: {sorted(unknown)}")
    if args.device not in ("cpu", "cuda"):
        p.error(f"--device {args.device}: relu_ext has kernels for cpu and cuda")
    if args.device == "cuda" and not relu_ext.cuda_available():
        p.error("--device cuda: " + ("this relu_ext build has no CUDA kernels" if not relu_ext.build_info()["cuda"]
                                      else "torch sees no GPU"))
    if args.cuda_unroll is not None:
        if args.device != "cuda":
            p.error(f"--cuda-unroll {args.cuda_unroll}: applies to --device cuda only")
        relu_ext._C.set_cuda_unroll(args.cuda_unroll)
    if args.cuda_waves is not None:
        if args.device != "cuda":
            p.error(f"--cuda-waves {args.cuda_waves}: applies to --device cuda only")
        relu_ext._C.set_cuda_waves(args.cuda_waves)
    if args.models:
        names = args.models.split(",")
    else:  # the user's own models (--model) replace the built-in ones
        names = [] if args.model else real.QUICK_MODELS if args.quick else real.MODELS
    known = set(real.MODELS) | set(real.VARIANT_MODELS)
    if set(names) - known:
        p.error(f"--models: {sorted(set(names) - known)} not among {real.MODELS} or {real.VARIANT_MODELS}")
    for d in args.dtypes.split(","):
        if d not in ("float32", "float64", "float16", "bfloat16"):
            p.error(f"--dtypes: {d!r} is not one of float32, float64, float16, bfloat16")
    base = QUICK if args.quick else DEFAULTS
    rounds = base["rounds"] if args.rounds is None else args.rounds
    if rounds < 1:
        p.error(f"--rounds {rounds}: must be at least 1")
    if args.budget is not None and args.budget <= 0:
        p.error(f"--budget {args.budget}: must be above 0 seconds")
    shapes = user_models(p, args, what)
    # Only where they would run: importing torchvision and transformers takes seconds.
    skipped = {n: why for n in names if {"memory", "compiled"} & set(what) and (why := real.missing(n))}
    default_sizes = (QUICK_SIZES if args.quick else DEFAULT_SIZES)[args.device]
    config = {
        "device": args.device,
        "dtypes": args.dtypes.split(","),
        "sizes": [int(s) for s in args.sizes.split(",")] if args.sizes else default_sizes,
        "small_sizes": QUICK_SMALL_SIZES if args.quick else SMALL_SIZES,
        "what": what,
        "models": [n for n in names if n not in skipped] + list(shapes),
        "input_shapes": shapes,
        "skipped_models": skipped,
        "compile_backend": args.compile_backend,
        "impls": [i for i in args.impls.split(",") if i in peers.available_impls(args.device)],
        "rounds": rounds,
        "budget_s": args.budget or base["budget"],
        "small_budget_s": args.budget or base["small_budget"],
        "max_spread": args.max_spread,
        "copy_low": timing.COPY_LOW,
        "slow_peers_max": SLOW_PEERS_MAX[args.device],
        "quick": args.quick,
        "malloc": args.malloc,
    }
    return args, config


def impls_at(n: int, impls: list[str], slow_peers_max: int | None) -> list[str]:
    """The implementations timed at n elements."""
    return [i for i in impls if slow_peers_max is None or n <= slow_peers_max or i not in SLOW_PEERS]


def run_rows(section: str, device: str, dtypes: list[torch.dtype], sizes: list[int], impls: list[str],
             rounds: int, budget_s: float, max_spread: float, progress: timing.Progress,
             slow_peers_max: int | None = None) -> list[dict[str, Any]]:
    """One row per dtype, size and case. Per dtype and size, every case's
    implementations and the copy run interleaved in the same rounds."""
    cases_of = {"small": peers.small_cases, "family": peers.family_cases}.get(section, peers.kernel_cases)
    rows = []
    for dtype in dtypes:
        for n in sizes:
            x = torch.randn(n, dtype=dtype, device=device)
            buf = torch.empty_like(x)
            cases = cases_of(x, impls_at(n, impls, slow_peers_max))
            fns = {("copy", "copy"): lambda: buf.copy_(x)}
            fns.update({(case, impl): fn for case, v in cases.items() for impl, (fn, _) in v.items()})
            label = f"{section} {peers.dtype_name(dtype)} {report.size_label(n)}"
            samples = timing.interleave(fns, device, rounds, budget_s, lambda k: progress.step(f"{label} {k[0]} {k[1]}"))
            for case, v in cases.items():
                meta = {"section": section, "device": device, "dtype": peers.dtype_name(dtype), "numel": n,
                        "case": case, "copy_bytes": 2 * n * x.element_size()}
                results = {impl: (samples[(case, impl)], nbytes) for impl, (_, nbytes) in v.items()}
                rows.append(timing.make_row(meta, samples[("copy", "copy")], results, max_spread))
            del x, buf, cases, fns
    return rows


def _steps(config: dict[str, Any]) -> int:
    """How many progress steps the run takes."""
    impls, device = config["impls"], config["device"]
    zeros = torch.zeros(8, device=device)
    per_size = [1 + sum(map(len, peers.kernel_cases(zeros, impls_at(n, impls, config["slow_peers_max"])).values()))
                for n in config["sizes"]]
    per_small = 1 + sum(len(v) for v in peers.small_cases(zeros, impls).values())
    per_family = 1 + sum(len(v) for v in peers.family_cases(zeros, impls).values())
    model_impls = [i for i in models.MODEL_IMPLS if i in impls]
    what, dtypes, names, rounds = config["what"], len(config["dtypes"]), len(config["models"]), config["rounds"]
    return rounds * (("kernels" in what) * dtypes * sum(per_size)
                     + ("family" in what) * dtypes * len(config["sizes"]) * per_family
                     + ("small" in what) * len(config["small_sizes"]) * per_small
                     + ("models" in what) * len(models.MODELS) * len(model_impls)) \
        + ("memory" in what) * (dtypes + real.steps(dtypes, names, len(real.CONFIGS), rounds)) \
        + ("compiled" in what) * real.steps(dtypes, names, len(real.COMPILED_CONFIGS), rounds)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; prints the tables, writes NAME.json and NAME.png
    unless --no-files; returns what the JSON holds."""
    args, config = configure(argv)
    if args.peak_worker:
        print(json.dumps(real.peak_worker(json.loads(args.peak_worker))))
        return {}
    env = report.environment(config["device"])
    env["malloc"] = timing.steady_malloc() if config["malloc"] == "steady" else "as is (glibc defaults)"
    warning = timing.load_warning(env["load_start"])
    if warning:
        print(warning, file=sys.stderr)
    for name, why in config["skipped_models"].items():
        print(f"skipped {name}: {why}", flush=True)
    mode = ("bar" if sys.stderr.isatty() else "lines") if args.progress is not False else "off"
    progress = timing.Progress(_steps(config), mode)
    device, impls, rounds, what = config["device"], config["impls"], config["rounds"], config["what"]
    dtypes = [getattr(torch, d) for d in config["dtypes"]]
    result: dict[str, Any] = {"environment": env, "config": config}
    if "kernels" in what:
        result["kernels"] = run_rows("kernels", device, dtypes, config["sizes"], impls, rounds, config["budget_s"],
                                     config["max_spread"], progress, config["slow_peers_max"])
    if "family" in what:
        result["family"] = run_rows("family", device, dtypes, config["sizes"], impls, rounds, config["budget_s"],
                                    config["max_spread"], progress)
    if "small" in what:
        result["small"] = run_rows("small", device, dtypes[:1], config["small_sizes"], impls, rounds,
                                   config["small_budget_s"], config["max_spread"], progress)
    if "memory" in what:
        result["memory"] = real.run_memory(device, dtypes, impls, config["models"], config["quick"], rounds,
                                           config["budget_s"], config["max_spread"], progress, config["input_shapes"])
    if "models" in what:
        result["models"] = models.run_models(device, impls, rounds, config["budget_s"], config["quick"], progress,
                                             config["max_spread"])
    if "compiled" in what:
        result["compiled"] = {"models": real.run(device, dtypes, config["models"], config["quick"], rounds,
                                                 config["budget_s"], config["max_spread"], progress,
                                                 real.COMPILED_CONFIGS, config["compile_backend"],
                                                 config["input_shapes"])}
        real.vs_eager(result["compiled"]["models"], result.get("memory", {}).get("models", []))
    rows = result.get("kernels", []) + result.get("family", []) + result.get("small", [])
    timing.mark_copy_low(rows, config["copy_low"])
    timed_models = result.get("models", []) + result.get("memory", {}).get("models", []) \
        + result.get("compiled", {}).get("models", [])
    result["trust"] = dict(timing.trust_summary(rows, timed_models), max_spread=config["max_spread"],
                           copy_low=config["copy_low"])
    env["load_end"] = timing.load_average()  # includes this run's own threads

    print(report.format_tables(result))
    if not args.no_files:
        # In a folder of its own a result needs no prefix; among a user's other files it does.
        name = args.name or report.default_name(env)
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, name)
        with open(stem + ".json", "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {stem}.json")
        panels = report.plot(result, stem + ".png")
        if panels is None:
            print("no plot: matplotlib is not installed (pip install matplotlib)")
        elif panels:
            print(f"wrote {stem}.png")
    return result
