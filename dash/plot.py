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

A ``fwd`` file (``benchmarks/bench_fwd.py``) holds two passes with different FLOP counts: the
forward alone (modes ``*_fwd``) and forward + backward (``*_fwdbwd``). Each pass gets its own
panels, y label and ratio anchor (``torch_cudnn_fwd``, ``torch_cudnn_fwdbwd``). Files written
before bench_fwd.py recorded its kind have none: a file whose modes are named ``*_fwd*`` is
read as ``fwd``, any other as ``bwd``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
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
#: Mode names of a forward file (bench_fwd.py: dash_fwd, dash_fwd_op, dash_det_fwdbwd, ...), and
#: of its forward + backward pass.
_FWD_MODE = re.compile(r"_fwd(bwd)?(_|$)")
_FWDBWD_MODE = re.compile(r"_fwdbwd(_|$)")
#: Anchors tried, in order, for the ratio chart of each pass (``part``) before DEFAULT_ANCHOR.
_PART_ANCHORS = {"fwd": ("torch_cudnn_fwd",), "fwd+bwd": ("torch_cudnn_fwdbwd",)}
#: Order of the passes in a figure: the forward's panels above the forward + backward's.
_PART_ORDER = ("bwd", "fwd", "fwd+bwd")


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
        """Panel keys: pass (``part``) first, then head dim, full before causal before windowed, the rest."""
        order = {"full": 0, "causal": 1}
        keys = {r.panel for r in self.rows}
        return sorted(keys, key=lambda k: (_part_rank(dict(k)["part"]), dict(k)["head_dim"],
                                           order.get(dict(k)["mask"], 2), repr(k)))

    def parts(self) -> list[str]:
        """The passes this file's panels show, in drawing order (one for every kind but ``fwd``)."""
        return list(dict.fromkeys(dict(k)["part"] for k in self.panels()))

    def part_of(self, mode: str) -> str:
        return mode_part(self.kind, mode)


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------
def _part_rank(part: str) -> int:
    return _PART_ORDER.index(part) if part in _PART_ORDER else len(_PART_ORDER)


def mode_part(kind: str, mode: str) -> str:
    """The pass whose panels show ``mode``: a ``fwd`` file splits into ``fwd`` and ``fwd+bwd``
    (TFLOP/s of different FLOP counts, not to be drawn on one axis); other kinds are one pass."""
    if kind != "fwd":
        return kind
    return "fwd+bwd" if _FWDBWD_MODE.search(mode) else "fwd"


def _infer_kind(rows: list) -> str:
    """The kind of a file that does not say: ``fwd`` when its modes are named as bench_fwd.py
    names them (its files before it wrote a kind), else ``bwd`` (bench_bwd.py's, python -m dash bench's)."""
    for row in rows:
        for key in ("tflops", "ms"):
            values = row.get(key) if isinstance(row, dict) else None
            if isinstance(values, dict) and any(_FWD_MODE.search(str(m)) for m in values):
                return "fwd"
    return "bwd"


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
    kind = str(payload.get("kind") or meta.get("kind") or _infer_kind(rows))
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
        by_part: dict[str, dict[str, float]] = {}  # one Row per pass: each pass has its own panels
        for m, v in tflops.items():
            by_part.setdefault(mode_part(kind, m), {})[m] = v
        for part, values in (by_part or {mode_part(kind, ""): {}}).items():
            parsed.append(Row(tuple(sorted({**panel, "part": part}.items())), int(seqlen),
                              int(batch) if _number(batch) else None, values))
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
    """"hdim 128, causal", plus any other shape field that differs between panels of that pair,
    after the pass ("forward: ...") when the file has more than one."""
    panels = results.panels()
    several = len(results.parts()) > 1
    titles = {}
    for key in panels:
        d = dict(key)
        twins = [dict(k) for k in panels if dict(k)["head_dim"] == d["head_dim"] and dict(k)["mask"] == d["mask"]
                 and dict(k)["part"] == d["part"]]
        extra = [f"{f} {d.get(f)}" for f in sorted(d) if f not in ("head_dim", "mask", "causal", "window", "part")
                 and len({repr(t.get(f)) for t in twins}) > 1]
        title = ", ".join([f"hdim {d['head_dim']}", d["mask"], *extra])
        titles[key] = f"{_KIND_WORDS.get(d['part'], d['part'])}: {title}" if several else title
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


def default_anchor(results: Results, part: str) -> str | None:
    """The ratio chart's default anchor for the panels of ``part``: that pass's cuDNN mode."""
    for m in (*_PART_ANCHORS.get(part, ()), DEFAULT_ANCHOR):
        if m in results.modes and results.part_of(m) == part:
            return m
    return None


def anchors_for(results: Results, anchor: str | None | dict) -> dict[str, str | None]:
    """Each pass's ratio anchor. ``anchor``: a mode (the anchor of its own pass; the other passes
    keep their defaults), None (no ratio chart), or a dict pass -> mode or None."""
    if isinstance(anchor, dict):
        return {p: anchor.get(p) for p in results.parts()}
    if anchor is None:
        return {p: None for p in results.parts()}
    out = {p: default_anchor(results, p) for p in results.parts()}
    out[results.part_of(anchor)] = anchor
    return out


def drawn_parts(results: Results, modes: Sequence[str]) -> list[str]:
    """The passes with a mode to draw (``--modes`` of one pass leaves the other's panels out)."""
    wanted = {results.part_of(m) for m in modes}
    return [p for p in results.parts() if p in wanted]


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


def draw(results: Results, modes: Sequence[str], anchor: str | None | dict) -> "Figure":
    """A figure of TFLOP/s panels and, with an anchor, each panel's ratio to it underneath.

    One block of figure rows per pass (``anchors_for`` says how ``anchor`` is read): a figure
    row shares its y axis, so it never mixes the forward's TFLOP/s with forward + backward's."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    parts = drawn_parts(results, modes)
    anchors = anchors_for(results, anchor)
    titles = _panel_titles(results)
    groups = [(p, [k for k in results.panels() if dict(k)["part"] == p]) for p in parts]
    ncols = min(max(len(keys) for _, keys in groups), MAX_COLUMNS)
    blocks, nrows = [], 0  # (part, panel keys, first figure row, figure rows per panel row)
    for part, keys in groups:
        per_block = 2 if anchors.get(part) else 1
        for c in range(0, len(keys), ncols):
            blocks.append((part, keys[c:c + ncols], nrows, per_block))
            nrows += per_block
    # At least 9 inches wide: the two-line title and the legend need the room with a single panel.
    fig = Figure(figsize=(max(4.4 * ncols + 0.6, 9.0), 3.3 * nrows + 1.3), layout="constrained")
    FigureCanvasAgg(fig)  # Agg without pyplot: no display, and a notebook's backend is left alone
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey="row")
    # One colour per mode in every panel, counted per pass: a fwd file's 14 modes would reuse
    # matplotlib's 10 colours within a panel.
    color = {}
    for p in results.parts():
        color.update((m, f"C{i % 10}") for i, m in enumerate(m for m in results.modes if results.part_of(m) == p))
    labels = {m: _legend_label(results, m, anchors.get(results.part_of(m))) for m in modes}

    def tflops(r: Row, m: str) -> float:
        return r.tflops.get(m, math.nan)

    handles = {}
    for part, keys, row0, per_block in blocks:
        anchor_p = anchors.get(part)
        part_modes = [m for m in modes if results.part_of(m) == part]

        def ratio(r: Row, m: str, a=anchor_p) -> float:
            return r.tflops[m] / r.tflops[a] if m in r.tflops and a in r.tflops else math.nan

        for col, key in enumerate(keys):
            rows = sorted((r for r in results.rows if r.panel == key), key=lambda r: r.seqlen)
            ax_t = axes[row0, col]
            for m, line in _plot_modes(ax_t, rows, part_modes, color, tflops, labels).items():
                handles.setdefault(m, line)
            ax_t.set_title(titles[key], fontsize=10)
            panel_axes = [ax_t]
            if anchor_p:
                ax_r = axes[row0 + 1, col]
                ax_r.axhline(1.0, color=color.get(anchor_p, "grey"), linestyle="--", linewidth=1.2)
                _plot_modes(ax_r, rows, [m for m in part_modes if m != anchor_p], color, ratio)
                panel_axes.append(ax_r)
            if col == 0:  # the panels of a figure row share its y axis
                ax_t.set_ylabel(f"{_KIND_WORDS.get(part, part)} TFLOP/s")
                if anchor_p:
                    ax_r.set_ylabel(f"ratio to {anchor_p}\n(TFLOP/s, same run)")
            for ax in panel_axes:
                _seqlen_axis(ax, [r.seqlen for r in rows])
            panel_axes[-1].set_xlabel(_x_label(results))
        for col in range(len(keys), ncols):  # empty slots of the block's last panel row
            for k in range(per_block):
                axes[row0 + k, col].set_visible(False)
    shown = [m for m in modes if m in handles]
    fig.legend([handles[m] for m in shown], [labels[m] for m in shown], loc="outside lower center",
               ncols=max(1, min(len(shown), 3)), fontsize=9, frameon=False)
    commit = results.commit[:10] if results.commit else "unknown"
    date = results.date[:10] if results.date else "date unknown"
    used = [a for p in parts if (a := anchors.get(p))]
    same_run = f"; ratios to {' / '.join(used)} in the same run" if used else ""
    kind = " and ".join(_KIND_WORDS.get(p, p) for p in parts)
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


def _choose(results: Results, args: argparse.Namespace) -> tuple[list[str], dict[str, str | None]]:
    """The modes to draw and each pass's ratio anchor (``anchors_for``); ValueError naming the
    option if one is not in the file."""
    available = ", ".join(results.modes)
    for m in args.modes or []:
        if m not in results.modes:
            raise ValueError(f"argument --modes: {m!r} is not in {results.path}; available: {available}")
    if args.ratio_to and args.ratio_to not in results.modes:
        raise ValueError(f"argument --ratio-to: {args.ratio_to!r} is not in {results.path}; available: {available}")
    modes = list(args.modes) if args.modes else list(results.modes)
    anchors = anchors_for(results, args.ratio_to) if args.ratio_to else \
        {p: default_anchor(results, p) for p in results.parts()}
    return modes, anchors


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
    for results, modes, anchors, out in jobs:
        parts = drawn_parts(results, modes)
        for p in parts:
            if anchors.get(p) is None:
                wanted = (*_PART_ANCHORS.get(p, ()), DEFAULT_ANCHOR)[0]
                which = f" for the {_KIND_WORDS.get(p, p)} panels" if len(parts) > 1 else ""
                print(f"note: {results.path} has no {wanted} mode: no ratio chart{which} "
                      "(pick an anchor with --ratio-to)")
        try:
            draw(results, modes, anchors).savefig(out, dpi=DPI)
        except OSError as e:
            print(f"python -m dash plot: could not write {out}: {e.strerror or e}", file=sys.stderr)
            return 1
        used = [a for p in parts if (a := anchors.get(p))]
        ratio = f", ratios to {', '.join(used)}" if used else ""
        n = sum(1 for k in results.panels() if dict(k)["part"] in parts)
        print(f"wrote {out} ({n} panel{'s' if n != 1 else ''}, {len(modes)} mode{'s' if len(modes) != 1 else ''}"
              f"{ratio})")
    return 0
