"""Trace mode's host side on synthetic traces (CPU): decoding the kernel's records, checking
a trace against the model's order, wait fractions and fitted costs. A synthetic trace is the
model's own simulation written in the kernel's record format, so the checks must accept it
and must catch every kind of deviation planted into it."""

from __future__ import annotations

import numpy as np
import pytest

from dash.schedules import Costs, Problem, make_plan, simulate
from dash.schedules.auto import kernel_dq_chains
from dash.trace import TraceResult, decode_records


def _raw_from_simulation(plan, res) -> np.ndarray:
    st = plan.steps()
    S = plan.num_steps
    ids = np.zeros((S, 8), dtype=np.int32)
    ids[:, 0] = st["cta"]
    ids[:, 1] = st["b"] * plan.tiling.heads + st["h"]
    ids[:, 2] = st["n"]
    ids[:, 3] = st["m"]
    ids[:, 4] = st["t"]
    ids[:, 5] = st["turn"]
    raw = np.zeros((S, 8), dtype=np.int64)
    raw[:, :4] = ids.view(np.int64).reshape(S, 4)
    t0 = 123_456_789  # %globaltimer has an arbitrary epoch
    ns = lambda t: t0 + np.round(t * 1000).astype(np.int64)  # noqa: E731
    raw[:, 4] = ns(res.compute_start)  # the writer turns to the step as its compute starts
    raw[:, 5] = ns(res.compute_end)    # partial ready
    raw[:, 6] = ns(res.reduce_start)   # turn acquired
    raw[:, 7] = ns(res.reduce_end)     # released
    return raw


def _trace(problem, schedule, ctas, costs=Costs(c=2.0, r=0.5, latency=0.2)):
    plan = make_plan(problem, schedule, ctas)
    res = simulate(plan, costs, chains=kernel_dq_chains(problem.head_dim, problem.causal))  # the kernel's
    raw = _raw_from_simulation(plan, res)
    return plan, res, raw, TraceResult(problem, schedule, True, ctas, decode_records(raw, problem.heads_q))


CASES = [(Problem(2, 3, 1000, 777, head_dim=64, causal=True), "descending", 7),
         (Problem(2, 3, 1024, 1024, head_dim=128), "fa3", 5),
         (Problem(1, 4, 2048, 1024, head_dim=64), "shift", 6),
         (Problem(2, 2, 777, 1280, head_dim=128, causal=True), "interleaved", 3)]


@pytest.mark.parametrize("problem, schedule, ctas", CASES)
def test_the_models_own_trace_passes_every_check(problem, schedule, ctas):
    plan, res, raw, tr = _trace(problem, schedule, ctas)
    assert tr.num_steps == plan.num_steps
    assert tr.check_against_model(plan) == []
    # t_wait / t_done of the synthetic trace are the model's compute starts / reduce ends.
    assert tr.makespan_us == pytest.approx(res.reduce_end.max() - res.compute_start.min(), abs=2e-3)
    # The turn waits are the model's: reduction start - compute end (partial ready).
    assert tr.wait_us().sum() == pytest.approx(np.maximum(res.reduce_start - res.compute_end, 0).sum(), rel=1e-3, abs=1e-2)
    order = tr.accumulation_order()
    for (b, h, m, chain), cols in order.items():  # acquisitions follow the turns within a chain
        turns = [int(plan.turn[b, h, m, n]) for n in cols]
        assert turns == sorted(turns) and all(t % tr.chains == chain for t in turns)


def test_decode_drops_unwritten_rows_and_splits_heads():
    problem, schedule, ctas = CASES[0]
    plan, _, raw, _ = _trace(problem, schedule, ctas)
    raw = np.concatenate([raw, np.full((5, 8), -1, dtype=np.int64)])
    rec = decode_records(raw, problem.heads_q)
    assert len(rec["cta"]) == plan.num_steps
    assert set(rec["h"].tolist()) == set(range(problem.heads_q)) and set(rec["b"].tolist()) == {0, 1}
    assert rec["t_wait"].min() == 0.0


@pytest.mark.parametrize("problem, schedule, ctas", CASES)
def test_a_wrong_turn_is_caught(problem, schedule, ctas):
    plan, _, raw, _ = _trace(problem, schedule, ctas)
    ids = raw[:, :4].copy().view(np.int32).reshape(len(raw), 8)
    i = int(np.flatnonzero(ids[:, 5] > 0)[0])
    ids[i, 5] -= 1
    raw[:, :4] = ids.view(np.int64).reshape(len(raw), 4)
    tr = TraceResult(problem, schedule, True, ctas, decode_records(raw, problem.heads_q))
    assert any("turn" in p for p in tr.check_against_model(plan))


def test_an_out_of_order_acquisition_is_caught():
    problem, schedule, ctas = CASES[1]
    plan, _, raw, _ = _trace(problem, schedule, ctas)
    ids = raw[:, :4].copy().view(np.int32).reshape(len(raw), 8)
    # The contribution with turn `chains` of some tile acquires before the one with turn 0
    # (the next add of the same chain).
    j = int(np.flatnonzero(ids[:, 5] == kernel_dq_chains(problem.head_dim, problem.causal))[0])
    i = int(np.flatnonzero((ids[:, 5] == 0) & (ids[:, 1] == ids[j, 1]) & (ids[:, 3] == ids[j, 3]))[0])
    raw[j, 6] = raw[i, 6] - 1000
    tr = TraceResult(problem, schedule, True, ctas, decode_records(raw, problem.heads_q))
    assert any("acquired before" in p for p in tr.check_against_model(plan))


def test_a_wrong_visit_order_and_a_missing_step_are_caught():
    problem, schedule, ctas = CASES[0]
    plan, _, raw, _ = _trace(problem, schedule, ctas)
    ids = raw[:, :4].copy().view(np.int32).reshape(len(raw), 8)
    long_col = np.flatnonzero((ids[:, 2] == 0) & (ids[:, 1] == 0))
    a, b = long_col[0], long_col[1]
    ids[[a, b], 4] = ids[[b, a], 4]  # swap two steps' positions in one column
    raw2 = raw.copy()
    raw2[:, :4] = ids.view(np.int64).reshape(len(raw), 4)
    tr = TraceResult(problem, schedule, True, ctas, decode_records(raw2, problem.heads_q))
    assert any("visited" in p for p in tr.check_against_model(plan))
    tr = TraceResult(problem, schedule, True, ctas, decode_records(raw[1:], problem.heads_q))
    assert any("missing" in p for p in tr.check_against_model(plan))


def test_a_static_schedule_on_the_wrong_cta_is_caught():
    problem, schedule, ctas = CASES[2]
    plan, _, raw, _ = _trace(problem, schedule, ctas)
    ids = raw[:, :4].copy().view(np.int32).reshape(len(raw), 8)
    first_col = (ids[:, 1] == ids[0, 1]) & (ids[:, 2] == ids[0, 2])
    ids[first_col, 0] = (ids[0, 0] + 1) % ctas
    raw[:, :4] = ids.view(np.int64).reshape(len(raw), 4)
    tr = TraceResult(problem, schedule, True, ctas, decode_records(raw, problem.heads_q))
    assert any("work list" in p for p in tr.check_against_model(plan))


def test_fitted_costs_recover_the_simulated_ones():
    costs = Costs(c=2.0, r=0.5, latency=0.3)
    problem = Problem(2, 4, 2048, 2048, head_dim=64)
    plan, res, raw, tr = _trace(problem, "fa3", 8, costs)  # fa3's staircase: many hand-offs to measure
    fit = tr.fit_costs()
    assert fit.c == pytest.approx(costs.c, rel=0.05)
    assert fit.r + fit.latency == pytest.approx(costs.r + costs.latency, rel=0.05)
    assert 0.0 <= tr.wait_fraction() < 1.0
    assert tr.wait_fraction_per_cta().shape == (8,)


def test_column_start_gaps_and_the_replay_in_the_summary():
    """The model's own trace of a static plan: a head's columns start exactly as the simulation
    started them, so the measured gaps are the simulation's; the summary carries the replay's
    makespan (claimed schedules only) and its gaps beside them."""
    from dash.trace import median_gaps_per_head

    problem = Problem(2, 3, 1024, 1024, head_dim=128)
    plan, res, raw, tr = _trace(problem, "fa3", 5)
    st = plan.steps()
    first = {}
    for i in np.argsort(res.compute_end, kind="stable"):
        first.setdefault((int(st["b"][i]), int(st["h"][i]), int(st["n"][i])), float(res.compute_end[i]))
    keys = sorted(first)
    heads = np.array([b * 3 + h for b, h, _ in keys])
    want = median_gaps_per_head(heads, np.array([first[k] for k in keys]))
    assert tr.column_start_gaps_us() == pytest.approx(want, abs=2e-3)
    assert median_gaps_per_head(np.array([0, 0, 0, 1]), np.array([5.0, 1.0, 2.0, 9.0])).tolist() == [2.0]
    sm = tr.summary()
    assert sm["model_replay_makespan_us"] > 0 and sm["column_start_gap_us_median"] is not None
    assert sm["model_replay_column_start_gap_us_median"] is not None
    _, _, _, tr_shift = _trace(Problem(1, 4, 2048, 1024, head_dim=64), "shift", 6)
    assert tr_shift.replay_model() is None and tr_shift.summary()["model_replay_makespan_us"] is None


def test_decode_rejects_a_wrong_layout():
    with pytest.raises(ValueError, match="int64"):
        decode_records(np.zeros((3, 10), dtype=np.int64), 2)


def test_measured_gantt_beside_the_model(tmp_path):
    pytest.importorskip("matplotlib")
    from dash.trace import plot_trace_gantt

    problem, schedule, ctas = CASES[1]
    *_, tr = _trace(problem, schedule, ctas)
    out = tmp_path / "trace.png"
    plot_trace_gantt(tr, str(out), max_ctas=4)
    import matplotlib.image

    img = matplotlib.image.imread(str(out))
    assert out.stat().st_size > 20_000 and img.shape[0] > 500 and img.shape[1] > 1000
