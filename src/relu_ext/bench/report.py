"""What a run reports: its environment, the tables (at most 120 columns) and
the plot."""

from __future__ import annotations

import datetime
import platform
import re
import subprocess
import textwrap
from typing import Any, Callable

import torch

import relu_ext

from . import peers, timing

WIDTH = 120


def environment(device: str) -> dict[str, Any]:
    """Date, versions, CPU / GPU, threads and load: what a figure depends on."""
    env = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "relu_ext": relu_ext.build_info(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "threads": torch.get_num_threads(),
        "load_start": timing.load_average(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sms=props.multi_processor_count, gpu_memory_bytes=props.total_memory, driver=_driver())
    return env


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def default_name(env: dict[str, Any]) -> str:
    """device-model-dateTtime: a new run never overwrites an earlier one."""
    what = env.get("gpu") if env["device"] == "cuda" else f"{env['cpu']} {env['threads']}t"
    slug = re.sub(r"[^a-z0-9]+", "-", what.lower()).strip("-")
    return f"{env['device']}-{slug}-{env['date'][:16].replace(':', '')}"


def size_label(n: int) -> str:
    for unit, div in (("M", 2**20), ("K", 2**10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def _load(load: dict[str, Any]) -> str:
    return "unknown" if load["load1"] is None else f"{load['load1']:.2f}"


def _mark(marks: list[str]) -> str:
    return "~" if timing.NOISY in marks else " "


def _gbs(g: float) -> str:
    return f"{g:5.0f}" if g >= 99.95 else f"{g:5.1f}"


def _ratio(v: float | None) -> str:
    if v is None:  # a case torch has no counterpart for (compact, expand)
        return "   -"
    return f"{v:4.2f}" if v < 9.995 else f"{v:4.1f}" if v < 99.95 else f"{v:4.0f}"


def _vs(c: dict[str, Any]) -> float | None:
    """Time vs torch, or vs the copy where torch has no counterpart (compact, expand; older results: None)."""
    return c["vs_torch"] if c["vs_torch"] is not None else c.get("vs_copy")


def _pct(f: float) -> str:
    return f"{f:4.0%}" if f < 9.995 else f"{f:3.0f}x"


def _grid(rows: list[dict[str, Any]], title: str, lead_head: tuple[str, str], lead: Callable[[dict[str, Any]], str],
          cell: Callable[[str, dict[str, Any]], str], units: Callable[[str], str]) -> list[str]:
    """One block per dtype; one line per row, one column per implementation present. Two header
    lines: the dtype, lead_head[0] (its end) and the implementations' names; then lead_head[1]
    (the lead's column names) and each cell's figures (`units`, as wide as a cell)."""
    if not rows:
        return []
    impls = [i for i in peers.IMPLS if any(i in r["results"] for r in rows)]
    names, columns = lead_head
    lines = ["", title]
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        head = f"{dtype:<{len(columns) - len(names)}}{names}" + " ".join(f"{i:>{len(units(i))}}" for i in impls)
        lines += [head, columns + " ".join(units(i) for i in impls), "-" * len(head)]
        for r in (r for r in rows if r["dtype"] == dtype):
            lines.append(lead(r) + " ".join(cell(i, r["results"][i]) if i in r["results"] else " " * len(units(i))
                                            for i in impls))
    return lines


def _kernel_grid(rows: list[dict[str, Any]], title: str, case_width: int) -> list[str]:
    """The kernel and family tables: per row its size, case and the copy's GB/s; per
    implementation GB/s, fraction of the copy's GB/s and (but torch's) time vs torch."""
    return _grid(rows, title, (f"{'copy':>5}  ", f"{'size':>4} {'case':{case_width}} {'GB/s':>5}  "),
                 lambda r: f"{size_label(r['numel']):>4} {r['case']:{case_width}} {_gbs(r['copy_gbs'])}"
                           f"{'!' if timing.COPY_LOW_MARK in r['marks'] else ' '} ",
                 lambda i, c: (f"{_gbs(c['gbs'])} {_pct(c['of_copy'])}" + ("" if i == "torch" else f" {_ratio(_vs(c))}")
                               + _mark(c["marks"])),
                 lambda i: " GB/s copy " + ("" if i == "torch" else "vs T "))


def _fig(v: float) -> str:
    """About three significant digits in 8 columns: 316, 83.5, 1.25 (tiny user models: 0.03)."""
    return f"{v:8.{2 if v < 10 else 1 if v < 100 else 0}f}"


_CELL = 15  # (memory_lines: a figure in 8 columns, its ratio in 6, a mark)


def memory_lines(rows: list[dict[str, Any]], title: str = "real models, training mode") -> list[str]:
    """The real models' table: per model and dtype, for each configuration, MiB held by the
    graph after forward, peak MiB of a training step and its time in ms, each with its ratio
    to the first configuration's (nn.ReLU, or compile nn.ReLU; <1: less). The model, its
    dtype and its input stack in the first column; a longer (user) model name gets a line of its own."""
    if not rows:
        return []
    configs = list(rows[0]["results"])
    # (A longer model name than the dtype and input takes a line of its own, and a configuration's
    # name a line and a half, split at its "+", so that six configurations fit.)
    lead = min(26, max(14, *(len(r[k]) + 2 for r in rows for k in ("dtype", "input"))))
    heads = [c.split("+", 1) if "+" in c else ["", c] for c in configs]
    lines = ["", f"{title}: value and vs {configs[0]} (<1 less) for each configuration",
             f"{'model':{lead}} {'':9}" + "".join(f"{h:>{_CELL}}" for h, _ in heads),
             f"{'':{lead}} {'':9}" + "".join(f"{'+' + t if h else t:>{_CELL}}" for h, t in heads),
             f"{'  dtype, input':{lead}} {'metric':9}" + f"{'value':>8}{'x vs T':>7}" * len(configs)]
    lines.append("-" * len(lines[-1]))
    metrics = [("held MiB", lambda m: m["held_bytes"] / 2**20, "held_vs_torch"),
               ("peak MiB", lambda m: None if m["peak_bytes"] is None else m["peak_bytes"] / 2**20, "peak_vs_torch"),
               ("step ms", lambda m: m["median_s"] * 1e3, "vs_torch")]
    for r in rows:
        model = r["model"]
        if len(model) > lead:
            lines.append(model[:WIDTH])
            model = ""
        for name, (label, value, ratio) in zip((model, "  " + r["dtype"], "  " + r["input"]), metrics):
            cells = [(f"{'n/a':>8}" if value(m) is None else _fig(value(m)))
                     + (f"{'n/a':>6}" if m[ratio] is None else f"{m[ratio]:6.2f}")
                     + (_mark(m["marks"]) if label == "step ms" else " ") for m in r["results"].values()]
            lines.append(f"{name[:lead]:{lead}} {label:9}" + "".join(cells))
    methods = {m["peak_method"] for r in rows for m in r["results"].values()}
    lines.append("  held: distinct storages kept by saved tensors (parameters, copies of them, buffers and inputs aside), "
                 "exact")
    lines.append(f"  peak: {', '.join(sorted(methods))}"[:WIDTH])
    return lines + hook_lines(rows)


def hook_lines(rows: list[dict[str, Any]]) -> list[str]:
    """save_compact()'s host time per saved tensor (pack and unpack together) for each model, dtype
    and configuration that has one."""
    timed = [(r, {c: m["hook_us_per_saved"] for c, m in r["results"].items() if "hook_us_per_saved" in m})
             for r in rows]
    timed = [(r, us) for r, us in timed if us]
    if not timed:
        return []
    lines = ["  save_compact's hooks: host µs per saved tensor, pack and unpack together (best step of 1 s, 3 at least)"]
    for r, us in timed:
        cells = "  ".join(f"{c} {v:.1f}" for c, v in us.items())
        lines.append(f"    {r['model']} {r['dtype']}: {cells}"[:WIDTH])
    return lines


def format_tables(result: dict[str, Any]) -> str:
    """The tables the terminal shows; every line fits WIDTH columns."""
    env = result["environment"]
    load = env["load_start"]
    lines = [f"relu_ext benchmark: {env.get('gpu') or env['cpu']} ({env['device']}), "
             f"malloc {env.get('malloc', 'as is').split(':')[0]}",
             f"torch {env['torch']}, {env['threads']} threads, CPU kernels {env['relu_ext']['cpu_isa']}, {env['date']}, "
             f"load {_load(load)} on {load['cpus']} CPUs"]
    trust = result.get("trust")
    if trust:
        cfg = result["config"]
        lines += [f"{cfg['rounds']} interleaved rounds, {cfg['budget_s']} s per figure. Marks: ~ its rounds disagree "
                  f"(spread > {trust['max_spread']:.0%}),",
                  f"! the row's copy ran below {trust['copy_low']:.0%} of this run's best copy at that size (machine busy). "
                  f"Do not trust marked figures."]
    lines += _kernel_grid(result.get("kernels", []),
                          "kernels: GB/s of a copy_ of the same size (the ceiling) and of each implementation; copy: "
                          "its % of the copy's\nGB/s; vs T: its time vs torch's (<1 faster; compact, expand, bn, which "
                          "torch lacks: vs the copy's)", 11)
    lines += _kernel_grid(result.get("family", []),
                          "the family's kernels: GB/s, copy: % of a copy's GB/s, vs T: time vs torch's (<1 "
                          "faster); bwd: torch's\n*_backward reads the saved input and the gradient, relu_ext's "
                          "the 1-bit mask and the gradient", 23)
    lines += _grid(result.get("small", []), "small tensors, per call: microseconds, time vs torch's (<1 faster)",
                   ("", f"{'size':>4} {'case':14} "),
                   lambda r: f"{size_label(r['numel']):>4} {r['case']:14}{'!' if timing.COPY_LOW_MARK in r['marks'] else ' '}",
                   lambda i, c: f"{c['median_s'] * 1e6:7.2f} {_ratio(c['vs_torch'])}{_mark(c['marks'])}",
                   lambda i: "     µs vs T ")
    memory = result.get("memory")
    if memory:
        lines += ["", "memory saved for backward, bytes per element of one activation"]
        for r in memory["saved_per_element"]:
            lines.append(f"  {r['dtype']:9} " + "  ".join(f"{k} {v:.3f}" for k, v in r["bytes_per_element"].items()))
        lines += memory_lines(memory["models"])
    compiled = result.get("compiled")
    if compiled:
        lines += memory_lines(compiled["models"], f"real models under torch.compile "
                                                  f"({result['config'].get('compile_backend', 'inductor')})")
        vs = [f"{r['model']} {r['dtype']} " + " / ".join(f"{m['held_vs_eager']:.2f}" for m in r["results"].values())
              for r in compiled["models"] if all(m.get("held_vs_eager") for m in r["results"].values())]
        if vs:
            configs = " / ".join(compiled["models"][0]["results"])
            lines += [f"  held vs eager nn.ReLU (memory section), {configs}:"[:WIDTH],
                      *textwrap.wrap("; ".join(vs), WIDTH, initial_indent="    ", subsequent_indent="    ")]
    models = result.get("models", [])
    if models:
        lines += ["", "training step time (forward, loss, backward, SGD), ms, time vs torch"]
        for r in models:
            lines.append(f"  {r['model']:11} batch {r['batch']:4}  " + "   ".join(
                f"{i} {m['median_s'] * 1e3:.2f} {_ratio(m['vs_torch'])}{_mark(m['marks'])}" for i, m in r["results"].items()))
    if trust:
        lines += ["", f"trust: {trust['marked']} of {trust['figures']} figures marked ({trust['noisy']} noisy, "
                      f"{trust['copy_low_rows']} rows with a low copy)"]
    if load["busy"]:
        lines.append(timing.load_warning(load)[:WIDTH])
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> list[tuple[str, str]] | None:
    """Saves the figure; returns each panel's (title, y label), or None when
    matplotlib is not installed. Panels: GB/s vs size per dtype and kernel
    case (the copy as the ceiling), per-call time of the small cases, bytes
    saved per element, peak memory per model."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    env = result["environment"]
    kernels, small, memory = result.get("kernels", []), result.get("small", []), result.get("memory")
    dtypes = list(dict.fromkeys(r["dtype"] for r in kernels))
    cases = [c for c in peers.CASES if any(r["case"] == c for r in kernels)]
    extra: list[Callable[[Any], tuple[str, str]]] = []
    for case in [c for c in peers.SMALL_CASES if any(r["case"] == c for r in small)]:
        extra.append(lambda ax, case=case: _small_panel(ax, small, case))
    if memory:
        extra += [lambda ax: _saved_panel(ax, memory), lambda ax: _peak_panel(ax, memory)]
    cols = max([len(cases), min(len(extra), 5), 1])
    nrows = len(dtypes) + -(-len(extra) // cols)
    if nrows == 0:
        return []
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.4 * nrows), squeeze=False)
    panels = []
    for i, dtype in enumerate(dtypes):
        for j, case in enumerate(cases):
            panels.append(_gbs_panel(axes[i][j], [r for r in kernels if r["dtype"] == dtype and r["case"] == case],
                                     f"{dtype} {case}"))
    for k, draw in enumerate(extra):
        panels.append(draw(axes[len(dtypes) + k // cols][k % cols]))
    for ax in axes.flat:
        if not ax.has_data():
            ax.set_visible(False)
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_lines() if not h.get_label().startswith("_")}
    if handles:  # a run of bar panels only (--what memory) has no lines to name
        fig.legend(handles.values(), handles.keys(), loc="upper right", fontsize=8, ncol=len(handles))
    fig.suptitle(f"relu_ext vs peers: {env.get('gpu') or env['cpu']}, torch {env['torch']}, {env['date'][:10]}, "
                 f"load {_load(env['load_start'])}; hollow markers: marked not trustworthy", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return panels


def _impl_style(impl: str) -> dict[str, Any]:
    # One colour per implementation in every panel.
    return {"color": f"C{peers.IMPLS.index(impl)}", "lw": 2.2 if impl == "relu_ext" else 1.2, "label": impl}


def _series(ax: Any, pts: list[tuple[int, float, bool]], impl: str) -> None:
    """A line per implementation; marked (untrustworthy) points drawn hollow."""
    if not pts:
        return
    xs, ys, bad = zip(*pts)
    style = _impl_style(impl)
    ax.plot(xs, ys, marker="o", ms=3, **style)
    hollow = [(x, y) for x, y, b in pts if b]
    if hollow:
        ax.plot(*zip(*hollow), "o", ms=7, mfc="none", color=style["color"], label="_marked")


def _all_series(ax: Any, rows: list[dict[str, Any]], value: Callable[[dict[str, Any]], float]) -> None:
    """One line per implementation through `value` of its result in each row
    (rows sorted by size); a figure is marked when it or its row is."""
    for impl in peers.IMPLS:
        _series(ax, [(r["numel"], value(r["results"][impl]), bool(r["marks"] or r["results"][impl]["marks"]))
                     for r in rows if impl in r["results"]], impl)


def _gbs_panel(ax: Any, rows: list[dict[str, Any]], title: str) -> tuple[str, str]:
    rows = sorted(rows, key=lambda r: r["numel"])
    ax.plot([r["numel"] for r in rows], [r["copy_gbs"] for r in rows], "k--", label="copy (ceiling)")
    _all_series(ax, rows, lambda c: c["gbs"])
    return _axes(ax, title, "GB/s (higher is better)", log_y=False)


def _small_panel(ax: Any, rows: list[dict[str, Any]], case: str) -> tuple[str, str]:
    rows = sorted((r for r in rows if r["case"] == case), key=lambda r: r["numel"])
    _all_series(ax, rows, lambda c: c["median_s"] * 1e6)
    return _axes(ax, f"per call: {rows[0]['dtype']} {case}", "µs per call (lower is better)", log_y=True)


def _axes(ax: Any, title: str, ylabel: str, log_y: bool) -> tuple[str, str]:
    ax.set_xscale("log", base=2)
    if log_y:
        import matplotlib.ticker as ticker

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("elements")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return title, ylabel


def _bars(ax: Any, groups: list[str], values: dict[str, list[float]], title: str, ylabel: str) -> tuple[str, str]:
    """Grouped bars: one group per label, one bar per implementation."""
    width = 0.8 / max(1, len(values))
    for k, (impl, vals) in enumerate(values.items()):
        style = _impl_style(impl)
        ax.bar([g + k * width for g in range(len(groups))], vals, width, color=style["color"], label=impl)
    ax.set_xticks([g + width * (len(values) - 1) / 2 for g in range(len(groups))], groups, fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, axis="y")
    return title, ylabel


def _saved_panel(ax: Any, memory: dict[str, Any]) -> tuple[str, str]:
    rows = memory["saved_per_element"]
    impls = [i for i in peers.IMPLS if i in rows[0]["bytes_per_element"]]
    panel = _bars(ax, [r["dtype"] for r in rows], {i: [r["bytes_per_element"][i] for r in rows] for i in impls},
                  "saved for backward, per element", "bytes (lower is better)")
    ax.legend(fontsize=7)
    return panel


def _peak_panel(ax: Any, memory: dict[str, Any]) -> tuple[str, str]:
    rows = memory["models"]
    configs = list(rows[0]["results"])
    width = 0.8 / len(configs)
    for k, config in enumerate(configs):
        ax.bar([g + k * width for g in range(len(rows))], [r["results"][config]["held_vs_torch"] for r in rows],
               width, color=f"C{k}", label=config)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks([g + width * (len(configs) - 1) / 2 for g in range(len(rows))],
                  [f"{r['model']}\n{r['dtype']}" for r in rows], fontsize=7, rotation=45)
    title, ylabel = "held by the graph after forward, vs nn.ReLU", "ratio (lower is better)"
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    return title, ylabel
