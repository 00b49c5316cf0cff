"""The brain of ``schedule="auto"``: rank schedules for a shape with the model.

``rank_schedules`` plans and simulates every candidate for the grid the kernel will launch,
drops the ones that cannot run there (deadlock, or a portable order needing more CTAs) and
sorts the rest by makespan; ties go to the earlier name in ``SCHEDULE_NAMES`` so the choice is
deterministic. Results are cached per (problem, ctas, costs, candidates, depth, portable).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable

from dash.schedules.orders import SCHEDULE_NAMES, make_plan
from dash.schedules.simulate import Costs, simulate
from dash.schedules.tiling import Problem


def rank_schedules(problem: Problem, ctas: int, costs: Costs | None = None,
                   candidates: Iterable[str] | None = None, *, depth: int = 1,
                   require_portable: bool = False) -> list[tuple[str, float]]:
    """``[(name, makespan), ...]`` fastest first, for the schedules that can run on ``ctas``.

    ``require_portable`` keeps only orders whose bits do not depend on the CTA count.
    """
    cands = tuple(SCHEDULE_NAMES if candidates is None else candidates)
    for name in cands:
        if name not in SCHEDULE_NAMES:
            raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULE_NAMES)}")
    return list(_rank(problem, int(ctas), costs or Costs(), cands, int(depth), bool(require_portable)))


@lru_cache(maxsize=256)
def _rank(problem: Problem, ctas: int, costs: Costs, cands: tuple[str, ...], depth: int,
          require_portable: bool) -> tuple[tuple[str, float], ...]:
    rows = []
    for name in cands:
        try:
            plan = make_plan(problem, name, ctas)
        except ValueError:
            continue  # e.g. a portable order whose team does not fit on this grid
        if require_portable and not plan.portable:
            continue
        res = simulate(plan, costs, depth)
        if res.deadlock_free:
            rows.append((name, float(res.makespan)))
    order = {n: i for i, n in enumerate(SCHEDULE_NAMES)}
    rows.sort(key=lambda r: (r[1], order[r[0]]))
    return tuple(rows)


def choose_schedule(problem: Problem, ctas: int, costs: Costs | None = None,
                    candidates: Iterable[str] | None = None, **kw) -> str:
    """The fastest schedule by the model (see ``rank_schedules``); ``fa3`` if none qualifies."""
    ranked = rank_schedules(problem, ctas, costs, candidates, **kw)
    return ranked[0][0] if ranked else "fa3"


def portability_cost(problem: Problem, ctas: int, costs: Costs | None = None, *, depth: int = 1) -> dict:
    """What bit-identical results across GPUs cost on this shape and grid.

    Returns ``{"best", "best_makespan", "best_portable", "portable_makespan", "slowdown"}``,
    ``slowdown = portable_makespan / best_makespan`` (1.0: portability is free).
    """
    allr = rank_schedules(problem, ctas, costs, depth=depth)
    port = rank_schedules(problem, ctas, costs, depth=depth, require_portable=True)
    best, bm = allr[0]
    pb, pm = port[0]
    return {"best": best, "best_makespan": bm, "best_portable": pb, "portable_makespan": pm,
            "slowdown": pm / bm if bm > 0 else 1.0}
