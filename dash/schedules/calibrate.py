"""Fit the model's costs to measured kernel times, so ``auto`` ranks with real costs.

Give a few ``Measurement``s — one problem, schedule and grid each, with the measured time of
the backward main kernel (any unit; the fitted costs come out in that unit) — preferably of
schedules that stress different costs (``fa3`` full mask exposes ``r``; ``shift`` mostly ``c``;
causal shapes expose ``c_partial``). ``fit_costs`` then minimises the relative squared error
``sum(((model_i - time_i) / time_i) ** 2)``:

* the makespan is positively homogeneous in the costs (all costs x a => makespan x a), so for
  fixed cost *ratios* the best overall scale ``c`` has a closed form;
* the ratios of the fitted costs (default ``r`` and ``latency``) to ``c`` are searched on a
  coarse grid, then refined by a pattern search. Costs not fitted keep their ratio to ``c``
  from ``start``.

``save_costs`` / ``load_costs`` keep a calibration as JSON (``python -m dash simulate --costs``).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from dash.schedules.orders import Plan, make_plan
from dash.schedules.simulate import Costs, simulate
from dash.schedules.tiling import Problem

_RATIO_GRID = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
FITTABLE = ("r", "latency", "c_partial", "c_empty", "epilogue", "r_kv")


@dataclass(frozen=True)
class Measurement:
    """A measured time of ``schedule`` planned and launched on ``ctas`` CTAs."""

    problem: Problem
    schedule: str
    ctas: int
    time: float
    portable: bool = False


@dataclass
class Calibration:
    """Fitted ``costs``, the relative RMS error and the model's prediction per measurement."""

    costs: Costs
    rel_rms: float
    predictions: list[float]
    measurements: list[Measurement] = field(repr=False, default_factory=list)


def _base(start: Costs, fit: Sequence[str], ratios: Sequence[float]) -> Costs:
    """Costs with ``c = 1``: fitted ratios from ``ratios``, the rest from ``start`` / start.c."""
    d = start.scaled(1.0 / start.c).as_dict()
    for k, v in zip(fit, ratios):
        d[k] = float(v)
    return Costs(**d)


def fit_costs(measurements: Sequence[Measurement], *, fit: Sequence[str] = ("r", "latency"),
              start: Costs | None = None, depth: int = 1, tol: float = 1e-3) -> Calibration:
    """Fit ``c`` (always) and the ratios ``fit`` (names from ``FITTABLE``) to the measurements."""
    if not measurements:
        raise ValueError("fit_costs needs at least one measurement")
    for k in fit:
        if k not in FITTABLE:
            raise ValueError(f"cannot fit {k!r}; fittable: {', '.join(FITTABLE)} (c is always fitted)")
    start = start or Costs()
    if start.c <= 0:
        raise ValueError("start.c must be > 0")
    plans: list[Plan] = [make_plan(m.problem, m.schedule, m.ctas, portable=m.portable) for m in measurements]
    y = np.array([m.time for m in measurements], dtype=np.float64)
    if np.any(y <= 0):
        raise ValueError("measured times must be > 0")
    cache: dict[tuple, tuple[float, float, np.ndarray]] = {}

    def evaluate(ratios: tuple[float, ...]) -> tuple[float, float, np.ndarray]:
        key = tuple(round(v, 9) for v in ratios)
        if key not in cache:
            base = _base(start, fit, key)
            T = np.array([simulate(p, base, depth).makespan for p in plans])
            a = float(np.sum(T / y) / np.sum((T / y) ** 2))
            err = float(np.sum((a * T / y - 1.0) ** 2))
            cache[key] = (err, a, T)
        return cache[key]

    # Coarse grid (at most 3 fitted ratios on the full grid; more start from `start`).
    s0 = _base(start, (), ()).as_dict()
    init = tuple(float(s0[k] if s0[k] is not None else 1.0) for k in fit)
    grids = [_RATIO_GRID if len(fit) <= 3 else (init[i],) for i in range(len(fit))]
    best = min(itertools.product(*grids), key=lambda r: evaluate(r)[0]) if fit else ()
    # Pattern search along the axes and the diagonals (the error has valleys such as r + latency
    # = const, where axis moves alone stall).
    dirs = []
    for i in range(len(fit)):
        e = [0.0] * len(fit)
        e[i] = 1.0
        dirs += [tuple(e), tuple(-v for v in e)]
        for j in range(i + 1, len(fit)):
            for si, sj in ((1, 1), (1, -1), (-1, 1), (-1, -1)):
                e = [0.0] * len(fit)
                e[i], e[j] = float(si), float(sj)
                dirs.append(tuple(e))
    step = 0.25
    while fit and step > tol:
        improved = False
        for d in dirs:
            cand = tuple(max(0.0, b + step * v) for b, v in zip(best, d))
            if evaluate(cand)[0] < evaluate(best)[0] - 1e-15:
                best, improved = cand, True
        if not improved:
            step /= 2
    err, a, T = evaluate(tuple(best))
    costs = _base(start, fit, best).scaled(a)
    return Calibration(costs, float(np.sqrt(err / len(y))), list(a * T), list(measurements))


def save_costs(path: str, costs: Costs) -> None:
    """Write ``costs`` as JSON."""
    with open(path, "w") as f:
        json.dump(costs.as_dict(), f, indent=2)
        f.write("\n")


def load_costs(path: str) -> Costs:
    """Read costs written by ``save_costs`` (unknown keys are an error)."""
    with open(path) as f:
        d = json.load(f)
    return Costs(**d)
