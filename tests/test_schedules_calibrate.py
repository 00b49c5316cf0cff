"""Calibration: recover known costs from synthetic 'measurements' of several schedules."""

from __future__ import annotations

import pytest

from dash.schedules import Costs, Measurement, Problem, choose_schedule, fit_costs, load_costs, make_plan, save_costs, simulate

# Shapes and schedules that expose different costs: FA3 full-mask staircases (r + latency),
# shift (c), waves on a small grid (r alone through the writer), causal orders (c_partial).
CASES = [
    (8, "fa3", False, 8), (16, "fa3", False, 16), (16, "shift", False, 16), (16, "fa3", False, 5),
    (16, "descending", True, 8), (16, "symmetric_shift", True, 8), (12, "shift", False, 5),
]


# More causal shapes with few columns, where diagonal tiles are a large share of the work.
CAUSAL_CASES = CASES + [(2, "fa3", True, 2), (4, "descending", True, 2), (3, "symmetric_shift", True, 1)]


def _measure(true: Costs, scale_noise=None, cases=CASES):
    out = []
    for i, (N, name, causal, P) in enumerate(cases):
        p = Problem(1, 2, 128 * N, 128 * N, block_m=128, block_n=128, causal=causal)
        t = simulate(make_plan(p, name, P), true).makespan
        if scale_noise:
            t *= 1.0 + scale_noise[i % len(scale_noise)]
        out.append(Measurement(p, name, P, t))
    return out


def test_fit_recovers_c_r_and_latency_from_exact_times():
    true = Costs(c=2.0, r=0.9, latency=0.3)
    cal = fit_costs(_measure(true))
    assert cal.costs.c == pytest.approx(2.0, rel=0.01)
    assert cal.costs.r == pytest.approx(0.9, rel=0.03)
    assert cal.costs.latency == pytest.approx(0.3, abs=0.02)
    assert cal.rel_rms < 1e-3


def test_fit_with_partial_tile_cost_and_noise():
    true = Costs(c=1.5, r=0.45, c_partial=0.9)
    cal = fit_costs(_measure(true, [0.01, -0.01, 0.005], CAUSAL_CASES), fit=("r", "c_partial"))
    assert cal.costs.c == pytest.approx(1.5, rel=0.03)
    assert cal.costs.r == pytest.approx(0.45, rel=0.15)
    assert cal.costs.c_partial == pytest.approx(0.9, rel=0.1)
    assert cal.rel_rms < 0.02
    assert len(cal.predictions) == len(CAUSAL_CASES)


def test_calibrated_costs_round_trip_and_drive_auto(tmp_path):
    costs = Costs(c=3.0, r=2.5, latency=0.5)
    path = tmp_path / "costs.json"
    save_costs(str(path), costs)
    assert load_costs(str(path)) == costs
    # With expensive reductions, shift's absence of waits matters even more.
    p = Problem(1, 4, 2048, 2048, block_m=128, block_n=128)
    assert choose_schedule(p, 64, costs) in ("shift", "portable")


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        fit_costs([])
    m = _measure(Costs())[:1]
    with pytest.raises(ValueError, match="cannot fit 'c'"):
        fit_costs(m, fit=("c",))
    with pytest.raises(ValueError, match="> 0"):
        fit_costs([Measurement(m[0].problem, "fa3", 8, 0.0)])
