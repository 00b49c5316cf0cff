"""GPU tests of the kernel's schedules (skipped without an sm_90 GPU).

Per schedule: gradients against the float64 reference (FA3's error rule), bitwise repeats,
bits equal across sm_margin (portable schedules), the traced accumulation order equal to the
model's, no deadlock on one CTA / fewer CTAs than columns / ragged and tiny shapes /
seqlen_q != seqlen_k, and GQA's in-kernel ordered dK/dV reduction.
Seeds: every failure message names its seed and DASH_TEST_SALT; rerun with that DASH_TEST_SALT set
to get the same inputs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from seeding import seed_of, seed_tag  # tests/seeding.py (conftest.py puts tests/ on sys.path)

from dash import reference
from dash.api import attention_backward
from dash.config import KERNEL_SCHEDULES, PORTABLE_KERNEL_SCHEDULES, bwd_tile_config
from dash.schedules.auto import kernel_dkv_chains, kernel_dkv_ordered, rank_kernel_schedules

pytestmark = pytest.mark.gpu

CAUSAL_SCHEDULES = [s for s in KERNEL_SCHEDULES if s != "shift"]


def _inputs(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, seed, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, seqlen_k, heads_k, head_dim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, seqlen_k, heads_k, head_dim, device="cuda", dtype=dtype, generator=gen)
    dout = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    return q, k, v, dout


def _forward(q, k, v, causal):
    out, lse = reference.attention_forward(q, k, v, causal=causal, compute_dtype=torch.float64)
    return out.to(q.dtype), lse.float()


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _check(q, k, v, dout, out, lse, causal, grads, label):
    hi = reference.attention_backward(dout, q, k, v, out, lse, causal=causal, compute_dtype=torch.float64)
    lo = reference.attention_backward(dout, q, k, v, out, lse, causal=causal, compute_dtype=q.dtype)
    cfg = bwd_tile_config(q.shape[-1], causal)
    # dq rows come in Q tiles (kBlockM), dk/dv rows in columns (kBlockN)
    for name, g, h, l, rows in zip(("dq", "dk", "dv"), grads, hi, lo, (cfg.block_m, cfg.block_n, cfg.block_n)):
        assert g.shape == h.shape and g.dtype == q.dtype, f"{label} {name}: {g.shape} {g.dtype}"
        reference.assert_within_bound(g, h, l, f"{label} {name}")
        # The global max is set by the largest entries; one tile's lost dQ partial, or a column that lost
        # a Q tile, stays under it at long causal shapes, but not under that tile's own bound.
        reference.assert_within_bound_blocks(g, h, l, f"{label} {name}", rows)


def _columns(batch, heads, seqlen_k, head_dim, causal):
    """Work items of the backward's persistent grid: KV tiles of every (batch, query head)."""
    return batch * heads * -(-seqlen_k // bwd_tile_config(head_dim, causal).block_n)


def _distinct_grids(batch, heads, seqlen_k, head_dim, causal, margins):
    """Assert that every sm_margin in ``margins`` (and 0) launches a grid of its own: the kernel
    launches min(columns, SMs - sm_margin) CTAs, so a shape with fewer columns than the grids
    runs the same grid under several margins and tests nothing about them."""
    sms = _sms()
    columns = _columns(batch, heads, seqlen_k, head_dim, causal)
    grids = [min(columns, sms - m) for m in (0, *margins)]
    assert len(set(grids)) == len(grids), f"sm_margin {(0, *margins)} launch the grids {grids} ({columns} columns)"
    return grids


def _schedules(causal):
    return CAUSAL_SCHEDULES if causal else list(KERNEL_SCHEDULES)


SHAPES = [(1, 1), (113, 203), (203, 113), (1000, 777), (777, 1000), (2048, 2048), (4224, 4224)]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", SHAPES)
def test_every_schedule_matches_reference(seqlens, causal, head_dim):
    sq, sk = seqlens
    batch, heads = (1, 2) if sq * sk > 4 * 10**6 else (2, 3)
    seed = seed_of("every", seqlens, causal, head_dim)
    q, k, v, dout = _inputs(batch, sq, sk, heads, heads, head_dim, seed)
    out, lse = _forward(q, k, v, causal)
    for schedule in _schedules(causal):  # shift only with the full mask
        for det in (True, False):
            if schedule == "shift":
                cfg = bwd_tile_config(head_dim, False)
                lanes, q_tiles = min(-(-sk // cfg.block_n), _sms()), -(-sq // cfg.block_m)
                if lanes > q_tiles:  # dash.validation refuses it before the op
                    match = re.escape(f"schedule='shift' needs at most as many concurrently running columns of a "
                                      f"head ({lanes}) as Q tiles ({q_tiles})")
                    with pytest.raises(NotImplementedError, match=match):
                        attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det, schedule=schedule)
                    continue
            grads = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det, schedule=schedule)
            _check(q, k, v, dout, out, lse, causal, grads,
                   f"{schedule} det={det} {seqlens} causal={causal} d={head_dim} {seed_tag(seed)}")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqlens", [(1000, 100), (129, 64), (200, 333), (640, 64)])
def test_deterministic_dq_reads_only_chains_that_were_written(seqlens, head_dim, monkeypatch):
    """A deterministic run stores the first add of each dQ accumulation chain instead of
    zeroing the workspace; a tile with fewer contributions than chains (one column; rows that
    see no key under a causal mask with seqlen_q > seqlen_k) must not read the chain nobody
    wrote. The dQ workspace is NaN-filled before each launch (DASH_POISON_OUTPUTS), and the
    caching allocator too, so such a read would surface."""
    monkeypatch.setenv("DASH_POISON_OUTPUTS", "1")
    sq, sk = seqlens
    seed = seed_of("chains", seqlens, head_dim)
    q, k, v, dout = _inputs(2, sq, sk, 3, 3, head_dim, seed)
    for causal in (False, True):
        out, lse = _forward(q, k, v, causal)
        for schedule in _schedules(causal):
            cfg = bwd_tile_config(head_dim, causal)
            if schedule == "shift" and min(-(-sk // cfg.block_n), _sms()) > -(-sq // cfg.block_m):
                continue  # shift refuses this shape (test_every_schedule_matches_reference)
            junk = torch.full((64 << 20,), float("nan"), device="cuda")  # 256 MiB back to the cache
            del junk
            grads = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, schedule=schedule)
            _check(q, k, v, dout, out, lse, causal, grads,
                   f"{schedule} {seqlens} causal={causal} d={head_dim} (NaN-filled cache) {seed_tag(seed)}")


def _repeat_bitwise(q, k, v, dout, out, lse, causal, schedule, repeats, label, sm_margin=0):
    ref = [t.clone() for t in attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True,
                                                 schedule=schedule, sm_margin=sm_margin)]
    for i in range(repeats):
        got = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, schedule=schedule,
                                 sm_margin=sm_margin)
        for name, g, r in zip(("dq", "dk", "dv"), got, ref):
            assert torch.equal(g, r), f"{schedule} {label}: repeat {i}: {name} differs bitwise"
    return ref


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_every_schedule_bitwise_100_repeats(head_dim, causal):
    seed = seed_of("repeat100", head_dim, causal)
    q, k, v, dout = _inputs(2, 2048, 2048, 4, 4, head_dim, seed)
    out, lse = _forward(q, k, v, causal)
    for schedule in _schedules(causal):
        _repeat_bitwise(q, k, v, dout, out, lse, causal, schedule, 100, f"d={head_dim} causal={causal} {seed_tag(seed)}")


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_every_schedule_bitwise_1000_repeats(head_dim, causal):
    seed = seed_of("repeat1000", head_dim, causal)
    q, k, v, dout = _inputs(2, 4096, 4096, 4, 4, head_dim, seed)
    out, lse = _forward(q, k, v, causal)
    for schedule in _schedules(causal):
        _repeat_bitwise(q, k, v, dout, out, lse, causal, schedule, 1000, f"d={head_dim} causal={causal} {seed_tag(seed)}")


#: (batch, seqlen, heads, heads_kv) per (head dim, causal) on which the model, were auto free to rank
#: for the launched grid, would pick different schedules on 132, 131, 114 and 78 CTAs; and the shape
#: of test_auto_bits_do_not_depend_on_the_grid_where_the_model_would_choose_differently (hdim 128,
#: causal). tests/test_gpu_test_policy.py checks both on the CPU, so that a model change that takes
#: away the per-grid choice fails in CI rather than on the GPU.
#: Re-found when auto began to replay claims in simulated time (the static dispatch's shapes
#: no longer split): the causal ones above 1024 keys, so that auto ranks them at all
#: (SHORT_CAUSAL_FA3_MAX_SEQLEN).
AUTO_PER_GRID_SHAPES = {(64, False): (2, 640, 16, 2), (128, False): (3, 512, 16, 2),
                        (64, True): (1, 1152, 16, 2), (128, True): (2, 1536, 16, 2)}
AUTO_GRID_SHAPE = (2, 1280, 16, 2)


def _portable_margins(sms):
    """sm_margins standing in for other Hopper parts (H100 PCIe 114, H20 78 SMs), 99, 7 and 1 CTAs."""
    return [m for m in sorted({1, sms - 114, sms - 78, 33, sms - 7, sms - 1}) if 0 < m < sms]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_portable_schedules_give_the_same_bits_for_any_cta_count(head_dim, causal):
    """sm_margin 0 ... SMs-1 stands in for other Hopper parts: every schedule auto may pick
    gives identical bits on every grid, one CTA included. The kernel launches
    min(columns, SMs - sm_margin) CTAs: 2 x 8 heads x 16 columns = 256 columns, more than any
    grid here, so each margin launches a grid of its own (132, 131, 114, 99, 78, 7, 1 CTAs on
    132 SMs). auto is checked on a shape of its own, where the model would pick per grid."""
    batch, seqlen, heads = 2, 2048, 8
    seed = seed_of("portable", head_dim, causal)
    q, k, v, dout = _inputs(batch, seqlen, seqlen, heads, heads, head_dim, seed)
    out, lse = _forward(q, k, v, causal)
    sms = _sms()
    margins = _portable_margins(sms)
    _distinct_grids(batch, heads, seqlen, head_dim, causal, margins)
    for schedule in PORTABLE_KERNEL_SCHEDULES:
        base = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, schedule=schedule)
        for margin in margins:
            got = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, schedule=schedule,
                                     sm_margin=margin)
            for name, a, b in zip(("dq", "dk", "dv"), base, got):
                assert torch.equal(a, b), (f"{schedule} d={head_dim} causal={causal} {seed_tag(seed)}: sm_margin={margin} "
                                           f"({sms - margin} CTAs) changed {name}")
    # GQA 16/2, shapes where the model, were it free to rank for the launched grid (132, 131, 114,
    # 78 CTAs), picks differently on some of them (AUTO_PER_GRID_SHAPES; tests/test_gpu_test_policy.py
    # checks that on the CPU). Causal rows are longer than 1024 tokens: auto takes fa3 there
    # without the model.
    seed = seed_of("portable-auto", head_dim, causal)
    batch, seqlen, heads, heads_kv = AUTO_PER_GRID_SHAPES[(head_dim, causal)]
    q, k, v, dout = _inputs(batch, seqlen, seqlen, heads, heads_kv, head_dim, seed)
    out, lse = _forward(q, k, v, causal)
    _assert_auto_bits_do_not_depend_on_the_grid(q, k, v, dout, out, lse, causal, seed_tag(seed))


def _assert_auto_bits_do_not_depend_on_the_grid(q, k, v, dout, out, lse, causal, label):
    """auto gives the same bits on the full grid and with sm_margin 1, SMs-114, SMs-78, on a
    shape where each margin launches its own grid and where the model, were it free to rank for
    the launched grid (rank_kernel_schedules(..., ctas)), would pick different schedules on some
    of them (checked first, on the CPU: otherwise the test could not see a per-grid choice)."""
    sms = _sms()
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    margins = [m for m in sorted({1, sms - 114, sms - 78}) if 0 < m < sms]
    grids = _distinct_grids(batch, heads, seqlen_k, head_dim, causal, margins)
    firsts = {g: rank_kernel_schedules(batch, heads, heads_k, seqlen_q, seqlen_k, head_dim, causal, g)[0][0]
              for g in grids}
    assert len(set(firsts.values())) > 1, (
        f"the model picks {firsts} (CTAs: schedule) for {tuple(q.shape)} / {heads_k} KV heads causal={causal}: "
        "the same on every grid, so this shape cannot show auto choosing per grid; pick another")
    base = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, schedule="auto")
    for margin in margins:
        got = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, schedule="auto",
                                 sm_margin=margin)
        for name, a, b in zip(("dq", "dk", "dv"), base, got):
            assert torch.equal(a, b), f"auto {label}: sm_margin={margin} ({sms - margin} CTAs) changed {name}"


def test_auto_bits_do_not_depend_on_the_grid_where_the_model_would_choose_differently():
    """Each portable schedule's bits are grid-independent, but two schedules' bits differ, so
    auto must choose by the shape alone (AUTO_REFERENCE_CTAS). On this shape (GQA 16/2, hdim
    128, causal 2 x 1280: 320 columns) the model, with the dQ convert's overlap priced (0c4c33b)
    and the kernel's dK/dV chains, ranks descending first on 132 CTAs and fa3 first on 131, 114
    and 78."""
    seed = seed_of("auto-grid")
    batch, seqlen, heads, heads_kv = AUTO_GRID_SHAPE
    q, k, v, dout = _inputs(batch, seqlen, seqlen, heads, heads_kv, 128, seed)
    out, lse = _forward(q, k, v, True)
    _assert_auto_bits_do_not_depend_on_the_grid(q, k, v, dout, out, lse, True, seed_tag(seed))


def test_shift_is_correct_and_repeatable_on_every_grid_it_is_planned_for():
    """shift's turns are planned for the launched grid (not portable): each grid gives its
    own bits, correct and repeatable, one CTA included."""
    seed = seed_of("shift-grids")
    q, k, v, dout = _inputs(2, 2048, 1024, 3, 3, 64, seed)
    out, lse = _forward(q, k, v, False)
    for margin in (0, 100, _sms() - 1):
        label = f"sm_margin={margin} {seed_tag(seed)}"
        grads = _repeat_bitwise(q, k, v, dout, out, lse, False, "shift", 10, label, sm_margin=margin)
        _check(q, k, v, dout, out, lse, False, grads, f"shift {label}")


def _traced(schedule, causal, det, sq=1024, sk=1024, heads=3, batch=2, head_dim=64, sm_margin=0):
    from dash.trace import trace_backward

    seed = seed_of("traced", schedule, causal, det, sq, sk, sm_margin)
    q, k, v, dout = _inputs(batch, sq, sk, heads, heads, head_dim, seed)
    out, lse = _forward(q, k, v, causal)
    dq, dk, dv, tr = trace_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det, schedule=schedule,
                                    sm_margin=sm_margin)
    ref = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det, schedule=schedule,
                             sm_margin=sm_margin)
    if det:  # tracing must not change the result
        assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), ref)), f"{schedule}: tracing changed the bits"
    return tr


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("det", [True, False])
def test_trace_order_equals_the_model(causal, det):
    for schedule in _schedules(causal):
        for margin, sq, sk in ((0, 1024, 1024), (_sms() - 5, 1000, 777), (0, 777, 1280)):
            if schedule == "shift" and -(-sk // 128) > -(-sq // 128):
                continue
            tr = _traced(schedule, causal, det, sq=sq, sk=sk, sm_margin=margin)
            problems = tr.check_against_model()
            assert not problems, f"{schedule} causal={causal} det={det} margin={margin}: {problems}"
            assert 0.0 <= tr.wait_fraction() < 1.0


@pytest.mark.parametrize("det", [True, False])
def test_trace_order_equals_the_model_hdim128_full(det):
    """hdim 128 full mask: 80-row Q tiles (the config table), ragged in both sequence lengths."""
    for schedule in _schedules(False):
        for margin, sq, sk in ((0, 1000, 777), (_sms() - 5, 1040, 1024)):
            tr = _traced(schedule, False, det, sq=sq, sk=sk, head_dim=128, sm_margin=margin)
            problems = tr.check_against_model()
            assert not problems, f"{schedule} hdim 128 det={det} margin={margin}: {problems}"


_DEADLOCK_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from dash.api import attention_backward
    from dash.config import bwd_tile_config
    cases = json.loads(sys.argv[1])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for sq, sk, b, h, hk, d, causal, sched, ctas in cases:
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        out = torch.randn_like(q); dout = torch.randn_like(q)
        lse = torch.randn(b, h, sq, device="cuda", dtype=torch.float32).abs() + 5
        # shift (full mask only) refuses more running columns of a head than Q tiles (the
        # config table's tiles): a clear refusal is not a hang
        cfg = bwd_tile_config(d, causal)
        lanes, q_tiles = min(-(-sk // cfg.block_n), ctas), -(-sq // cfg.block_m)
        refused = sched == "shift" and lanes > q_tiles
        try:
            attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, schedule=sched,
                               sm_margin=sms - ctas)
        except NotImplementedError as e:
            if not refused or "concurrently running columns" not in str(e):
                raise
        else:
            assert not refused, ("shift ran where it should be refused", sq, sk, d, ctas)
        torch.cuda.synchronize()
    print("ALL DONE", len(cases))
""")


def test_no_deadlock_on_small_grids_and_awkward_shapes():
    """One CTA, CTA counts below the column count, ragged tails, tiny problems, seqlen_q !=
    seqlen_k both ways, GQA: every deterministic schedule finishes. Runs in a subprocess with
    a timeout, so a hang fails the test instead of stalling the suite."""
    cases = []
    for sched in KERNEL_SCHEDULES:
        for causal in (False, True):
            if sched == "shift" and causal:
                continue
            for ctas in (1, 2, 3, 7, 64):
                for sq, sk, b, h, hk, d in ((1, 1, 1, 1, 1, 64), (129, 257, 1, 2, 1, 128), (1000, 333, 2, 3, 3, 64),
                                            (333, 1000, 2, 3, 3, 128), (2048, 2048, 1, 8, 2, 64)):
                    cases.append((sq, sk, b, h, hk, d, causal, sched, ctas))
    proc = subprocess.run([sys.executable, "-c", _DEADLOCK_SCRIPT, json.dumps(cases)], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0 and "ALL DONE" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("heads, heads_k", [(8, 1), (32, 8), (6, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_in_kernel_reduction_accuracy_and_bits(heads, heads_k, causal):
    """The query heads of a KV group reduce-add their dK/dV in the kernel (fp32, fixed order):
    accurate against the reference and bitwise repeatable for every portable schedule."""
    seed = seed_of("gqa", heads, heads_k, causal)
    q, k, v, dout = _inputs(1, 640, 1024, heads, heads_k, 128, seed)
    out, lse = _forward(q, k, v, causal)
    for schedule in PORTABLE_KERNEL_SCHEDULES:
        label = f"GQA {heads}/{heads_k} causal={causal} {seed_tag(seed)}"
        grads = _repeat_bitwise(q, k, v, dout, out, lse, causal, schedule, 20, label)
        _check(q, k, v, dout, out, lse, causal, grads, f"{label} {schedule}")
        # And the bits do not depend on the grid.
        got = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, schedule=schedule,
                                 sm_margin=_sms() - 3)
        assert all(torch.equal(a, b) for a, b in zip(grads, got)), f"{label} {schedule}: bits depend on the grid"


@pytest.mark.parametrize("heads, heads_k", [(6, 2), (8, 2), (8, 1)], ids=["g3_chains", "g4_chains", "g8_adds"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_nondeterministic_sums(head_dim, causal, heads, heads_k):
    """Without determinism, groups of at most nondet_dkv_chains_max_group query heads sum dK/dV
    in the ordered chains (G 3: two chains of one add each; G 4: a head waits for the head two
    before it), larger ones add into a zeroed accumulator that the binding casts: accurate for
    every schedule (shift included: its own kernel), on the full grid and on grids of 1 and 3
    CTAs (heads arrive in other orders, waits on columns not yet run), with uneven column tails
    (seqlen_k 777 is a multiple of no tile)."""
    group = heads // heads_k
    assert kernel_dkv_ordered(head_dim, causal, group, deterministic=False) == (group <= 4)
    seed = seed_of("gqa-nondet", head_dim, causal, heads, heads_k)
    q, k, v, dout = _inputs(2, 1025, 777, heads, heads_k, head_dim, seed)
    out, lse = _forward(q, k, v, causal)
    for schedule in _schedules(causal):
        for sm_margin in (0, _sms() - 3, _sms() - 1):
            label = f"GQA {heads}/{heads_k} nondet d={head_dim} causal={causal} {schedule} sm_margin={sm_margin} {seed_tag(seed)}"
            grads = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=False,
                                       schedule=schedule, sm_margin=sm_margin)
            _check(q, k, v, dout, out, lse, causal, grads, label)


def test_gqa_has_no_per_head_dk_dv_copies():
    """Peak memory of a GQA 32/8 backward: the outputs, the fp32 dQ workspaces (one per
    accumulation chain of the deterministic mode, config.py dq_chains) and the fp32 group
    accumulators of dK/dV (one per dK/dV chain, config.py dkv_chains, fewer than the group's
    query heads), and nothing per query head (per-head bf16 dK/dV copies, what DASH used to
    keep, would add 2 x 32 heads x 4096 x 128 x 2 B = 64 MiB)."""
    q, k, v, dout = _inputs(1, 4096, 4096, 32, 8, 128, seed_of("gqa-memory"))
    out, lse = _forward(q, k, v, True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    outputs = (q.numel() + 2 * k.numel()) * 2          # dq, dk, dv (bf16)
    chains = bwd_tile_config(128, True).dq_chains
    dq_workspace = chains * q.numel() * 4 + 2 * q.numel() // 128 * 4  # dQaccum chains + LSE/D rows (fp32)
    dkv_chains = kernel_dkv_chains(128, True, 32 // 8)
    assert dkv_chains < 32 // 8
    group_accumulators = 2 * dkv_chains * k.numel() * 4  # dK, dV (fp32, per KV head and chain)
    needed = outputs + dq_workspace + group_accumulators
    per_head_copies = 2 * q.numel() * 2
    assert extra < needed + per_head_copies // 4, (
        f"backward used {extra / 2**20:.0f} MiB extra; outputs and workspaces need {needed / 2**20:.0f} MiB")
