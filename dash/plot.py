"""``python -m dash plot RESULTS.json``: throughput and ratio charts of benchmark results.

Reads the files ``dash.bench.results_payload`` writes (``benchmarks/results/*.json``): rows of
a shape with each mode's median ms and TFLOP/s, and the device, commit and date of the run.
Draws, per (head dim, mask) panel, TFLOP/s against seqlen with one line per mode (DASH's modes
solid, anchors such as torch cuDNN / flash, FA3, FA4 dashed) and, under it, every mode's TFLOP/s
divided by an anchor's in the same row of the same run (default torch cuDNN). The project's
claims are such same-run ratios: absolute TFLOP/s move with clocks, drivers and the machine.

The reader takes what it knows and ignores the rest, so files with more modes (per-schedule
DASH modes, FA3 / FA4 anchors), more columns, or a ``kind`` (``bwd``, ``fwd``, ``fwd+bwd``)
plot as well. matplotlib is imported only to draw, on its Agg canvas (no display, no pyplot).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from dash.cli import chart_file, input_file, matplotlib_problem, output_path_problem, usage_error

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: The anchor ``dash.bench`` measures in every run; the ratio chart's default denominator.
DEFAULT_ANCHOR = "torch_cudnn"
DPI = 110
#: Panels per figure row; more panels wrap into further rows.
MAX_COLUMNS = 4
_KIND_WORDS = {"bwd": "backward", "fwd": "forward", "fwd+bwd": "forward + backward",
               "fwd_bwd": "forward + backward", "fwdbwd": "forward + backward"}
#: ``kind`` values of files that hold no TFLOP/s rows.
_NOT_RESULTS_KINDS = ("trace", "gantt", "simulate", "schedule", "schedules", "profile", "ncu")
#: Shape fields that vary along a panel's x axis (batch follows seqlen on the 16k-token grid).
_X_FIELDS = ("seqlen", "seqlen_q", "seqlen_k", "batch")


class ResultsError(ValueError):
    """A file this module cannot draw; the message names the file and says why, on one line."""


@dataclass(frozen=True)
class Row:
    """One benchmarked shape: the panel it belongs to, its x value and each mode's TFLOP/s."""

    panel: tuple[tuple[str, Any], ...]
    seqlen: int
    batch: int | None
    tflops: dict[str, float]


@dataclass(frozen=True)
class Results:
    """What ``load_results`` read from one file."""

    path: str
    kind: str
    device: str
    commit: str | None
    date: str | None
    modes: tuple[str, ...]  # every mode with at least one number, in the file's order
    rows: tuple[Row, ...]

    def panels(self) -> list[tuple[tuple[str, Any], ...]]:
        """Panel keys: head dim first, then full before causal before windowed, then the rest."""
        order = {"full": 0, "causal": 1}
        keys = {r.panel for r in self.rows}
        return sorted(keys, key=lambda k: (dict(k)["head_dim"], order.get(dict(k)["mask"], 2), repr(k)))


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------
def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _hashable(v: Any) -> Any:
    return tuple(_hashable(x) for x in v) if isinstance(v, list) else v


def _mask(shape: dict) -> str:
    window = shape.get("window")
    if isinstance(window, (list, tuple)) and tuple(window) not in ((-1, -1), (-1, 0)):
        return f"window {tuple(window)}"
    return "causal" if shape.get("causal") else "full"


def _row_tflops(row: dict, kind: str) -> dict[str, float]:
    """TFLOP/s per mode: the file's, or computed from its ms and FLOP count."""
    tflops, times = row.get("tflops"), row.get("ms")
    out = {m: float(v) for m, v in (tflops if isinstance(tflops, dict) else {}).items() if _number(v) and v > 0}
    flops = next((row[k] for k in ("flops", f"{kind}_flops", "bwd_flops") if _number(row.get(k))), None)
    for m, ms in (times if isinstance(times, dict) else {}).items():
        if m not in out and flops and _number(ms) and ms > 0:
            out[m] = flops / (ms * 1e-3) / 1e12
    return out


def _not_results(payload: Any) -> str | None:
    """What a JSON document is when it is known not to be benchmark results, else None."""
    if isinstance(payload, list):
        if payload and all(isinstance(e, dict) and "ph" in e for e in payload[:20]):
            return "a profiler trace"
        return None
    if not isinstance(payload, dict):
        return None
    meta = payload.get("meta") if isinstance(payload.get("meta"), dict) else {}
    kind = str(payload.get("kind") or meta.get("kind") or "")
    if kind.lower() in _NOT_RESULTS_KINDS:
        return f"a {kind!r} file"
    if "traceEvents" in payload:
        return "a profiler trace"
    if "schedules" in payload:
        return "scheduling-model output (python -m dash simulate --json)"
    return None


def parse_results(payload: Any, source: str) -> Results:
    """``Results`` from a decoded results file; ``ResultsError`` naming ``source`` otherwise."""
    what = _not_results(payload)
    if what:
        raise ResultsError(f"{source} is {what}, not benchmark results; plot draws TFLOP/s rows as in "
                           "benchmarks/results/*.json (Gantt charts: python -m dash simulate --gantt PNG)")
    rows = payload.get("rows") if isinstance(payload, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ResultsError(f"{source} is not a DASH benchmark results file: no 'rows' list "
                           "(the format python benchmarks/bench_bwd.py writes to benchmarks/results/)")
    meta = payload.get("meta") if isinstance(payload.get("meta"), dict) else {}
    kind = str(payload.get("kind") or meta.get("kind") or "bwd")
    parsed, modes = [], {}
    for i, row in enumerate(rows):
        shape = row.get("shape") if isinstance(row, dict) else None
        seqlen = shape.get("seqlen", shape.get("seqlen_q")) if isinstance(shape, dict) else None
        if not _number(seqlen) or seqlen < 1 or not _number(shape.get("head_dim")):
            raise ResultsError(f"{source} is not a DASH benchmark results file: row {i} has no shape with "
                               "head_dim and seqlen")
        tflops = _row_tflops(row, kind)
        modes.update(dict.fromkeys(tflops))
        panel = {k: _hashable(v) for k, v in shape.items() if k not in _X_FIELDS}
        panel["mask"] = _mask(shape)
        batch = shape.get("batch")
        parsed.append(Row(tuple(sorted(panel.items())), int(seqlen), int(batch) if _number(batch) else None, tflops))
    if not modes:
        raise ResultsError(f"{source} has no TFLOP/s or ms numbers in its rows: nothing to plot")
    env = payload.get("environment") if isinstance(payload.get("environment"), dict) else {}
    build = env.get("build") if isinstance(env.get("build"), dict) else {}
    commit = env.get("commit") or build.get("git_commit") or env.get("checkout_head")
    return Results(path=source, kind=kind, device=str(env.get("device") or "unknown device"),
                   commit=str(commit) if commit else None, date=str(env["date"]) if env.get("date") else None,
                   modes=tuple(modes), rows=tuple(parsed))


def load_results(path: str) -> Results:
    """Read a results file; ``ResultsError`` (one line, naming the file) if it cannot be drawn."""
    try:
        with open(path, encoding="utf-8") as f:
            payload = json.load(f)
    except OSError as e:
        raise ResultsError(f"cannot read {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ResultsError(f"{path} is not a JSON file ({e})") from None
    return parse_results(payload, path)


# ---------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------
def is_dash_mode(mode: str) -> bool:
    """DASH's own modes are drawn solid; everything else is an anchor, drawn dashed."""
    return mode.startswith(("dash", "user_dash"))


def ratio_summary(results: Results, mode: str, anchor: str) -> tuple[float, float, int] | None:
    """``(geomean, worst, rows)`` of ``mode``'s TFLOP/s / ``anchor``'s over rows holding both."""
    ratios = [r.tflops[mode] / r.tflops[anchor] for r in results.rows if mode in r.tflops and anchor in r.tflops]
    if not ratios:
        return None
    return math.exp(sum(math.log(x) for x in ratios) / len(ratios)), min(ratios), len(ratios)


def _seqlen_label(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def _panel_titles(results: Results) -> dict[tuple, str]:
    """"hdim 128, causal", plus any other shape field that differs between panels of that pair."""
    panels = results.panels()
    titles = {}
    for key in panels:
        d = dict(key)
        twins = [dict(k) for k in panels if dict(k)["head_dim"] == d["head_dim"] and dict(k)["mask"] == d["mask"]]
        extra = [f"{f} {d.get(f)}" for f in sorted(d) if f not in ("head_dim", "mask", "causal", "window")
                 and len({repr(t.get(f)) for t in twins}) > 1]
        titles[key] = ", ".join([f"hdim {d['head_dim']}", d["mask"], *extra])
    return titles


def _x_label(results: Results) -> str:
    tokens = {r.batch * r.seqlen for r in results.rows if r.batch}
    if len(tokens) == 1 and all(r.batch for r in results.rows):
        return f"seqlen (batch x seqlen = {_seqlen_label(tokens.pop())} tokens; log2 scale)"
    return "seqlen (log2 scale)"


def _legend_label(results: Results, mode: str, anchor: str | None) -> str:
    if mode == anchor:
        return f"{mode} (the ratio chart's 1.0)"
    s = ratio_summary(results, mode, anchor) if anchor else None
    if s is None:
        return mode
    geo, worst, n = s
    return f"{mode}: {geo:.2f}x {anchor} (geomean of {n} rows, worst {worst:.2f}x)"


def _style(mode: str, color: str) -> dict:
    dash = is_dash_mode(mode)
    return dict(color=color, linestyle="-" if dash else "--", marker="o" if dash else "s",
                markersize=4 if dash else 3.5, linewidth=2 if dash else 1.4)


def _seqlen_axis(ax, xs: list[int]) -> None:
    """log2 x axis ticked at the measured seqlens (512, 1k, ...), no minor ticks."""
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [_seqlen_label(x) for x in xs])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.grid(True, alpha=0.3)


def _plot_modes(ax, rows: list[Row], modes: Sequence[str], color: dict[str, str], value, labels=None) -> dict:
    """One line per mode of ``value(row, mode)`` (NaN where missing: a gap); returns mode -> line."""
    xs = [r.seqlen for r in rows]
    lines = {}
    for m in modes:
        ys = [value(r, m) for r in rows]
        if not all(math.isnan(y) for y in ys):
            (lines[m],) = ax.plot(xs, ys, label=(labels or {}).get(m, m), **_style(m, color[m]))
    return lines


def draw(results: Results, modes: Sequence[str], anchor: str | None) -> "Figure":
    """A figure of TFLOP/s panels and, with an anchor, each panel's ratio to it underneath."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = results.panels()
    titles = _panel_titles(results)
    ncols = min(len(panels), MAX_COLUMNS)
    per_block = 2 if anchor else 1
    nrows = per_block * math.ceil(len(panels) / ncols)
    # At least 9 inches wide: the two-line title and the legend need the room with a single panel.
    fig = Figure(figsize=(max(4.4 * ncols + 0.6, 9.0), 3.3 * nrows + 1.3), layout="constrained")
    FigureCanvasAgg(fig)  # Agg without pyplot: no display, and a notebook's backend is left alone
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey="row")
    color = {m: f"C{i % 10}" for i, m in enumerate(results.modes)}  # one colour per mode in every panel
    labels = {m: _legend_label(results, m, anchor) for m in modes}
    kind = _KIND_WORDS.get(results.kind, results.kind)

    def tflops(r: Row, m: str) -> float:
        return r.tflops.get(m, math.nan)

    def ratio(r: Row, m: str) -> float:
        return r.tflops[m] / r.tflops[anchor] if m in r.tflops and anchor in r.tflops else math.nan

    handles = {}
    for i, key in enumerate(panels):
        row0, col = per_block * (i // ncols), i % ncols
        rows = sorted((r for r in results.rows if r.panel == key), key=lambda r: r.seqlen)
        ax_t = axes[row0, col]
        for m, line in _plot_modes(ax_t, rows, modes, color, tflops, labels).items():
            handles.setdefault(m, line)
        ax_t.set_title(titles[key], fontsize=10)
        panel_axes = [ax_t]
        if anchor:
            ax_r = axes[row0 + 1, col]
            ax_r.axhline(1.0, color=color.get(anchor, "grey"), linestyle="--", linewidth=1.2)
            _plot_modes(ax_r, rows, [m for m in modes if m != anchor], color, ratio)
            panel_axes.append(ax_r)
        if col == 0:  # the panels of a figure row share its y axis
            ax_t.set_ylabel(f"{kind} TFLOP/s")
            if anchor:
                ax_r.set_ylabel(f"ratio to {anchor}\n(TFLOP/s, same run)")
        for ax in panel_axes:
            _seqlen_axis(ax, [r.seqlen for r in rows])
        panel_axes[-1].set_xlabel(_x_label(results))
    for i in range(len(panels), ncols * (nrows // per_block)):  # empty slots of the last block
        for k in range(per_block):
            axes[per_block * (i // ncols) + k, i % ncols].set_visible(False)
    shown = [m for m in modes if m in handles]
    fig.legend([handles[m] for m in shown], [labels[m] for m in shown], loc="outside lower center",
               ncols=max(1, min(len(shown), 3)), fontsize=9, frameon=False)
    commit = results.commit[:10] if results.commit else "unknown"
    date = results.date[:10] if results.date else "date unknown"
    same_run = f"; ratios to {anchor} in the same run" if anchor else ""
    fig.suptitle(f"{results.device}: attention {kind}, commit {commit}, {date}\n"
                 f"{os.path.basename(results.path)}{same_run}; DASH solid, anchors dashed", fontsize=11)
    return fig


# ---------------------------------------------------------------------------------------
# python -m dash plot
# ---------------------------------------------------------------------------------------
def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no mode; give a comma-separated list")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``plot`` options to ``p``."""
    p.add_argument("results", nargs="+", type=input_file, metavar="RESULTS.json",
                   help="benchmark results (benchmarks/results/*.json)")
    p.add_argument("--out", type=chart_file, default=None, metavar="PNG",
                   help="chart to write (.png, .pdf, .svg; default: next to the results file, NAME-throughput.png)")
    p.add_argument("--ratio-to", default=None, metavar="MODE",
                   help=f"anchor of the ratio chart (default: {DEFAULT_ANCHOR}, when the file has it)")
    p.add_argument("--modes", type=_names, default=None, metavar="A,B,..",
                   help="modes to draw (default: every mode in the file)")


def default_out(results_path: str) -> str:
    """The chart's default path: beside the results file, ``NAME-throughput.png`` (a name no
    benchmark script writes, so a committed chart is never overwritten by accident)."""
    return os.path.splitext(results_path)[0] + "-throughput.png"


def _choose(results: Results, args: argparse.Namespace) -> tuple[list[str], str | None]:
    """The modes to draw and the ratio anchor; ValueError naming the option if one is not in the file."""
    available = ", ".join(results.modes)
    for m in args.modes or []:
        if m not in results.modes:
            raise ValueError(f"argument --modes: {m!r} is not in {results.path}; available: {available}")
    if args.ratio_to and args.ratio_to not in results.modes:
        raise ValueError(f"argument --ratio-to: {args.ratio_to!r} is not in {results.path}; available: {available}")
    modes = list(args.modes) if args.modes else list(results.modes)
    anchor = args.ratio_to or (DEFAULT_ANCHOR if DEFAULT_ANCHOR in results.modes else None)
    return modes, anchor


def run(args: argparse.Namespace) -> int:
    """Check everything, then draw one chart per results file; 0 when all are written, 2 on bad input."""
    why = matplotlib_problem()
    if why:
        return usage_error("plot", f"plot {why}")
    if args.out and len(args.results) > 1:
        return usage_error("plot", f"argument --out: one path for {len(args.results)} results files; leave it out "
                                   "to write each chart next to its results file")
    jobs = []
    for path in args.results:  # read and check every file before drawing any
        try:
            results = load_results(path)
            modes, anchor = _choose(results, args)
        except ValueError as e:
            return usage_error("plot", str(e))
        out = args.out or default_out(path)
        why = None if args.out else output_path_problem(out)  # --out was checked while parsing
        if why:
            return usage_error("plot", f"{why} (choose another path with --out)")
        jobs.append((results, modes, anchor, out))
    for results, modes, anchor, out in jobs:
        if anchor is None:
            print(f"note: {results.path} has no {DEFAULT_ANCHOR} mode: no ratio chart (pick an anchor with --ratio-to)")
        try:
            draw(results, modes, anchor).savefig(out, dpi=DPI)
        except OSError as e:
            print(f"python -m dash plot: could not write {out}: {e.strerror or e}", file=sys.stderr)
            return 1
        ratio = f", ratios to {anchor}" if anchor else ""
        n = len(results.panels())
        print(f"wrote {out} ({n} panel{'s' if n != 1 else ''}, {len(modes)} mode{'s' if len(modes) != 1 else ''}"
              f"{ratio})")
    return 0
