"""Paper-style Gantt charts: CTAs x time, compute vs waiting, one panel per schedule.

Blue bars are compute (two shades alternate per column so column boundaries show); red bars
are the time a CTA's compute was stalled because its dQ reduction could not take its turn
(the FA3 staircase); grey bars are column epilogues; white is idle (no work left).
matplotlib is imported only here (``pip install matplotlib``), and drawn with its Agg canvas
without pyplot: the global backend of a notebook or a GUI session is left alone.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from dash.schedules.simulate import SimResult

COMPUTE_COLORS = ("#2b6cb0", "#63a4e0")
WAIT_COLOR = "#d62728"
EPILOGUE_COLOR = "#888888"


def cta_segments(res: SimResult) -> dict[str, np.ndarray]:
    """Merged bars of a simulation, as arrays of equal length per kind.

    Returns ``{"compute": (n, 4), "wait": (n, 3), "epilogue": (n, 3)}`` with rows
    ``(cta, start, end[, column parity])``. A wait is a gap in a CTA's compute chain before
    its last operation.
    """
    plan = res.plan
    S = plan.num_steps
    if S == 0 or not res.deadlock_free:
        return {"compute": np.zeros((0, 4)), "wait": np.zeros((0, 3)), "epilogue": np.zeros((0, 3))}
    cta = np.repeat(np.arange(plan.ctas), np.diff(plan.step_ptr))
    col = np.repeat(np.arange(len(plan.cols)), np.diff(plan.visit_ptr))
    rank = np.arange(len(plan.cols)) - plan.cta_ptr[:-1][plan.col_cta()]
    cs, ce = res.compute_start, res.compute_end
    eps = 1e-9 * max(1.0, res.makespan)
    new = np.ones(S, dtype=bool)
    new[1:] = (cta[1:] != cta[:-1]) | (col[1:] != col[:-1]) | (cs[1:] > ce[:-1] + eps)
    starts = np.flatnonzero(new)
    seg_cta = cta[starts]
    seg_s = cs[starts]
    seg_e = np.maximum.reduceat(ce, starts)
    seg_par = rank[col[starts]] % 2
    compute = np.stack([seg_cta, seg_s, seg_e, seg_par], axis=1).astype(np.float64)

    # Compute-chain gaps (including around epilogues): sort all busy intervals per CTA.
    ivals = [np.stack([seg_cta, seg_s, seg_e], axis=1)]
    epi = np.zeros((0, 3))
    if len(res.epilogue_start):
        ks, ke = res.epilogue_start, res.epilogue_end
        epi = np.stack([plan.col_cta(), ks, ke], axis=1)
        epi = epi[ke - ks > eps]
        ivals.append(epi)
    iv = np.concatenate(ivals)
    iv = iv[np.lexsort((iv[:, 1], iv[:, 0]))]
    same = iv[1:, 0] == iv[:-1, 0]
    gap_s, gap_e = iv[:-1, 2], iv[1:, 1]
    is_gap = same & (gap_e > gap_s + eps)
    wait = np.stack([iv[1:, 0][is_gap], gap_s[is_gap], gap_e[is_gap]], axis=1)
    return {"compute": compute, "wait": wait, "epilogue": epi}


def add_bars(ax, rows: np.ndarray, color: str, max_ctas: int, half_height: float = 0.5) -> None:
    """Draw ``rows`` = (cta, start, end) as horizontal bars of one colour on ``ax`` (CTAs below
    ``max_ctas`` only), as one PolyCollection."""
    from matplotlib.collections import PolyCollection

    rows = rows[rows[:, 0] < max_ctas]
    if len(rows):
        y, x0, x1 = rows[:, 0], rows[:, 1], rows[:, 2]
        verts = np.stack([np.stack([x0, y - half_height], 1), np.stack([x1, y - half_height], 1),
                          np.stack([x1, y + half_height], 1), np.stack([x0, y + half_height], 1)], axis=1)
        ax.add_collection(PolyCollection(verts, facecolors=color, edgecolors="none", linewidths=0))


def plot_gantt(results: Mapping[str, SimResult], path: str, *, title: str | None = None,
               max_ctas: int | None = None, time_limit: float | None = None, dpi: int = 130) -> None:
    """Write a PNG with one Gantt panel per simulated schedule (shared time axis).

    ``max_ctas`` shows only the first CTAs; ``time_limit`` cuts the time axis.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    names = [n for n, r in results.items() if r.deadlock_free]
    if not names:
        raise ValueError("no deadlock-free simulation to plot")
    tmax = max(results[n].makespan for n in names)
    if time_limit is not None:
        tmax = min(tmax, time_limit)
    fig = Figure(figsize=(12, 2.4 + 2.2 * len(names)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(names), 1, sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        res = results[name]
        P = res.plan.ctas if max_ctas is None else min(max_ctas, res.plan.ctas)
        seg = cta_segments(res)
        boxes, colors = [], []
        c = seg["compute"]
        for par in (0, 1):
            boxes.append(c[c[:, 3] == par][:, :3])
            colors.append(COMPUTE_COLORS[par])
        boxes += [seg["wait"], seg["epilogue"]]
        colors += [WAIT_COLOR, EPILOGUE_COLOR]
        for box, color in zip(boxes, colors):
            add_bars(ax, box, color, P)
        ax.set_ylim(P - 0.5, -0.5)
        ax.set_xlim(0, tmax if tmax > 0 else 1.0)  # an empty problem has makespan 0
        ax.set_ylabel("CTA")
        ratio = res.makespan / res.lower_bound if res.lower_bound > 0 else 1.0
        ax.set_title(f"{name}: makespan {res.makespan:.1f} = {ratio:.3f} x lower bound, "
                     f"mean idle {100 * res.mean_idle:.1f} %, total turn wait {res.total_wait:.1f}",
                     fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("time (units of c)")
    handles = [Patch(color=COMPUTE_COLORS[0], label="compute (alternate shades: columns)"),
               Patch(color=WAIT_COLOR, label="stalled: dQ reduction waits for its turn")]
    if any(len(results[n].epilogue_start) for n in names):
        handles.append(Patch(color=EPILOGUE_COLOR, label="column epilogue"))
    top = 1.0 - 0.55 / fig.get_figheight()
    fig.legend(handles=handles, loc="upper right", bbox_to_anchor=(0.99, top + 0.1 / fig.get_figheight()),
               fontsize=9, ncol=len(handles), frameon=False)
    if title:
        fig.suptitle(title, x=0.01, y=0.995, ha="left", va="top", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, top - 0.05 / fig.get_figheight()))
    fig.savefig(path, dpi=dpi)
