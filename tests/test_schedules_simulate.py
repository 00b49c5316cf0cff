"""The discrete-event simulator on cases small enough to compute by hand, and its speed."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dash.schedules import Costs, Problem, make_plan, paper_problem, simulate, validate


def _one_column(M, **kw):
    return make_plan(Problem(1, 1, M * 128, 128, block_m=128, block_n=128, **kw), "fa3", 1)


@pytest.mark.parametrize("depth, r, want", [(1, 0.3, 3.3), (0, 0.3, 3.9), (1, 2.0, 7.0), (2, 2.0, 7.0)])
def test_pipeline_of_one_column(depth, r, want):
    """compute k+1+depth waits for reduction k; depth 0 is the no-overlap mode."""
    res = simulate(_one_column(3), Costs(c=1.0, r=r), depth=depth)
    assert res.makespan == pytest.approx(want)
    assert res.deadlock_free and res.total_wait == 0


def test_pipeline_trace_depth_one():
    res = simulate(_one_column(3), Costs(c=1.0, r=2.0), depth=1)
    assert list(res.compute_start) == [0, 1, 3]
    assert list(res.reduce_start) == [1, 3, 5]


@pytest.mark.parametrize("latency", [0.0, 0.25])
def test_fa3_staircase_on_one_tile(latency):
    """N columns reducing into one tile in ascending order: the k-th waits k turns."""
    N = 6
    plan = make_plan(Problem(1, 1, 128, N * 128, block_m=128, block_n=128), "fa3", N)
    res = simulate(plan, Costs(c=1.0, r=0.3, latency=latency))
    assert res.makespan == pytest.approx(1 + N * 0.3 + (N - 1) * latency)
    waits = sorted(res.turn_wait)
    assert waits == pytest.approx([k * (0.3 + latency) for k in range(N)])
    assert res.max_wait == pytest.approx(sum(waits))
    path = res.critical_path
    assert path[0].start == 0 and path[-1].end == pytest.approx(res.makespan)
    assert [nd.kind for nd in path] == ["compute"] + ["reduce"] * N


def test_critical_path_is_contiguous():
    plan = make_plan(paper_problem(1024, 64), "fa3", 132)
    res = simulate(plan, Costs(latency=0.05))
    path = res.critical_path
    assert path[0].start == pytest.approx(0) and path[-1].end == pytest.approx(res.makespan)
    for a, b in zip(path, path[1:]):
        gap = b.start - a.end
        assert gap == pytest.approx(0, abs=1e-9) or gap == pytest.approx(0.05), (a, b)


def test_tile_classes_have_their_own_compute_cost():
    # Causal 4 x 4 tiles of 128 x 128: column n visits the diagonal tile n and 3 - n full tiles.
    plan = make_plan(Problem(1, 1, 512, 512, causal=True, block_m=128, block_n=128), "fa3", 2)
    res = simulate(plan, Costs(c=1.0, c_partial=0.5, r=0.0))
    assert res.busy.sum() == pytest.approx(4 * 0.5 + 6 * 1.0)


def test_gqa_dkdv_epilogues_follow_the_head_order():
    p = Problem(1, 2, 2 * 128, 128, heads_kv=1, block_m=128, block_n=128)
    res = simulate(make_plan(p, "fa3", 2), Costs(c=1.0, r=0.0, epilogue=0.5, r_kv=0.25, latency=0.1))
    # Head 0's epilogue ends at 2 + 0.75; head 1's waits for it, plus the hand-off.
    assert res.epilogue_end.max() == pytest.approx(2 + 0.75 + 0.1 + 0.75)
    assert res.makespan == pytest.approx(3.6)


@pytest.mark.parametrize("kv_chains, want", [(1, 1 + 0.75 + 2 * 0.85), (2, 1 + 0.75 + 0.1 + 0.75)])
def test_gqa_dkdv_chains_let_heads_add_side_by_side(kv_chains, want):
    """Three query heads of one KV head, one column each, on three CTAs: with one chain the
    epilogues run one after another; with two, heads 0 and 1 start a chain each (no wait) and
    head 2 waits for both, then sums the chains."""
    p = Problem(1, 3, 128, 128, heads_kv=1, block_m=128, block_n=128)
    res = simulate(make_plan(p, "fa3", 3), Costs(c=1.0, r=0.0, epilogue=0.5, r_kv=0.25, latency=0.1),
                   kv_chains=kv_chains)
    assert res.deadlock_free
    assert res.makespan == pytest.approx(want)


def test_kv_links_chain_heads_and_let_the_last_head_sum_every_chain():
    from dash.schedules.simulate import kv_links

    plan = make_plan(Problem(1, 8, 128, 256, heads_kv=1, block_m=128, block_n=128), "fa3", 4)
    for C in (1, 2, 3, 7, 9):
        preds, succ = kv_links(plan, C)
        eff = min(C, 7)
        assert preds.shape == (len(plan.cols), eff)
        for ci, (b, h, n) in enumerate(plan.cols.astype(int)):
            got = sorted(int(plan.cols[p][1]) for p in preds[ci] if p >= 0)
            assert all(plan.cols[p][0] == b and plan.cols[p][2] == n for p in preds[ci] if p >= 0)
            if h < 7:
                assert got == ([h - eff] if h >= eff else []), (C, h, got)
            else:  # the last head waits for the last head of every chain
                assert got == sorted(max(j for j in range(7) if j % eff == c) for c in range(eff)), (C, got)
        # Every column but the last head's is waited for by exactly one column.
        waited = succ >= 0
        assert waited.sum() == np.count_nonzero(preds >= 0)
        assert all(plan.cols[ci][1] != 7 for ci in np.flatnonzero(waited))


def test_idle_fraction_and_lower_bound():
    res = simulate(_one_column(4), Costs(c=1.0, r=0.3))
    assert res.idle_fraction[0] == pytest.approx(1 - 4 / 4.3)
    two = simulate(make_plan(Problem(1, 1, 4 * 128, 128, block_m=128, block_n=128), "fa3", 2))
    assert two.idle_fraction[1] == 1.0
    assert two.lower_bound == pytest.approx(4.3)  # the column's chain, not work / P = 2
    assert res.lower_bound <= res.makespan


def test_a_turn_order_against_program_order_deadlocks():
    plan = make_plan(Problem(1, 1, 2 * 128, 3 * 128, block_m=128, block_n=128), "fa3", 1)
    contrib = plan.turn >= 0
    plan.turn[contrib] = 2 - np.broadcast_to(np.arange(3), plan.turn.shape)[contrib]  # descending n on one CTA
    res = simulate(plan)
    assert not res.deadlock_free and np.isnan(res.makespan)
    assert "waits for step" in res.blocked[0]
    rep = validate(plan)
    assert not rep.ok and not rep.deadlock_free and "deadlock" in rep.problems[0]
    assert res.summary()["deadlock_free"] is False and res.summary()["makespan"] is None


def test_deadlock_free_plans_stay_so_under_random_timing():
    plan = make_plan(Problem(2, 2, 700, 900, causal=True, block_m=64, block_n=128), "symmetric_shift", 5)
    rng = np.random.default_rng(3)
    for _ in range(3):
        res = simulate(plan, c_steps=rng.exponential(1.0, plan.num_steps), r_steps=rng.exponential(0.3, plan.num_steps))
        assert res.deadlock_free
    with pytest.raises(ValueError, match="c_steps"):
        simulate(plan, c_steps=np.ones(3))


def test_makespan_scales_with_the_costs():
    plan = make_plan(paper_problem(1024, 128, True), "descending", 132)
    a = simulate(plan, Costs(c=1.0, r=0.4, latency=0.1)).makespan
    b = simulate(plan, Costs(c=1.0, r=0.4, latency=0.1).scaled(2.5)).makespan
    assert b == pytest.approx(2.5 * a)


def test_paper_16k_hdim64_simulates_in_seconds():
    """32 heads x 128 columns x 128 Q tiles = 524,288 steps on 132 CTAs: about 1.5 s of this
    process's CPU time on the CI machine. The bound is loose (and on CPU time, not wall time,
    so a busy machine does not fail it); it is there to catch a change that makes the
    simulation superlinear, which would take minutes here."""
    p = paper_problem(16384, 64)
    t0 = time.process_time()
    plan = make_plan(p, "shift", 132)
    res = simulate(plan)
    elapsed = time.process_time() - t0
    assert plan.num_steps == 32 * 128 * 128 and res.deadlock_free
    assert elapsed < 6.0, f"{elapsed:.2f} s of CPU time"
