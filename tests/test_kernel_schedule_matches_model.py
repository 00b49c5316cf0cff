"""The kernel's schedules (csrc/schedule/schedule.h, compiled here for the host) must follow
the scheduling model (dash.schedules, the specification) exactly: item order, Q-tile visit
order and every turn, for every schedule the kernel implements. CPU-only; needs a C++
compiler."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dash.config import KERNEL_SCHEDULES
from dash.schedules import Problem, make_plan
from dash.schedules.orders import l2_section_heads

ROOT = Path(__file__).resolve().parents[1]

#: BwdScheduleKind in csrc/schedule/schedule.h, numbered in the order of dash.config's table:
#: a mismatch makes every comparison below fail.
KERNEL_KINDS = {name: i for i, name in enumerate(KERNEL_SCHEDULES)}


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    lib = tmp_path_factory.mktemp("probe") / "schedule_probe.so"
    subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-I", str(ROOT / "csrc"),
                    str(ROOT / "tests" / "cpp" / "schedule_probe.cpp"), "-o", str(lib)], check=True)
    return ctypes.CDLL(str(lib))


def _ptr(a):
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_int))


def _kernel(probe, name, p: Problem, ctas: int, det: bool = True):
    bm, bn = p.tile_shape
    N, M = -(-p.seqlen_k // bn), -(-p.seqlen_q // bm)
    K = N * p.heads_q * p.batch
    cols = np.zeros(3 * K, dtype=np.int32)
    steps = np.zeros(K, dtype=np.int32)
    visit = np.zeros(K * M, dtype=np.int32)
    turns = np.zeros(K * M, dtype=np.int32)
    stride = -(-K // ctas)
    items = np.full(ctas * stride, -1, dtype=np.int32)
    count = probe.dash_schedule_probe(KERNEL_KINDS[name], p.seqlen_q, p.seqlen_k, bm, bn, int(p.causal), p.head_dim,
                                      p.heads_q, p.heads_kv, p.batch, int(det), ctas, _ptr(cols), _ptr(steps), _ptr(visit),
                                      _ptr(turns), _ptr(items), stride)
    return count, cols.reshape(-1, 3), steps, visit.reshape(K, M), turns.reshape(K, M), items.reshape(ctas, stride)


def _check(probe, name, p: Problem, ctas: int):
    plan = make_plan(p, name, ctas)
    count, cols, steps, visit, turns, items = _kernel(probe, name, p, ctas)
    seq = plan.item_sequence()
    assert count == len(seq)
    # Item order: the kernel's column(L) is the model's L-th item as (n, h, b).
    assert np.array_equal(cols[:, [2, 1, 0]], seq), name
    for L, (b, h, n) in enumerate(seq):
        want = plan.visit(b, h, n)
        assert steps[L] == len(want), (name, b, h, n)
        assert list(visit[L, : steps[L]]) == list(want), (name, b, h, n)
        assert list(turns[L, : steps[L]]) == list(plan.turn[b, h, want, n]), (name, b, h, n)
    if not plan.recipe.dispatch == "claim":
        # Static dispatch: CTA x runs exactly the model's work list, in order.
        for x in range(ctas):
            got = [tuple(seq[L][[0, 1, 2]]) for L in items[x] if L >= 0]
            assert got == plan.work_list(x), (name, x)


SHAPES = [(1, 1), (239, 1), (113, 203), (1023, 1024), (4224, 4224), (1000, 777), (128, 4096), (4096, 128)]


@pytest.mark.parametrize("name", ["fa3", "interleaved", "descending"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk", SHAPES)
@pytest.mark.parametrize("hdim", [64, 128])
def test_claimed_kernel_schedules_equal_the_model(probe, name, sq, sk, hdim, causal):
    _check(probe, name, Problem(2, 3, sq, sk, head_dim=hdim, causal=causal), 7)


@pytest.mark.parametrize("name", ["fa3", "interleaved", "descending"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads, heads_kv", [(4, 2), (6, 2), (8, 1), (32, 8)])
@pytest.mark.parametrize("sq, sk", [(239, 1), (1000, 777), (1023, 1024), (128, 4096)])
def test_claimed_kernel_schedules_equal_the_model_gqa(probe, name, sq, sk, causal, heads, heads_kv):
    """GQA: the kernel spreads the query heads of a KV group over the claim order exactly as
    the model does (``head_slots``)."""
    _check(probe, name, Problem(2, heads, sq, sk, head_dim=128, heads_kv=heads_kv, causal=causal), 7)


@pytest.mark.parametrize("name", ["fa3", "interleaved", "descending"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads, heads_kv", [(4, 2), (6, 2), (8, 2), (32, 8)])
@pytest.mark.parametrize("sq, sk", [(239, 1), (1000, 777), (128, 4096), (4224, 4224)])
def test_non_deterministic_claims_keep_gqa_siblings_in_query_head_order(probe, name, sq, sk, causal, heads,
                                                                         heads_kv):
    """Non-deterministic GQA with small groups sums dK/dV in the ordered chains too
    (config.py nondet_dkv_chains_max_group), whose waits point to the same column of the
    previous query head of the group: the kernel's non-deterministic claim order (longest
    columns first, other turns) must still claim that column earlier, or a grid smaller than
    the work could deadlock."""
    p = Problem(2, heads, sq, sk, head_dim=128, heads_kv=heads_kv, causal=causal)
    count, cols, *_ = _kernel(probe, name, p, 7, det=False)
    pos = {(int(b), int(h), int(n)): L for L, (n, h, b) in enumerate(cols[:count])}
    assert len(pos) == count == cols.shape[0]
    g = heads // heads_kv
    for (b, h, n), L in pos.items():
        if h % g:
            assert pos[(b, h - 1, n)] < L, (name, b, h, n)


@pytest.mark.parametrize("sq, sk", [(s, k) for s, k in SHAPES if -(-s // 64) >= min(-(-k // 128), 7)])
@pytest.mark.parametrize("ctas", [1, 3, 7, 132])
@pytest.mark.parametrize("hdim", [64, 128])
def test_shift_kernel_schedule_equals_the_model(probe, sq, sk, hdim, ctas):
    p = Problem(2, 3, sq, sk, head_dim=hdim)
    bm, bn = p.tile_shape
    if -(-sq // bm) < min(-(-sk // bn), ctas):
        pytest.skip("shift needs min(N, ctas) <= M")
    _check(probe, "shift", p, ctas)


@settings(max_examples=60, deadline=None)
@given(sq=st.integers(1, 3000), sk=st.integers(1, 3000), causal=st.booleans(), hdim=st.sampled_from([64, 128]),
       name=st.sampled_from(["fa3", "interleaved", "descending"]), heads_kv=st.integers(1, 4), group=st.integers(1, 4),
       batch=st.integers(1, 3))
def test_claimed_kernel_schedules_equal_the_model_random_shapes(probe, sq, sk, causal, hdim, name, heads_kv, group,
                                                                batch):
    p = Problem(batch, heads_kv * group, sq, sk, head_dim=hdim, heads_kv=heads_kv, causal=causal)
    _check(probe, name, p, 5)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12), m_extra=st.integers(0, 6), heads=st.integers(1, 4), batch=st.integers(1, 3),
       ctas=st.integers(1, 40))
def test_shift_kernel_schedule_equals_the_model_random_grids(probe, n, m_extra, heads, batch, ctas):
    p = Problem(batch, heads, (min(n, ctas) + m_extra) * 128, n * 128, head_dim=64)
    _check(probe, "shift", p, ctas)


@pytest.mark.parametrize("sq, hdim, bh", [(512, 64, 1024), (2048, 64, 256), (8192, 128, 32), (16384, 128, 16),
                                          (1, 64, 1), (100000, 128, 3), (4096, 64, 5)])
@pytest.mark.parametrize("full_mask_q_tiles", [0, 1, 4, 7, 13, 26, 264, 265, 1250])
def test_l2_sections_equal_the_model(probe, sq, hdim, bh, full_mask_q_tiles):
    assert probe.dash_l2_section_heads(sq, hdim, bh, full_mask_q_tiles) == \
        l2_section_heads(sq, hdim, bh, full_mask_q_tiles)


@pytest.mark.parametrize("q_tiles, want", [(4, 64), (7, 32), (8, 32), (13, 16), (26, 8), (132, 2), (264, 1), (1000, 1)])
def test_full_mask_sections_stagger_a_heads_columns_by_about_two_steps(q_tiles, want):
    """Under a full mask the width is the largest power of two <= 264 / M (two steps of claims
    on 132 CTAs), whatever the L2 budget would allow (0.25 MiB per head here: 128 heads)."""
    assert l2_section_heads(512, 64, 4096, q_tiles) == want
    assert l2_section_heads(512, 64, 4096, 0) == 128  # causal: the budget alone


@settings(max_examples=80, deadline=None)
@given(sq=st.integers(1, 700), sk=st.integers(1, 700), causal=st.booleans(), tiles=st.sampled_from([(64, 128), (128, 128)]))
def test_kernel_masks_exactly_the_tiles_with_masked_pairs(probe, sq, sk, causal, tiles):
    """needs_mask(m, n) is true iff the tile holds a (query, key) pair the mask hides
    (keys past seqlen_k, or right of the bottom-right diagonal), computed by brute force."""
    bm, bn = tiles
    i = np.arange(-(-sq // bm) * bm)[:, None]
    j = np.arange(-(-sk // bn) * bn)[None, :]
    hidden = (j >= sk) | ((j > i + sk - sq) if causal else np.zeros_like(i, dtype=bool))
    for m in range(-(-sq // bm)):
        for n in range(-(-sk // bn)):
            want = bool(hidden[m * bm:(m + 1) * bm, n * bn:(n + 1) * bn].any())
            assert probe.dash_needs_mask(sq, sk, bm, bn, int(causal), m, n) == int(want), (m, n)


def _fwd_tile_order_model():
    """tools/fwd_tile_order_model.py (a tool, not part of the package), loaded by path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fwd_tile_order_model", ROOT / "tools" / "fwd_tile_order_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@settings(max_examples=200, deadline=None)
@given(num_m=st.integers(1, 90), num_bh=st.integers(1, 70), log_sw=st.integers(0, 7))
def test_forward_tile_order_is_the_models_and_claims_every_tile_once(probe, num_m, num_bh, log_sw):
    """FwdTileOrder::tile (the kernel's claim order) against tools/fwd_tile_order_model.py's
    tile_order: every Q tile exactly once, L2 sections in order, the longest tiles of a section first."""
    sw = min(1 << log_sw, num_bh)
    n = num_m * num_bh
    bh, m = np.zeros(n, dtype=np.int32), np.zeros(n, dtype=np.int32)
    assert probe.dash_fwd_tile_order(num_m, num_bh, sw, _ptr(bh), _ptr(m)) == n
    got = list(zip(bh.tolist(), m.tolist()))
    assert sorted(got) == [(h, q) for h in range(num_bh) for q in range(num_m)]
    assert got == _fwd_tile_order_model().tile_order(num_bh, num_m, sw)


@pytest.mark.parametrize("seqlen_k", [512, 1000, 4096, 16384])
@pytest.mark.parametrize("hdim", [64, 128])
@pytest.mark.parametrize("group", [1, 4])
def test_forward_l2_sections_fit_the_budget(probe, seqlen_k, hdim, group):
    """fwd_section_heads: the largest power of two of heads whose K/V (shared by a GQA group)
    fit the budget, at most the heads there are, at least one."""
    probe.dash_fwd_section_heads.argtypes = [ctypes.c_longlong] + [ctypes.c_int] * 5
    for budget_mib in (1, 12, 32):
        for num_bh in (1, 3, 16, 256):
            w = probe.dash_fwd_section_heads(budget_mib << 20, seqlen_k, hdim, 2, group, num_bh)
            per_head = -(-2 * seqlen_k * hdim * 2 // group)
            assert w >= 1 and w & (w - 1) == 0 and w <= max(num_bh, 1)
            if w > 1:
                assert w * per_head <= budget_mib << 20
            assert 2 * w > num_bh or 2 * w * per_head > budget_mib << 20


def _varlen_order(probe, num_m, num_heads, seqlens_k, keys):
    n = num_m * num_heads * len(seqlens_k)
    bh, m = np.zeros(n, dtype=np.int32), np.zeros(n, dtype=np.int32)
    sk = np.array(seqlens_k, dtype=np.int32)
    assert probe.dash_fwd_varlen_tile_order(num_m, num_heads, len(seqlens_k), keys, _ptr(sk), _ptr(bh), _ptr(m)) == n
    return list(zip(bh.tolist(), m.tolist()))


@settings(max_examples=200, deadline=None)
@given(num_m=st.integers(1, 40), num_heads=st.integers(1, 12), seqlens_k=st.lists(st.integers(0, 5000), min_size=1,
       max_size=6), keys=st.integers(0, 40000))
def test_forward_varlen_tile_order_is_the_models_and_claims_every_tile_once(probe, num_m, num_heads, seqlens_k, keys):
    """FwdTileOrder::tile_in_sequence (the varlen claim order) against tools/fwd_tile_order_model.py's
    varlen_tile_order: every Q tile of the padded grid exactly once, sequence by sequence, each
    sequence's sections sized for its own keys (a power of two of heads, at most the heads)."""
    got = _varlen_order(probe, num_m, num_heads, seqlens_k, keys)
    model = _fwd_tile_order_model()
    num_bh = num_heads * len(seqlens_k)
    assert sorted(got) == [(h, q) for h in range(num_bh) for q in range(num_m)]
    assert got == model.varlen_tile_order(num_heads, num_m, seqlens_k, keys)
    per_seq = num_heads * num_m
    for b, sk in enumerate(seqlens_k):
        assert all(bh // num_heads == b for bh, _ in got[b * per_seq:(b + 1) * per_seq])
        w = model.sequence_section_heads(sk, num_heads, keys)
        assert w & (w - 1) == 0 and 1 <= w <= num_heads
        assert w == 1 or w * sk <= keys
        assert 2 * w > num_heads or 2 * w * sk > keys


def test_forward_varlen_section_keys_match_the_byte_rule(probe):
    """fwd_section_keys: the keys of one query head whose K and V fit the budget (a GQA group
    shares them), so that a sequence's section width is fwd_section_heads'."""
    probe.dash_fwd_section_keys.argtypes = [ctypes.c_longlong] + [ctypes.c_int] * 3
    model = _fwd_tile_order_model()
    for budget_mib in (1, 12, 32):
        for hdim in (64, 128):
            for group in (1, 4):
                keys = probe.dash_fwd_section_keys(budget_mib << 20, hdim, 2, group)
                assert keys == model.section_keys(budget_mib << 20, hdim, 2, group)
                for sk in (100, 1000, 4096, 8192, 16384):
                    # 2 * hdim * 2 bytes per key is a multiple of the group here: no rounding apart
                    assert model.sequence_section_heads(sk, 64, keys) == \
                        model.section_heads(budget_mib << 20, sk, hdim, 64, heads_per_kv_head=group)


def _claim_varlen_items(probe, num_m, num_heads, seqlens_q_m, seqlens_k, keys, ctas, rng):
    """The varlen forward producer's walk (next_seq_tile in csrc/kernels/fwd_main_kernel.h) with
    `ctas` CTAs interleaved at random: CTA c starts at item c, a claim is ctas + atomicAdd(counter,
    1), a dead item raises the counter to its run's end - ctas (atomicMax) before the next claim.
    Returns the live items the CTAs kept, in the order they kept them."""
    order = _varlen_order(probe, num_m, num_heads, seqlens_k, keys)
    n = len(order)
    counter, kept = 0, []
    pos = list(range(ctas))  # each CTA's current item
    active = list(range(ctas))
    while active:
        c = active[rng.integers(len(active))]
        t = pos[c]
        if t >= n:
            active.remove(c)
            continue
        bh, m = order[t]
        b = bh // num_heads
        if m < seqlens_q_m[b]:
            kept.append(t)
        else:
            end = probe.dash_fwd_dead_run_end(num_m, num_heads, len(seqlens_k), keys, t, seqlens_k[b], seqlens_q_m[b])
            assert end > t
            assert all(order[u][1] >= seqlens_q_m[order[u][0] // num_heads] for u in range(t, min(end, n))), \
                f"item run [{t}, {end}) holds a live item"
            if end > t + 1:
                counter = max(counter, end - ctas)
        pos[c] = ctas + counter
        counter += 1
    return kept, order


@settings(max_examples=150, deadline=None)
@given(num_heads=st.integers(1, 8), seq_m=st.lists(st.integers(0, 24), min_size=1, max_size=6),
       seqlens_k=st.lists(st.integers(0, 3000), min_size=6, max_size=6), keys=st.integers(0, 20000),
       ctas=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_forward_varlen_dead_runs_hold_only_dead_items(probe, num_heads, seq_m, seqlens_k, keys, ctas, seed):
    """FwdTileOrder::dead_run_end_in_sequence: a run that a dead item starts holds dead items only
    (a live one skipped would leave its rows of O unwritten), and with CTAs claiming concurrently
    every live item is kept exactly once; the run reaches its section's first live item (or the
    section's end), so a short sequence's dead items go in one skip per section."""
    num_m = max(seq_m) if max(seq_m) > 0 else 1  # the grid is sized for the longest sequence
    seqlens_k = seqlens_k[:len(seq_m)]
    kept, order = _claim_varlen_items(probe, num_m, num_heads, seq_m, seqlens_k, keys, ctas,
                                      np.random.default_rng(seed))
    live = [t for t, (bh, m) in enumerate(order) if m < seq_m[bh // num_heads]]
    assert sorted(kept) == live
    model = _fwd_tile_order_model()
    for t, (bh, m) in enumerate(order):
        b = bh // num_heads
        if m < seq_m[b]:
            continue
        w = model.sequence_section_heads(seqlens_k[b], num_heads, keys)
        first_h = (bh - b * num_heads) // w * w
        section_end = (b * num_heads + min(num_heads, first_h + w)) * num_m
        end = probe.dash_fwd_dead_run_end(num_m, num_heads, len(seq_m), keys, t, seqlens_k[b], seq_m[b])
        assert end == _first_live_or_section_end(order, seq_m, num_heads, t, section_end)


def _first_live_or_section_end(order, seq_m, num_heads, t, section_end):
    """The first item after t that is live, or the end of t's section (the run's end)."""
    u = t + 1
    while u < min(len(order), section_end) and order[u][1] >= seq_m[order[u][0] // num_heads]:
        u += 1
    return u
