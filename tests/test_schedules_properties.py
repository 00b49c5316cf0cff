"""Every schedule passes every check on random shapes and grids, degenerate ones included."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dash.schedules import Costs, Problem, make_plan, simulate, validate
from dash.schedules.orders import SCHEDULE_NAMES


@st.composite
def problems(draw, max_len: int = 700):
    """Random shapes: full / causal / sliding window, GQA, varlen with empty sequences,
    tile shapes where kBlockN is not a multiple of kBlockM, sq != sk, one column, M < N."""
    B = draw(st.integers(1, 3))
    hkv = draw(st.integers(1, 2))
    H = hkv * draw(st.integers(1, 2))
    bm = draw(st.sampled_from([64, 128]))
    bn = draw(st.sampled_from([64, 128, 192]))
    mask = draw(st.sampled_from(["full", "causal", "local"]))
    kw = {}
    if mask == "causal":
        kw["causal"] = True
    elif mask == "local":
        kw["window"] = (draw(st.integers(-1, 400)), draw(st.integers(-1, 400)))
    # Lengths near multiples of the tiles (hypothesis otherwise favours tiny values).
    length = st.builds(lambda k, d: max(0, min(max_len, k * 64 + d)), st.integers(0, max_len // 64), st.integers(-40, 40))
    if draw(st.booleans()) and draw(st.booleans()):
        kw["seqlens_q"] = tuple(draw(st.lists(length, min_size=B, max_size=B)))
        kw["seqlens_k"] = tuple(draw(st.lists(length, min_size=B, max_size=B)))
    sq = max(1, draw(length))
    sk = max(1, draw(length))
    return Problem(B, H, sq, sk, heads_kv=hkv, block_m=bm, block_n=bn, **kw)


def _plan_or_skip(p, name, P, portable=False):
    try:
        return make_plan(p, name, P, portable=portable)
    except ValueError as e:
        assert "needs at least" in str(e)  # only a portable team larger than the grid is refused
        return None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.integers(1, 24), st.booleans())
def test_every_schedule_is_valid_and_deadlock_free(p, P, portable):
    """Coverage, turn permutations, compact form, deadlock freedom, order under random timing."""
    for name in SCHEDULE_NAMES:
        plan = _plan_or_skip(p, name, P, portable)
        if plan is None:
            continue
        rep = validate(plan, timing_trials=1)
        assert rep.ok, (name, P, rep.problems)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(1, 12), st.booleans(), st.sampled_from([1, 2, 3]))
def test_degenerate_grids_and_column_counts(N, M, P, causal, heads):
    """P smaller than the columns, P not dividing them, one column, M < concurrently running columns."""
    p = Problem(1, heads, M * 64, N * 128, causal=causal, block_m=64, block_n=128)
    for name in SCHEDULE_NAMES:
        plan = _plan_or_skip(p, name, P)
        if plan is None:
            continue
        res = simulate(plan, Costs(latency=0.05))
        assert res.deadlock_free, (name, N, M, P)
        assert res.lower_bound <= res.makespan + 1e-9


@pytest.mark.parametrize("N", [1, 2, 3, 7])
@pytest.mark.parametrize("P", [1, 2, 5, 132])
def test_one_and_few_columns(N, P):
    for causal in (False, True):
        p = Problem(1, 1, 3 * 128, N * 128, causal=causal, block_m=128, block_n=128)
        for name in SCHEDULE_NAMES:
            plan = _plan_or_skip(p, name, P)
            if plan is not None:
                assert validate(plan, timing_trials=1).ok, (name, N, P, causal)


def _random_problem(rng, max_len):
    B = int(rng.integers(1, 4))
    hkv = int(rng.integers(1, 3))
    H = hkv * int(rng.integers(1, 3))
    kw = {}
    mask = rng.integers(0, 3)
    if mask == 1:
        kw["causal"] = True
    elif mask == 2:
        kw["window"] = (int(rng.integers(-1, max_len // 2)), int(rng.integers(-1, max_len // 2)))
    if rng.random() < 0.3:
        kw["seqlens_q"] = tuple(int(v) for v in rng.integers(0, max_len, B))
        kw["seqlens_k"] = tuple(int(v) for v in rng.integers(0, max_len, B))
    return Problem(B, H, int(rng.integers(1, max_len)), int(rng.integers(1, max_len)), heads_kv=hkv,
                   block_m=int(rng.choice([64, 128])), block_n=int(rng.choice([64, 128, 192])), **kw)


@pytest.mark.parametrize("seed", range(4))
def test_seeded_sweep_of_moderate_shapes(seed):
    """A reproducible sweep of larger random shapes and grids than hypothesis tends to draw."""
    rng = np.random.default_rng(seed)
    for _ in range(8):
        p = _random_problem(rng, 1500)
        P = int(rng.integers(1, 140))
        for name in SCHEDULE_NAMES:
            for portable in (False, True):
                plan = _plan_or_skip(p, name, P, portable)
                if plan is not None:
                    assert validate(plan, timing_trials=1).ok, (p, name, P, portable)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4, 24))
def test_seeded_sweep_of_large_shapes(seed):
    rng = np.random.default_rng(seed)
    for _ in range(10):
        p = _random_problem(rng, 4000)
        P = int(rng.integers(1, 140))
        for name in SCHEDULE_NAMES:
            for portable in (False, True):
                plan = _plan_or_skip(p, name, P, portable)
                if plan is not None:
                    assert validate(plan, timing_trials=1).ok, (p, name, P, portable)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_len=2000), st.integers(1, 140), st.booleans())
def test_every_schedule_is_valid_on_larger_shapes(p, P, portable):
    for name in SCHEDULE_NAMES:
        plan = _plan_or_skip(p, name, P, portable)
        if plan is not None:
            assert validate(plan, timing_trials=1).ok, name


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.integers(1, 24),
       st.sampled_from([{"chains": 2}, {"chains": 3}, {"kv_chains": 2}, {"kv_chains": 3}, {"kv_chains": 8}]))
def test_accumulation_chains_stay_valid_and_never_slow_a_schedule_down(p, P, split):
    """The kernel's deterministic mode splits each dQ tile's adds into chains (turn t: add t //
    chains of chain t % chains) and, under GQA, a KV group's dK/dV adds (head j waits for head
    j - C, the group's last head for every chain). Every schedule stays deadlock-free with its
    adds in turn order within each chain under random timing, and the makespan never grows: a
    wait for turn t - chains (head j - C) is implied by the one-chain waits for t - 1, t - 2, ...
    (j - 1, j - 2, ...), every hop costing at least the hand-off latency."""
    costs = Costs(c=1.0, r=0.4, latency=0.3, epilogue=0.5, r_kv=0.7)
    for name in SCHEDULE_NAMES:
        plan = _plan_or_skip(p, name, P)
        if plan is None:
            continue
        rep = validate(plan, timing_trials=1, **split)
        assert rep.ok, (name, P, split, rep.problems)
        one, chained = simulate(plan, costs), simulate(plan, costs, **split)
        assert chained.makespan <= one.makespan + 1e-9, (name, P, split)
        assert chained.lower_bound <= chained.makespan + 1e-9
