"""Trace mode: what the backward kernel actually did, step by step, beside the model.

``trace_backward`` runs DASH's backward with the kernel's trace flag (``torch.ops.dash.bwd_trace``):
the dQ writer of every CTA records each (column, Q tile) step it reduces — its CTA, column,
Q tile, turn, and four ``%globaltimer`` stamps: when the writer turned to the step
(``t_wait``), when both MMA warpgroups' dQ partials were ready (``t_ready``), when the tile's
turn had come (``t_acquired``) and when the tile was released (``t_done``). ``TraceResult``
turns that into

* the accumulation order of every dQ tile, checked against the scheduling model
  (``check_against_model``: turns, visit orders, static CTA work lists, and that the
  measured acquisition times follow the turns);
* turn waits (``t_acquired - t_ready``: a partial was ready but its tile's turn had not come;
  the MMA warpgroups stall on it once they need the staging buffer again), per CTA and
  overall;
* model costs fitted to the trace (``fit_costs``), and the model's makespan with them;
* a measured Gantt chart beside the model's (``plot_trace_gantt``).

``python -m dash trace`` is the command-line front end. Tracing adds an atomic and a few
global stores per step to the dQ writer warp only; the MMA warpgroups run the same code as
without it. ``%globaltimer`` is coarse (on the H200 here: 256 ns steps), so single short
intervals are rounded; sums and medians over many steps are what to read.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from dash.schedules.simulate import Costs, SimResult

#: Record layout of csrc/kernels/bwd_params.h (BwdTraceRecord): 8 int32 then 4 int64.
_ID_FIELDS = ("cta", "bh", "n", "m", "step", "turn")
_TIME_FIELDS = ("t_wait", "t_ready", "t_acquired", "t_done")


def decode_records(raw: np.ndarray, heads: int) -> dict[str, np.ndarray]:
    """Arrays (one entry per step) from the kernel's raw int64 ``(steps, 8)`` records.

    Keys: ``cta b h n m step turn`` (int64) and ``t_wait t_ready t_acquired t_done``
    (float64, microseconds since the first step of the launch). Rows the kernel did not
    write (cta -1) are dropped.
    """
    raw = np.ascontiguousarray(np.asarray(raw, dtype=np.int64))
    if raw.ndim != 2 or raw.shape[1] != 8:
        raise ValueError(f"trace records must be int64 (steps, 8), got shape {raw.shape}")
    ids = raw[:, :4].view(np.int32).reshape(len(raw), 8).astype(np.int64)
    times = raw[:, 4:8].astype(np.float64)
    out = {name: ids[:, i] for i, name in enumerate(_ID_FIELDS)}
    keep = out["cta"] >= 0
    out = {k: v[keep] for k, v in out.items()}
    times = times[keep]
    t0 = times[:, 0].min() if len(times) else 0.0
    for i, name in enumerate(_TIME_FIELDS):
        out[name] = (times[:, i] - t0) / 1000.0
    out["b"], out["h"] = out["bh"] // heads, out["bh"] % heads
    del out["bh"]
    return out


@dataclass
class TraceResult:
    """A traced backward: the problem, what ran, and the records (see ``decode_records``)."""

    problem: "object"  # dash.schedules.Problem
    schedule: str
    deterministic: bool
    ctas: int
    records: dict[str, np.ndarray] = field(repr=False)

    @property
    def num_steps(self) -> int:
        return int(len(self.records["cta"]))

    @property
    def chains(self) -> int:
        """Accumulation chains per dQ tile: the kernel's ``dq_chains`` for this head dim and
        mask when deterministic (turn t is add t // chains of chain t % chains), else 1."""
        from dash.schedules.auto import kernel_dq_chains

        return kernel_dq_chains(self.problem.head_dim, self.problem.causal) if self.deterministic else 1

    @property
    def kv_chains(self) -> int:
        """GQA dK/dV accumulation chains of the traced run: the kernel's (``kernel_dkv_chains``;
        without determinism only small groups are ordered, larger ones get 1: the model's
        ascending order, which the kernel does not keep)."""
        from dash.schedules.auto import kernel_dkv_chains

        p = self.problem
        group = p.heads_q // p.heads_kv
        return kernel_dkv_chains(p.head_dim, p.causal, group, self.deterministic)

    def _chain_of_turn(self) -> np.ndarray:
        return self.records["turn"] % self.chains

    @property
    def makespan_us(self) -> float:
        """From the first step's start to the last step's end, microseconds (the writers' view)."""
        r = self.records
        return float(r["t_done"].max(initial=0.0) - r["t_wait"].min(initial=0.0))

    def wait_us(self) -> np.ndarray:
        """Per step: microseconds between the step's dQ partial being ready and its tile's turn
        (0 without determinism: nothing to wait for)."""
        if not self.deterministic:
            return np.zeros(self.num_steps)
        return np.maximum(self.records["t_acquired"] - self.records["t_ready"], 0.0)

    def wait_fraction(self) -> float:
        """Share of the grid's time (CTAs x makespan) that ready partials waited for their turns."""
        span = self.makespan_us * self.ctas
        return float(self.wait_us().sum() / span) if span > 0 else 0.0

    def wait_fraction_per_cta(self) -> np.ndarray:
        span = self.makespan_us
        w = np.bincount(self.records["cta"], weights=self.wait_us(), minlength=self.ctas)
        return w / span if span > 0 else np.zeros(self.ctas)

    def accumulation_order(self) -> dict[tuple[int, int, int, int], list[int]]:
        """Columns of every accumulation chain ``(b, h, m, chain)`` of a dQ tile in the order
        their turns were acquired (one chain per tile without determinism)."""
        r = self.records
        chain = self._chain_of_turn()
        order = np.lexsort((r["turn"], r["t_acquired"], chain, r["m"], r["h"], r["b"]))
        out: dict[tuple[int, int, int, int], list[int]] = {}
        for i in order:
            key = (int(r["b"][i]), int(r["h"][i]), int(r["m"][i]), int(chain[i]))
            out.setdefault(key, []).append(int(r["n"][i]))
        return out

    def plan(self):
        """The model's plan of this run (same schedule, problem and grid)."""
        from dash.schedules import make_plan

        return make_plan(self.problem, self.schedule, self.ctas)

    def check_against_model(self, plan=None) -> list[str]:
        """Differences between the trace and the model; an empty list means none.

        * every (column, Q tile) step of the model was recorded exactly once;
        * each column visited its Q tiles in the model's order (``step`` numbers);
        * deterministic runs: every recorded turn is the model's ``turn(m, n)``, and within
          each accumulation chain of a tile (``chains``) the acquisition times do not decrease
          with the turn (the measured order of the adds is the model's accumulation order);
        * static schedules: each CTA ran exactly the model's work list, in order.
        """
        plan = self.plan() if plan is None else plan
        r = self.records
        problems: list[str] = []
        st = plan.steps()
        want = set(zip(st["b"].tolist(), st["h"].tolist(), st["n"].tolist(), st["m"].tolist()))
        got = list(zip(r["b"].tolist(), r["h"].tolist(), r["n"].tolist(), r["m"].tolist()))
        if len(got) != len(set(got)):
            problems.append(f"{len(got) - len(set(got))} steps recorded more than once")
        if set(got) != want:
            problems.append(f"steps differ from the model: {len(want - set(got))} missing, "
                            f"{len(set(got) - want)} unexpected")
            return problems
        # Visit order per column.
        key = np.lexsort((r["step"], r["n"], r["h"], r["b"]))
        b, h, n, m = (r[k][key] for k in ("b", "h", "n", "m"))
        starts = np.flatnonzero(np.r_[True, (b[1:] != b[:-1]) | (h[1:] != h[:-1]) | (n[1:] != n[:-1])])
        ends = np.r_[starts[1:], len(b)]
        bad_visits = 0
        for s, e in zip(starts, ends):
            if list(m[s:e]) != list(plan.visit(int(b[s]), int(h[s]), int(n[s]))):
                bad_visits += 1
        if bad_visits:
            problems.append(f"{bad_visits} columns visited their Q tiles in another order than the model's")
        if self.deterministic:
            model_turn = plan.turn[r["b"], r["h"], r["m"], r["n"]]
            bad = int((model_turn != r["turn"]).sum())
            if bad:
                problems.append(f"{bad} recorded turns differ from the model's turn(m, n)")
            chain = self._chain_of_turn()
            key = np.lexsort((r["turn"], chain, r["m"], r["h"], r["b"]))
            tb, th, tm, tc, ta = r["b"][key], r["h"][key], r["m"][key], chain[key], r["t_acquired"][key]
            same_tile = (tb[1:] == tb[:-1]) & (th[1:] == th[:-1]) & (tm[1:] == tm[:-1]) & (tc[1:] == tc[:-1])
            back = int((same_tile & (ta[1:] < ta[:-1])).sum())
            if back:
                problems.append(f"{back} turns were acquired before their predecessor's (the order is not the model's)")
        if plan.recipe.dispatch != "claim":
            for x in range(plan.ctas):
                mine = np.flatnonzero(r["cta"] == x)
                mine = mine[np.argsort(r["t_wait"][mine], kind="stable")]
                cols = []
                for i in mine:
                    c = (int(r["b"][i]), int(r["h"][i]), int(r["n"][i]))
                    if not cols or cols[-1] != c:
                        cols.append(c)
                if cols != plan.work_list(x):
                    problems.append(f"CTA {x} ran other columns than the model's work list")
                    break
        return problems

    def fit_costs(self) -> Costs:
        """Model costs (microseconds) read off the trace.

        * ``c``: the MMA warpgroups' period: median time from one dQ partial to the next of
          the same column on one CTA, after a partial that did not wait for its turn;
        * the hand-off ``r + latency``: median time between two consecutive acquisitions in
          one accumulation chain of a tile when the second contributor was already waiting (its
          partial ready before the first one's release) — the reduce-add, its completion, the release and the
          poll; split evenly between ``r`` and ``latency`` (the model uses their sum on the
          chain of a tile, and ``r`` alone on a CTA's own writer, which a trace cannot tell
          apart). Without determinism: ``r`` = median release - ready, ``latency`` 0;
        * ``epilogue``: median gap between a column's last partial and the next column's first
          partial on the same CTA, minus ``c``.
        """
        r = self.records
        waits = self.wait_us()
        cta = r["cta"]
        order = np.lexsort((r["t_ready"], cta))
        oc, on, oh, ob = cta[order], r["n"][order], r["h"][order], r["b"][order]
        ready, w = r["t_ready"][order], waits[order]
        same_cta = oc[1:] == oc[:-1]
        same_col = same_cta & (on[1:] == on[:-1]) & (oh[1:] == oh[:-1]) & (ob[1:] == ob[:-1])
        # The MMA warpgroups' period: partial to partial, where the first one did not wait for
        # its turn (a wait would stall them at the staging buffer).
        periods = (ready[1:] - ready[:-1])[same_col & (w[:-1] <= 1e-9)]
        if not len(periods):
            periods = (ready[1:] - ready[:-1])[same_col]
        c = float(np.median(periods)) if len(periods) else 1.0
        if self.deterministic:
            chain = self._chain_of_turn()
            key = np.lexsort((r["turn"], chain, r["m"], r["h"], r["b"]))
            kb, kh, km, kc = r["b"][key], r["h"][key], r["m"][key], chain[key]
            kr, ka, kd = r["t_ready"][key], r["t_acquired"][key], r["t_done"][key]
            nxt = (kb[1:] == kb[:-1]) & (kh[1:] == kh[:-1]) & (km[1:] == km[:-1]) & (kc[1:] == kc[:-1])
            waiting = nxt & (kr[1:] < kd[:-1])
            gaps = (ka[1:] - ka[:-1])[waiting]
            hand = float(np.median(gaps)) if len(gaps) else 0.0
            rr, latency = hand / 2, hand / 2
        else:
            rr, latency = float(np.median(r["t_done"] - r["t_ready"])) if self.num_steps else 0.0, 0.0
        gaps = (ready[1:] - ready[:-1])[same_cta & ~same_col]
        epilogue = float(max(np.median(gaps) - c, 0.0)) if len(gaps) else 0.0
        return Costs(c=max(c, 1e-3), r=max(rr, 0.0), latency=max(latency, 0.0), epilogue=epilogue)

    def simulate_model(self, costs: Optional[Costs] = None) -> SimResult:
        """The model's simulation of this run, with ``costs`` (default: fitted to this trace)."""
        from dash.schedules import simulate
        from dash.schedules.auto import kernel_pipeline_depth

        depth = kernel_pipeline_depth(self.problem.head_dim, self.problem.causal)
        return simulate(self.plan(), costs or self.fit_costs(), depth, chains=self.chains, kv_chains=self.kv_chains)

    def replay_model(self, costs: Optional[Costs] = None, plan=None):
        """The model ``auto`` ranks by for this run: its claims replayed in simulated time
        (``dash.schedules.simulate.replay_claims``), with ``costs`` (default: fitted to this
        trace); None for a schedule whose columns are not claimed (``shift``). ``plan``:
        ``self.plan()`` if already built."""
        from dash.schedules.auto import kernel_pipeline_depth
        from dash.schedules.simulate import replay_claims

        plan = self.plan() if plan is None else plan
        if not plan.claimed:
            return None
        depth = kernel_pipeline_depth(self.problem.head_dim, self.problem.causal)
        return replay_claims(plan, costs or self.fit_costs(), depth, chains=self.chains, kv_chains=self.kv_chains)

    def column_start_gaps_us(self) -> np.ndarray:
        """Per (batch, head) with more than one column, the median time between the starts of
        its consecutive columns (first dQ partial ready of each, sorted): how far apart a
        head's columns run, which decides how long they queue on each other's dQ tiles."""
        r = self.records
        nn = int(r["n"].max(initial=0)) + 1
        cols, inv = np.unique((r["b"] * self.problem.heads_q + r["h"]) * nn + r["n"], return_inverse=True)
        first = np.full(len(cols), np.inf)
        np.minimum.at(first, inv, r["t_ready"])
        return median_gaps_per_head(cols // nn, first)

    def summary(self) -> dict:
        """Numbers for a report: steps, makespan, wait fractions, fitted costs, model makespan."""
        costs = self.fit_costs()
        sim = self.simulate_model(costs)
        plan = sim.plan
        rep = self.replay_model(costs, plan)
        gaps = self.column_start_gaps_us()
        rgaps = np.zeros(0)
        if rep is not None:
            cols = plan.cols.astype(np.int64)
            rgaps = median_gaps_per_head(cols[:, 0] * self.problem.heads_q + cols[:, 1], rep.claim_time)
        per_cta = self.wait_fraction_per_cta()
        return {
            "schedule": self.schedule, "deterministic": self.deterministic, "ctas": self.ctas,
            "problem": self.problem.describe(), "steps": self.num_steps,
            "makespan_us": self.makespan_us, "wait_fraction": self.wait_fraction(),
            "wait_fraction_max_cta": float(per_cta.max(initial=0.0)),
            "fitted_costs_us": costs.as_dict(), "model_makespan_us": float(sim.makespan),
            "model_wait_fraction": float(sim.total_wait / (sim.makespan * sim.plan.ctas)) if sim.makespan > 0 else 0.0,
            "model_replay_makespan_us": float(rep.makespan) if rep is not None else None,
            "column_start_gap_us_median": float(np.median(gaps)) if len(gaps) else None,
            # The replay's gaps are between claim times, the measured ones between first partials
            # ready: the same up to first-step waits, which the median mostly drops.
            "model_replay_column_start_gap_us_median": float(np.median(rgaps)) if len(rgaps) else None,
        }


def median_gaps_per_head(head: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Per head id with more than one column, the median gap between its columns' sorted
    ``start`` times."""
    head, start = np.asarray(head), np.asarray(start, dtype=np.float64)
    order = np.lexsort((start, head))
    h, t = head[order], start[order]
    same = h[1:] == h[:-1]
    d, hd = (t[1:] - t[:-1])[same], h[1:][same]
    return np.asarray([float(np.median(d[hd == x])) for x in np.unique(hd)])


def trace_backward(dout, q, k, v, out, softmax_lse, *, softmax_scale: Optional[float] = None, causal: bool = False,
                   deterministic: bool = True, schedule: str = "auto", sm_margin: int = 0):
    """DASH's backward with the kernel's trace flag. Returns ``(dq, dk, dv, TraceResult)``;
    the gradients are those of ``dash.api.attention_backward`` (same kernels).

    ``deterministic`` must be a bool: the trace is read against the model of that mode (no
    None following ``torch.are_deterministic_algorithms_enabled()`` as in attention_backward)."""
    import torch

    from dash import _ext
    from dash.ops import grid_ctas, resolve_schedule
    from dash.schedules import Problem
    from dash.validation import check_bool, validate_backward_inputs

    check_bool("deterministic", deterministic)
    validate_backward_inputs(dout, q, k, v, out, softmax_lse, softmax_scale=softmax_scale, causal=causal,
                             sm_margin=sm_margin, schedule=schedule, deterministic=deterministic)
    _ext.require_kernels()
    sched = resolve_schedule(schedule, q, k, causal, deterministic, sm_margin)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    dq, dk, dv, raw = torch.ops.dash.bwd_trace(dout.contiguous(), q, k, v, out.contiguous(), softmax_lse.contiguous(),
                                               float(scale), causal, deterministic, sched, sm_margin)
    batch, seqlen_q, heads, head_dim = q.shape
    problem = Problem(batch, heads, seqlen_q, k.shape[1], head_dim=head_dim, heads_kv=k.shape[2], causal=causal)
    columns = -(-k.shape[1] // problem.tile_shape[1]) * heads * batch
    ctas = min(grid_ctas(q.device, sm_margin), columns)
    rec = decode_records(raw.cpu().numpy(), heads)
    return dq, dk, dv, TraceResult(problem, sched, deterministic, ctas, rec)


def plot_trace_gantt(trace: TraceResult, path: str, *, model: Optional[SimResult] = None,
                     max_ctas: Optional[int] = 32, dpi: int = 130) -> None:
    """Measured Gantt chart (top) beside the model's prediction (bottom), one time axis (µs).

    Measured bars per CTA: each step from the writer turning to it until its dQ partial was
    ready (the MMA warpgroups' compute), alternate shades per column; red: a ready partial
    waiting for its tile's turn.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    from dash.schedules.gantt import COMPUTE_COLORS, EPILOGUE_COLOR, WAIT_COLOR, add_bars, cta_segments

    model = trace.simulate_model() if model is None else model
    P = trace.ctas if max_ctas is None else min(max_ctas, trace.ctas)
    r = trace.records
    fig = Figure(figsize=(12, 7))
    FigureCanvasAgg(fig)
    ax_m, ax_s = fig.subplots(2, 1, sharex=True)

    def bars(ax, rows, color):
        add_bars(ax, rows, color, P, half_height=0.45)

    col_id = (r["b"] * trace.problem.heads_q + r["h"]) * 100003 + r["n"]
    _, col_rank = np.unique(col_id, return_inverse=True)
    for par in (0, 1):
        sel = (col_rank % 2) == par
        bars(ax_m, np.stack([r["cta"][sel], r["t_wait"][sel], r["t_ready"][sel]], 1).astype(float), COMPUTE_COLORS[par])
    if trace.deterministic:
        bars(ax_m, np.stack([r["cta"], r["t_ready"], r["t_acquired"]], 1).astype(float), WAIT_COLOR)
    ax_m.set_title(f"measured ({trace.schedule}, {'deterministic' if trace.deterministic else 'non-deterministic'}): "
                   f"{trace.makespan_us:.0f} µs, ready partials waited for turns {100 * trace.wait_fraction():.1f} % "
                   f"of the grid's time",
                   fontsize=10, loc="left")
    seg = cta_segments(model)
    c = seg["compute"]
    for par in (0, 1):
        bars(ax_s, c[c[:, 3] == par][:, :3], COMPUTE_COLORS[par])
    bars(ax_s, seg["wait"], WAIT_COLOR)
    bars(ax_s, seg["epilogue"], EPILOGUE_COLOR)
    ax_s.set_title(f"model with costs fitted to this trace: {model.makespan:.0f} µs, "
                   f"mean idle {100 * model.mean_idle:.1f} %", fontsize=10, loc="left")
    tmax = max(trace.makespan_us, model.makespan) * 1.01
    for ax in (ax_m, ax_s):
        ax.set_ylim(P - 0.5, -0.5)
        ax.set_xlim(0, tmax if tmax > 0 else 1.0)
        ax.set_ylabel(f"CTA (first {P})")
    ax_s.set_xlabel("time (µs)")
    fig.legend(handles=[Patch(color=COMPUTE_COLORS[0], label="step (alternate shades: columns)"),
                        Patch(color=WAIT_COLOR, label="waiting for the tile's turn"),
                        Patch(color=EPILOGUE_COLOR, label="column epilogue (model)")],
               loc="upper right", fontsize=9, ncol=3, frameon=False)
    fig.suptitle(trace.problem.describe(), x=0.01, y=0.995, ha="left", va="top", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=dpi)


# ---------------------------------------------------------------------------------------------
# python -m dash trace
# ---------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    from dash.cli import chart_file, head_dim, kernel_schedule, nonnegative_int, positive_int
    from dash.config import KERNEL_SCHEDULES

    p.add_argument("--seqlen", type=positive_int, default=4096, help="seqlen_q = seqlen_k (default 4096)")
    p.add_argument("--seqlen-k", type=positive_int, default=None, help="seqlen_k if different")
    p.add_argument("--hdim", type=head_dim, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--batch", type=positive_int, default=None, help="default: 16384 // seqlen (16k tokens)")
    p.add_argument("--heads", type=positive_int, default=None, help="default: 2048 // hdim (hidden 2048)")
    p.add_argument("--heads-kv", type=positive_int, default=None, help="default: --heads (MHA)")
    p.add_argument("--schedule", type=kernel_schedule, default="auto", metavar="NAME",
                   help=f"auto (default) or a kernel schedule: {', '.join(KERNEL_SCHEDULES)}")
    p.add_argument("--nondeterministic", action="store_true", help="trace the non-deterministic mode")
    p.add_argument("--sm-margin", type=nonnegative_int, default=0)
    p.add_argument("--gantt", type=chart_file, default=None, help="write the measured-vs-model Gantt chart here")
    p.add_argument("--json", default=None, help="write the summary (and fitted costs) as JSON here")
    p.add_argument("--max-ctas", type=positive_int, default=32, help="CTAs shown in the Gantt chart")


def _shape(args: argparse.Namespace) -> tuple[int, int, int, int, int]:
    """(batch, seqlen_k, heads, heads_kv, head_dim) of the traced problem, defaults resolved."""
    heads = args.heads or max(2048 // args.hdim, 1)
    return (args.batch or max(16384 // args.seqlen, 1), args.seqlen_k or args.seqlen, heads,
            args.heads_kv or heads, args.hdim)


def _random_inputs(args: argparse.Namespace, device: str = "cuda"):
    """q, k, v, dout of the traced problem (bf16, seed 0)."""
    import torch

    batch, seqlen_k, heads, heads_kv, hdim = _shape(args)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, args.seqlen, heads, hdim, device=device, dtype=torch.bfloat16, generator=g)
    k = torch.randn(batch, seqlen_k, heads_kv, hdim, device=device, dtype=torch.bfloat16, generator=g)
    return q, k, torch.randn_like(k), torch.randn_like(q)


def combination_problem(args: argparse.Namespace) -> str | None:
    """Why these options cannot run together (one line naming the argument), or None."""
    _, _, heads, heads_kv, _ = _shape(args)
    if heads % heads_kv:
        return (f"argument --heads-kv: {heads_kv} does not divide the {heads} query heads "
                "(GQA needs heads % heads-kv == 0)")
    if args.schedule == "shift" and args.causal:
        return "argument --schedule: 'shift' is for full masks; with --causal use auto, fa3, interleaved or descending"
    return None


def run(args: argparse.Namespace) -> int:
    from dash._bench import _gpu_ok
    from dash.cli import output_path_problem, usage_error

    if args.json:
        why = output_path_problem(args.json)
        if why:
            return usage_error("trace", f"argument --json: {why}")
    why = combination_problem(args)
    if why:
        return usage_error("trace", why)
    ok, why = _gpu_ok()
    if not ok:
        print(f"python -m dash trace: error: needs an sm_90 GPU with DASH's kernels ({why}); nothing to trace here "
              "(python -m dash simulate runs the scheduling model without a GPU)", file=sys.stderr)
        return 1
    import torch

    batch, _, heads, _, hdim = _shape(args)
    det = not args.nondeterministic
    try:
        q, k, v, dout = _random_inputs(args)
        from dash.ops import forward_impl
        from dash.validation import validate_inputs

        # The forward below runs the op directly: DASH's checks first (a head dim or dtype not
        # built here, a schedule that cannot run this shape), so they say what is wrong.
        validate_inputs(q, k, v, causal=args.causal, deterministic=det, schedule=args.schedule,
                        sm_margin=args.sm_margin, backward=True)
        out, lse = forward_impl(q, k, v, hdim ** -0.5, args.causal)
        # One untraced warm-up call (module load, descriptor caches), then the traced one.
        trace_backward(dout, q, k, v, out, lse, causal=args.causal, deterministic=det, schedule=args.schedule,
                       sm_margin=args.sm_margin)
        *_, tr = trace_backward(dout, q, k, v, out, lse, causal=args.causal, deterministic=det,
                                schedule=args.schedule, sm_margin=args.sm_margin)
    except (ValueError, NotImplementedError) as e:  # DASH's input checks (e.g. 'shift' on too short a seqlen)
        return usage_error("trace", str(e).splitlines()[0])
    except torch.cuda.OutOfMemoryError:
        print(f"python -m dash trace: error: out of GPU memory for batch {batch} x seqlen {args.seqlen} x {heads} "
              "heads; lower --batch or --seqlen", file=sys.stderr)
        return 1
    s = tr.summary()
    print(f"{torch.cuda.get_device_name(0)}: {s['problem']}; schedule {tr.schedule}, "
          f"{'deterministic' if det else 'non-deterministic'}, {tr.ctas} CTAs, {tr.num_steps} steps")
    print(f"  measured : {s['makespan_us']:9.1f} µs (writers' first to last step), "
          f"turn waits {100 * s['wait_fraction']:.2f} % of the grid's time (worst CTA {100 * s['wait_fraction_max_cta']:.2f} %)")
    fc = s["fitted_costs_us"]
    print(f"  fitted   : c {fc['c']:.3f} µs/step, r {fc['r']:.3f}, latency {fc['latency']:.3f}, "
          f"epilogue {fc['epilogue']:.3f}")
    print(f"  model    : {s['model_makespan_us']:9.1f} µs with the fitted costs, "
          f"turn waits {100 * s['model_wait_fraction']:.2f} % (static dispatch)")
    if s["model_replay_makespan_us"] is not None:
        gap, mgap = s["column_start_gap_us_median"], s["model_replay_column_start_gap_us_median"]
        print(f"  replayed : {s['model_replay_makespan_us']:9.1f} µs with claims in simulated time (what auto ranks by)"
              + (f"; a head's columns start {gap:.2f} µs apart (median; replay {mgap:.2f})"
                 if gap is not None and mgap is not None else ""))
    problems = tr.check_against_model()
    print("  order    : " + ("the kernel's accumulation order equals the model's" if not problems
                             else "; ".join(problems)))
    if args.gantt:
        plot_trace_gantt(tr, args.gantt, max_ctas=args.max_ctas)
        print(f"  wrote {args.gantt}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**s, "order_problems": problems, "kind": "trace"}, f, indent=2)
        print(f"  wrote {args.json}")
    return 0 if not problems else 1
