"""Lemma 1 on explicit DAGs (property-based), and the simulator as a longest path."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dash.schedules import Costs, Problem, make_plan, simulate
from dash.schedules.dag import (Dag, edge_keeps_all_starts, edge_keeps_critical_path, lemma1_predicts_kept,
                                plan_dag)


@st.composite
def dags_with_a_new_edge(draw):
    """A random DAG (nodes in topological order), and a pair (u, v) with v not reaching u."""
    n = draw(st.integers(2, 12))
    weights = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    edges = []
    for v in range(n):
        for u in range(v):
            if draw(st.booleans()) and draw(st.booleans()):
                edges.append((u, v, float(draw(st.integers(0, 3)))))
    dag = Dag([float(w) for w in weights], edges)
    u = draw(st.integers(0, n - 1))
    v = draw(st.integers(0, n - 1))
    return dag, u, v


@settings(max_examples=200, deadline=None)
@given(dags_with_a_new_edge())
def test_lemma1_zero_weight_edge_keeps_critical_path_iff_depth_u_le_latest_start_v(case):
    dag, u, v = case
    assume(u != v and not dag.reaches(v, u))
    assert edge_keeps_critical_path(dag, u, v) == lemma1_predicts_kept(dag, u, v)


@settings(max_examples=200, deadline=None)
@given(dags_with_a_new_edge())
def test_lemma1_strong_form_no_start_moves_iff_depth_u_le_earliest_start_v(case):
    dag, u, v = case
    assume(u != v and not dag.reaches(v, u))
    assert edge_keeps_all_starts(dag, u, v) == bool(dag.depth()[u] <= dag.earliest_start()[v])


def test_lemma1_on_a_schedule_without_slack_is_the_papers_depth_rule():
    # Two chains of unit steps in lock step: every node is critical, so lst == est.
    dag = Dag([1.0] * 6, [(0, 1, 0.0), (1, 2, 0.0), (3, 4, 0.0), (4, 5, 0.0)])
    d = dag.depth()
    for u, v in [(0, 4), (1, 5), (0, 5), (1, 4), (2, 3)]:
        assert lemma1_predicts_kept(dag, u, v) == (d[u] <= d[v] - 1.0) == edge_keeps_critical_path(dag, u, v)


def test_cycle_is_reported():
    dag = Dag([1.0, 1.0], [(0, 1, 0.0), (1, 0, 0.0)])
    with pytest.raises(ValueError, match="cycle"):
        dag.topological_order()
    with pytest.raises(ValueError, match="cycle"):
        edge_keeps_critical_path(Dag([1.0, 1.0], [(0, 1, 0.0)]), 1, 0)


@pytest.mark.parametrize("name", ["fa3", "descending", "shift", "symmetric_shift", "portable"])
@pytest.mark.parametrize("causal", [False, True])
def test_simulated_makespan_is_the_dag_critical_path(name, causal):
    p = Problem(1, 2, 600, 520, heads_kv=1, causal=causal, block_m=64, block_n=128)
    costs = Costs(c=1.0, r=0.45, latency=0.1, c_partial=0.7, epilogue=0.3, r_kv=0.2)
    for depth in (0, 1):
        plan = make_plan(p, name, 3 if name != "portable" else 6)
        dag, _ = plan_dag(plan, costs, depth)
        assert simulate(plan, costs, depth).makespan == pytest.approx(dag.critical_path_length())
    # GQA dK/dV chains: 4 query heads of one KV head, heads 0-2 in two chains, head 3 sums them.
    p4 = Problem(1, 4, 600, 520, heads_kv=1, causal=causal, block_m=64, block_n=128)
    plan = make_plan(p4, name, 5 if name != "portable" else 6)
    dag, _ = plan_dag(plan, costs, 1, kv_chains=2)
    assert simulate(plan, costs, 1, kv_chains=2).makespan == pytest.approx(dag.critical_path_length())


def test_shift_turn_edges_respect_arrival_depth_and_fa3s_do_not():
    """The paper's argument via Lemma 1: shift's reduction order is free, FA3's is not."""
    p = Problem(1, 1, 8 * 128, 8 * 128, block_m=128, block_n=128)
    costs = Costs(c=1.0, r=0.3)
    for name, free in (("shift", True), ("fa3", False)):
        plan = make_plan(p, name, 8)
        with_turns, idx = plan_dag(plan, costs)
        without, _ = plan_dag(plan, costs, with_turns=False)
        depth, est = without.depth(), without.earliest_start()
        respects = all(depth[u] <= est[v] for u, v in idx["turn_edges"])
        assert respects == free
        same = with_turns.critical_path_length() == pytest.approx(without.critical_path_length())
        assert same == free
