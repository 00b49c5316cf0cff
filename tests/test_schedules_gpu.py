"""GPU tests of the kernel's schedules (skipped without an sm_90 GPU).

Per schedule: gradients against the float64 reference (FA3's error rule), bitwise repeats,
bits equal across sm_margin (portable schedules), the traced accumulation order equal to the
model's, no deadlock on one CTA / fewer CTAs than columns / ragged and tiny shapes /
seqlen_q != seqlen_k, and GQA's in-kernel ordered dK/dV reduction.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dash import reference
from dash.api import attention_backward
from dash.config import KERNEL_SCHEDULES, PORTABLE_KERNEL_SCHEDULES, bwd_tile_config

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


def _seed() -> int:
    return int.from_bytes(os.urandom(3), "little")


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _check(q, k, v, dout, out, lse, causal, grads, label):
    hi = reference.attention_backward(dout, q, k, v, out, lse, causal=causal, compute_dtype=torch.float64)
    lo = reference.attention_backward(dout, q, k, v, out, lse, causal=causal, compute_dtype=q.dtype)
    for name, g, h, l in zip(("dq", "dk", "dv"), grads, hi, lo):
        assert g.shape == h.shape and g.dtype == q.dtype, f"{label} {name}: {g.shape} {g.dtype}"
        reference.assert_within_bound(g, h, l, f"{label} {name}")


def _schedules(causal):
    return CAUSAL_SCHEDULES if causal else list(KERNEL_SCHEDULES)


SHAPES = [(1, 1), (113, 203), (203, 113), (1000, 777), (777, 1000), (2048, 2048), (4224, 4224)]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", SHAPES)
def test_every_schedule_matches_reference(seqlens, causal, head_dim):
    sq, sk = seqlens
    batch, heads = (1, 2) if sq * sk > 4 * 10**6 else (2, 3)
    q, k, v, dout = _inputs(batch, sq, sk, heads, heads, head_dim, _seed())
    out, lse = _forward(q, k, v, causal)
    for schedule in _schedules(causal):
        for det in (True, False):
            if schedule == "shift":
                bm, bn = (128, 128) if head_dim == 64 else (64, 128)
                if min(-(-sk // bn), _sms()) > -(-sq // bm):
                    with pytest.raises(Exception, match="shift"):
                        attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det, schedule=schedule)
                    continue
            grads = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det, schedule=schedule)
            _check(q, k, v, dout, out, lse, causal, grads, f"{schedule} det={det} {seqlens} causal={causal}")



@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqlens", [(1000, 100), (129, 64), (200, 333), (640, 64)])
def test_deterministic_dq_reads_only_chains_that_were_written(seqlens, head_dim):
    """A deterministic run stores the first add of each dQ accumulation chain instead of
    zeroing the workspace; a tile with fewer contributions than chains (one column; rows that
    see no key under a causal mask with seqlen_q > seqlen_k) must not read the chain nobody
    wrote. The caching allocator is first filled with NaN, so such a read would surface."""
    sq, sk = seqlens
    q, k, v, dout = _inputs(2, sq, sk, 3, 3, head_dim, _seed())
    for causal in (False, True):
        out, lse = _forward(q, k, v, causal)
        for schedule in _schedules(causal):
            cfg = bwd_tile_config(head_dim, causal)
            if schedule == "shift" and min(-(-sk // cfg.block_n), _sms()) > -(-sq // cfg.block_m):
                continue  # shift refuses this shape (test_every_schedule_matches_reference)
            junk = torch.full((64 << 20,), float("nan"), device="cuda")  # 256 MiB back to the cache
            del junk
            grads = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, schedule=schedule)
            _check(q, k, v, dout, out, lse, causal, grads, f"{schedule} {seqlens} causal={causal} (NaN-filled cache)")


def _repeat_bitwise(q, k, v, dout, out, lse, causal, schedule, repeats, sm_margin=0):
    ref = [t.clone() for t in attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True,
                                                 schedule=schedule, sm_margin=sm_margin)]
    for i in range(repeats):
        got = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, schedule=schedule,
                                 sm_margin=sm_margin)
        for name, g, r in zip(("dq", "dk", "dv"), got, ref):
            assert torch.equal(g, r), f"{schedule}: repeat {i}: {name} differs bitwise"
    return ref


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_every_schedule_bitwise_100_repeats(head_dim, causal):
    q, k, v, dout = _inputs(2, 2048, 2048, 4, 4, head_dim, _seed())
    out, lse = _forward(q, k, v, causal)
    for schedule in _schedules(causal):
        _repeat_bitwise(q, k, v, dout, out, lse, causal, schedule, 100)


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_every_schedule_bitwise_1000_repeats(head_dim, causal):
    q, k, v, dout = _inputs(2, 4096, 4096, 4, 4, head_dim, _seed())
    out, lse = _forward(q, k, v, causal)
    for schedule in _schedules(causal):
        _repeat_bitwise(q, k, v, dout, out, lse, causal, schedule, 1000)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_portable_schedules_give_the_same_bits_for_any_cta_count(head_dim, causal):
    """sm_margin 0 ... SMs-1 stands in for other Hopper parts (H100 PCIe 114, H20 78 SMs):
    every schedule auto may pick gives identical bits on every grid, one CTA included."""
    q, k, v, dout = _inputs(2, 1536, 1536, 3, 3, head_dim, _seed())
    out, lse = _forward(q, k, v, causal)
    sms = _sms()
    margins = sorted({1, sms - 114, sms - 78, 33, sms - 7, sms - 1} - {0})
    for schedule in PORTABLE_KERNEL_SCHEDULES:
        base = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, schedule=schedule)
        for margin in margins:
            got = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, schedule=schedule,
                                     sm_margin=margin)
            for name, a, b in zip(("dq", "dk", "dv"), base, got):
                assert torch.equal(a, b), f"{schedule}: sm_margin={margin} ({sms - margin} CTAs) changed {name}"
    _assert_auto_bits_do_not_depend_on_the_grid(q, k, v, dout, out, lse, causal)


def _assert_auto_bits_do_not_depend_on_the_grid(q, k, v, dout, out, lse, causal):
    sms = _sms()
    base = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, schedule="auto")
    for margin in sorted({1, sms - 114, sms - 78} - {0}):
        got = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, schedule="auto",
                                 sm_margin=margin)
        for name, a, b in zip(("dq", "dk", "dv"), base, got):
            assert torch.equal(a, b), f"auto: sm_margin={margin} ({sms - margin} CTAs) changed {name}"


def test_auto_bits_do_not_depend_on_the_grid_where_the_model_would_choose_differently():
    """Each portable schedule's bits are grid-independent, but two schedules' bits differ, so
    auto must choose by the shape alone (AUTO_REFERENCE_CTAS). On this shape the model ranks
    descending first on 132 CTAs and fa3 first on 131, 114 and 78 (GQA 16/4, hdim 128, causal 2k)."""
    q, k, v, dout = _inputs(2, 2048, 2048, 16, 4, 128, _seed())
    out, lse = _forward(q, k, v, True)
    _assert_auto_bits_do_not_depend_on_the_grid(q, k, v, dout, out, lse, True)


def test_shift_is_correct_and_repeatable_on_every_grid_it_is_planned_for():
    """shift's turns are planned for the launched grid (not portable): each grid gives its
    own bits, correct and repeatable, one CTA included."""
    q, k, v, dout = _inputs(2, 2048, 1024, 3, 3, 64, _seed())
    out, lse = _forward(q, k, v, False)
    for margin in (0, 100, _sms() - 1):
        grads = _repeat_bitwise(q, k, v, dout, out, lse, False, "shift", 10, sm_margin=margin)
        _check(q, k, v, dout, out, lse, False, grads, f"shift sm_margin={margin}")


def _traced(schedule, causal, det, sq=1024, sk=1024, heads=3, batch=2, head_dim=64, sm_margin=0):
    from dash.trace import trace_backward

    q, k, v, dout = _inputs(batch, sq, sk, heads, heads, head_dim, _seed())
    out, lse = _forward(q, k, v, causal)
    dq, dk, dv, tr = trace_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det, schedule=schedule,
                                    sm_margin=sm_margin)
    ref = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det, schedule=schedule,
                             sm_margin=sm_margin)
    if det:  # tracing must not change the result
        assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), ref))
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


_DEADLOCK_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from dash.api import attention_backward
    cases = json.loads(sys.argv[1])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for sq, sk, b, h, hk, d, causal, sched, ctas in cases:
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        out = torch.randn_like(q); dout = torch.randn_like(q)
        lse = torch.randn(b, h, sq, device="cuda", dtype=torch.float32).abs() + 5
        try:
            attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, schedule=sched,
                               sm_margin=sms - ctas)
        except Exception as e:  # a clear refusal (shift's M >= N condition) is not a hang
            if sched != "shift":
                raise
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
    q, k, v, dout = _inputs(1, 640, 1024, heads, heads_k, 128, _seed())
    out, lse = _forward(q, k, v, causal)
    for schedule in PORTABLE_KERNEL_SCHEDULES:
        grads = _repeat_bitwise(q, k, v, dout, out, lse, causal, schedule, 20)
        _check(q, k, v, dout, out, lse, causal, grads, f"GQA {heads}/{heads_k} {schedule}")
        # And the bits do not depend on the grid.
        got = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, schedule=schedule,
                                 sm_margin=_sms() - 3)
        assert all(torch.equal(a, b) for a, b in zip(grads, got)), f"GQA {schedule}: bits depend on the grid"


def test_gqa_has_no_per_head_dk_dv_copies():
    """Peak memory of a GQA 32/8 backward: the outputs, the fp32 dQ workspaces (one per
    accumulation chain of the deterministic mode, config.py dq_chains) and the fp32 group
    accumulators of dK/dV, and nothing per query head (per-head bf16 dK/dV copies, what DASH
    used to keep, would add 2 x 32 heads x 4096 x 128 x 2 B = 64 MiB)."""
    q, k, v, dout = _inputs(1, 4096, 4096, 32, 8, 128, _seed())
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
    group_accumulators = 2 * k.numel() * 4             # dK, dV (fp32, one per KV head)
    needed = outputs + dq_workspace + group_accumulators
    per_head_copies = 2 * q.numel() * 2
    assert extra < needed + per_head_copies // 4, (
        f"backward used {extra / 2**20:.0f} MiB extra; outputs and workspaces need {needed / 2**20:.0f} MiB")
