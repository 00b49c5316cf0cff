"""``validate``: the checks every schedule must pass, callable by users on any plan.

1. coverage — every existing column is on exactly one CTA, and every required (m, n) pair is
   visited exactly once and no other pair is;
2. turns — for each Q tile the turns of its contributors are a permutation of 0..count-1 and
   non-contributors have turn -1;
3. compact form — ``visit_desc`` reproduces ``visit_m``;
4. deadlock-free — the simulation completes for the planned grid, under the given costs and
   under random per-step costs (timing), and on every tile the reductions happen in turn order
   whatever the timing (the order is a property of the plan, never of the timing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dash.schedules.orders import Plan, expand_visits, rank_within
from dash.schedules.simulate import Costs, simulate, turn_chain_keys


@dataclass
class ValidationReport:
    """Result of ``validate``; ``ok`` is True when every check passed."""

    schedule: str
    ctas: int
    coverage_ok: bool
    turns_ok: bool
    compact_ok: bool
    deadlock_free: bool
    timing_ok: bool
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.coverage_ok and self.turns_ok and self.compact_ok and self.deadlock_free and self.timing_ok

    def raise_if_failed(self) -> None:
        if not self.ok:
            raise AssertionError(f"schedule {self.schedule!r} on {self.ctas} CTAs failed: " + "; ".join(self.problems))


def check_coverage(plan: Plan) -> list[str]:
    """Problems with which columns run where and which (m, n) pairs are visited."""
    t = plan.tiling
    out: list[str] = []
    B, H, M, N = t.batch, t.heads, t.mmax, t.nmax
    if plan.cta_ptr[0] != 0 or plan.cta_ptr[-1] != len(plan.cols) or np.any(np.diff(plan.cta_ptr) < 0):
        out.append("cta_ptr is not a partition of cols")
    exists = np.arange(N)[None, :] < t.num_n[:, None]  # (B, N)
    ncol = np.zeros((B, H, N), dtype=np.int64)
    if len(plan.cols):
        c = plan.cols.astype(np.int64)
        if c[:, 2].max() >= N or c.min() < 0:
            out.append("a column index is out of range")
            return out
        np.add.at(ncol, (c[:, 0], c[:, 1], c[:, 2]), 1)
    want = np.broadcast_to(exists[:, None, :], ncol.shape).astype(np.int64)
    if not np.array_equal(ncol, want):
        bad = np.argwhere(ncol != want)[0]
        out.append(f"column (b, h, n)={tuple(int(v) for v in bad)} scheduled {ncol[tuple(bad)]} times, "
                   f"expected {want[tuple(bad)]}")
    if plan.num_steps:
        st = plan.steps()
        if st["m"].min() < 0 or st["m"].max() >= M:
            out.append("a visited Q tile is out of range")
            return out
        seen = np.zeros((B, H, M, N), dtype=np.int64)
        np.add.at(seen, (st["b"], st["h"], st["m"], st["n"]), 1)
    else:
        seen = np.zeros((B, H, M, N), dtype=np.int64)
    req = np.broadcast_to(t.contributes()[:, None], seen.shape).astype(np.int64)
    if not np.array_equal(seen, req):
        bad = np.argwhere(seen != req)[0]
        out.append(f"(b, h, m, n)={tuple(int(v) for v in bad)} visited {seen[tuple(bad)]} times, "
                   f"expected {req[tuple(bad)]}")
    return out


def check_turns(plan: Plan) -> list[str]:
    """Problems with the turn table: permutation per tile, -1 elsewhere."""
    t = plan.tiling
    out: list[str] = []
    contrib = np.broadcast_to(t.contributes()[:, None], plan.turn.shape)
    if np.any(plan.turn[~contrib] != -1):
        out.append("a non-contributor has a turn")
    b, h, m, n = np.nonzero(contrib)
    if len(b):
        turn = plan.turn[b, h, m, n].astype(np.int64)
        rank = rank_within((b * t.heads + h) * t.mmax + m, turn)
        if not np.array_equal(turn, rank):
            k = int(np.flatnonzero(turn != rank)[0])
            out.append(f"turns of Q tile (b={b[k]}, h={h[k]}, m={m[k]}) are not a permutation of its contributors")
    return out


def validate(plan: Plan, *, costs: Costs | None = None, depth: int = 1, timing_trials: int = 2,
             seed: int = 0, chains: int = 1, kv_chains: int = 1) -> ValidationReport:
    """Run every check on ``plan`` (see module docstring) and return a report. ``chains``:
    accumulation chains per Q tile (``simulate``); the order check is then per chain.
    ``kv_chains``: GQA dK/dV chains per KV group (``simulate``)."""
    problems = check_coverage(plan)
    coverage_ok = not problems
    tp = check_turns(plan)
    problems += tp
    ptr, vm = expand_visits(plan.visit_desc.astype(np.int64))
    compact_ok = np.array_equal(ptr, plan.visit_ptr) and np.array_equal(vm, plan.visit_m)
    if not compact_ok:
        problems.append("visit_desc does not reproduce visit_m")
    deadlock_free = timing_ok = True
    if coverage_ok and not tp:
        res = simulate(plan, costs, depth, chains=chains, kv_chains=kv_chains)
        deadlock_free = res.deadlock_free
        if not deadlock_free:
            problems.append(f"deadlock on {plan.ctas} CTAs: " + "; ".join(
                f"CTA {x}: {why}" for x, why in list(res.blocked.items())[:4]))
        rng = np.random.default_rng(seed)
        st = plan.steps() if plan.num_steps else None
        for _ in range(timing_trials if deadlock_free else 0):
            S = plan.num_steps
            r2 = simulate(plan, costs, depth, c_steps=rng.uniform(0.0, 2.0, S), r_steps=rng.uniform(0.05, 1.0, S),
                          chains=chains, kv_chains=kv_chains)
            if not r2.deadlock_free:
                timing_ok = False
                problems.append("deadlock under random timing")
                break
            if S:
                tile = turn_chain_keys(st, plan, chains)
                order = np.lexsort((r2.reduce_start, tile))
                tt, tn = tile[order], st["turn"][order]
                same = tt[1:] == tt[:-1]
                if np.any(tn[1:][same] <= tn[:-1][same]):
                    timing_ok = False
                    problems.append("reductions happened out of turn order under random timing")
                    break
    else:
        deadlock_free = timing_ok = False
    return ValidationReport(plan.schedule, plan.ctas, coverage_ok, not tp, compact_ok, deadlock_free,
                            timing_ok, problems)
