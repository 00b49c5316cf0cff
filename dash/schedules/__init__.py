"""DASH's scheduling model: the specification of every backward schedule, and ``auto``'s brain.

Pure Python/NumPy, CPU only. The pieces:

* ``tiling`` — ``Problem`` (a shape) -> ``Tiling`` (columns, their Q-tile ranges, contributors);
* ``orders`` — the schedules (``fa3``, ``descending``, ``shift``, ``symmetric_shift``,
  ``portable``) -> ``Plan`` (column -> CTA, visit orders, ``turn(m, n)``) in array form;
* ``simulate`` — discrete-event model with costs ``Costs`` -> ``SimResult``; ``replay_claims``
  replays a claimed plan with claims in simulated time (what deterministic ``auto`` ranks by);
* ``checks`` — ``validate(plan)``: coverage, turn permutations, deadlock freedom, timing;
* ``dag`` — explicit DAGs and the paper's Lemma 1;
* ``auto`` — ``rank_schedules`` / ``choose_schedule`` / ``portability_cost``, and the kernel's
  ``schedule="auto"`` (``choose_kernel_schedule``, ``rank_kernel_schedules``);
* ``calibrate`` — ``fit_costs`` from measured kernel times;
* ``gantt`` — Gantt charts (matplotlib); ``cli`` — ``python -m dash simulate``.

See docs/scheduling-model.md.
"""

from dash.schedules.auto import choose_schedule, portability_cost, rank_schedules
from dash.schedules.calibrate import Calibration, Measurement, fit_costs, load_costs, save_costs
from dash.schedules.checks import ValidationReport, validate
from dash.schedules.orders import SCHEDULE_NAMES, Plan, expand_visits, make_plan
from dash.schedules.simulate import ClaimReplay, Costs, SimResult, replay_claims, simulate
from dash.schedules.tiling import Problem, Tiling, paper_problem, tile_problem

__all__ = [
    "SCHEDULE_NAMES", "Calibration", "ClaimReplay", "Costs", "Measurement", "Plan", "Problem", "SimResult", "Tiling",
    "ValidationReport", "choose_schedule", "expand_visits", "fit_costs", "load_costs", "make_plan",
    "paper_problem", "portability_cost", "rank_schedules", "replay_claims", "save_costs", "simulate", "tile_problem",
    "validate",
]
