"""GPU tests of DASH's variable-length attention (flash_attn_varlen_func, dash::fwd_varlen,
dash::bwd_varlen) against dash.reference (skipped without an sm_90 GPU).

Accuracy rule (FA3's): max |kernel - ref_f64| <= 2 * max |ref_lowp - ref_f64| + floor, for O, the
LSE and dq, dk, dv, over the whole batch and per sequence; the -inf LSE of rows that see no key
must match exactly and their O be 0. The varlen kernels run the padded kernels' math on each
tile and column, so a batch of equal lengths must give the padded forward's and backward's bits
(same schedule). Deterministic backwards are compared bitwise over repeats. Seeds: every
failure names its seed and DASH_TEST_SALT (tests/test_fwd_gpu.py).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from dash import reference
from dash.config import fwd_tile_config
from dash.api import flash_attn_func, flash_attn_varlen_func
from seeding import seed_of, seed_tag  # tests/seeding.py (conftest.py puts tests/ on sys.path)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import fwd_tile_order_model  # noqa: E402  (the kernel's varlen L2 sections: section_keys, sequence_section_heads)

pytestmark = pytest.mark.gpu


# (lengths of q, lengths of k) per case: empty sequences, one row, tails off every tile size,
# seqlen_q != seqlen_k both ways, sequences without keys, and one longer than several tiles.
LENGTH_CASES = {
    "mixed": ([1, 0, 239, 128, 300, 17], [1, 5, 239, 128, 300, 33]),
    "q_longer": ([400, 77, 129], [130, 200, 64]),
    "k_longer": ([64, 13, 190], [333, 256, 700]),
    "no_keys": ([50, 70, 9], [0, 70, 0]),
    "long": ([1500, 3, 2049], [1500, 900, 2049]),
}


def _offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _packed(lengths_q, lengths_k, heads, heads_kv, head_dim, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(lengths_q), heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(sum(lengths_k), heads_kv, head_dim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(sum(lengths_k), heads_kv, head_dim, device="cuda", dtype=dtype, generator=gen)
    return q, k, v, _offsets(lengths_q), _offsets(lengths_k)


def _check(q, k, v, cu_q, cu_k, causal, out, lse, label):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    hi_out, hi_lse = reference.attention_forward_varlen(q, k, v, cq, ck, causal=causal, compute_dtype=torch.float64)
    lo_out, lo_lse = reference.attention_forward_varlen(q, k, v, cq, ck, causal=causal, compute_dtype=q.dtype)
    assert out.shape == q.shape and out.dtype == q.dtype, f"{label}: out {out.shape} {out.dtype}"
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32, f"{label}: lse {lse.shape}"
    reference.assert_within_bound(out, hi_out, lo_out, f"{label} out")
    empty_rows = torch.isinf(hi_lse)  # (heads, total_q)
    assert torch.equal(torch.isneginf(lse), empty_rows), f"{label}: -inf LSE rows differ from the reference"
    if empty_rows.any():
        assert torch.all(out.transpose(0, 1)[empty_rows] == 0), f"{label}: rows that see no key must be 0"
    reference.assert_within_bound(lse, hi_lse, lo_lse, f"{label} lse")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", list(LENGTH_CASES))
def test_varlen_forward_matches_reference(case, causal, head_dim):
    lengths_q, lengths_k = LENGTH_CASES[case]
    seed = seed_of("varlen", case, causal, head_dim)
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 3, 3, head_dim, torch.bfloat16, seed)
    with torch.no_grad():
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                          return_attn_probs=True)
    _check(q, k, v, cu_q, cu_k, causal, out, lse, f"varlen {case} causal={causal} hdim{head_dim} {seed_tag(seed)}")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads, heads_kv, dtype", [(8, 2, torch.bfloat16), (6, 1, torch.float16),
                                                    (4, 4, torch.float16)], ids=["gqa4-bf16", "mqa-fp16", "fp16"])
def test_varlen_forward_gqa_and_fp16(heads, heads_kv, dtype, causal, head_dim):
    lengths_q, lengths_k = [200, 1, 513, 64], [150, 40, 513, 0]
    seed = seed_of("varlen-gqa", heads, heads_kv, str(dtype), causal, head_dim)
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, heads, heads_kv, head_dim, dtype, seed)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 513, 513, causal=causal, return_attn_probs=True)
    _check(q, k, v, cu_q, cu_k, causal, out, lse, f"varlen {heads}/{heads_kv} {dtype} causal={causal} {seed_tag(seed)}")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_of_equal_lengths_gives_the_padded_bits(causal, head_dim):
    """Equal lengths: the varlen kernel's tiles are the padded kernel's, with the same blocks in
    the same order, so out and lse are bit for bit the padded forward's."""
    batch, seqlen_q, seqlen_k, heads = 3, 777, 1000, 4
    seed = seed_of("varlen-bits", causal, head_dim)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, seqlen_k, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(batch, seqlen_k, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    vout, vlse = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                        _offsets([seqlen_q] * batch), _offsets([seqlen_k] * batch), seqlen_q,
                                        seqlen_k, causal=causal, return_attn_probs=True)
    assert torch.equal(vout, out.flatten(0, 1)), f"out bits differ from the padded forward {seed_tag(seed)}"
    assert torch.equal(vlse, lse.transpose(0, 1).flatten(1, 2)), f"lse bits differ {seed_tag(seed)}"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_every_output_element_written(head_dim, causal, monkeypatch):
    """DASH_POISON_OUTPUTS=1 NaN-fills out and lse before the launch: none may survive, also in
    sequences without keys and in tiles the grid skips for shorter sequences."""
    monkeypatch.setenv("DASH_POISON_OUTPUTS", "1")
    lengths_q, lengths_k = LENGTH_CASES["mixed"][0] + [60], LENGTH_CASES["mixed"][1] + [0]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 2, 2, head_dim, torch.bfloat16, seed_of("poison", head_dim))
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                      return_attn_probs=True)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


@pytest.mark.parametrize("heads", [8, 12])
@pytest.mark.parametrize("ctas", ["all", "seven", "one"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_forward_skips_dead_runs_and_keeps_every_live_tile(head_dim, causal, ctas, heads, monkeypatch):
    """A skewed batch: the grid, sized for the long sequence, opens every short sequence's L2
    section (all its heads: FwdTileOrder::sequence_section_heads) with a run of dead Q tiles,
    which a CTA skips at once (dead_run_end_in_sequence), while the long sequence walks several
    narrower sections. Every live tile must still be computed: with the outputs NaN-filled first,
    the batch must give each sequence's own padded forward, bit for bit (the same tiles and
    blocks), on the whole grid, seven CTAs and one. With 12 heads a short sequence's sections are
    8 and 4 heads (the largest power of two, then a partial section)."""
    monkeypatch.setenv("DASH_POISON_OUTPUTS", "1")
    cfg = fwd_tile_config(head_dim, causal)
    gen = random.Random(seed_of("varlen-dead-runs-lengths", head_dim, causal))
    lengths = [gen.choice([0, 1, cfg.block_m, cfg.block_m + 1]) for _ in range(4)]
    lengths += [gen.randint(2, 3 * cfg.block_m) for _ in range(30)]
    # Long enough that its K and V need narrower sections than the short sequences' widest.
    widest = 1 << (heads.bit_length() - 1)  # the largest power of two of the heads
    keys = fwd_tile_order_model.section_keys(cfg.l2_section_bytes, head_dim)
    longest = keys // widest + 100
    lengths.insert(gen.randrange(len(lengths) + 1), longest)
    assert fwd_tile_order_model.sequence_section_heads(longest, heads, keys) < widest
    assert fwd_tile_order_model.sequence_section_heads(3 * cfg.block_m, heads, keys) == widest
    seed = seed_of("varlen-dead-runs", head_dim, causal)
    q, k, v, cu, _ = _packed(lengths, lengths, heads, heads, head_dim, torch.bfloat16, seed)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    margin = {"all": 0, "seven": sms - 7, "one": sms - 1}[ctas]
    out, lse = flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal, return_attn_probs=True,
                                      sm_margin=margin)
    torch.cuda.synchronize()
    label = f"hdim{head_dim} causal={causal} ctas={ctas} heads={heads} {seed_tag(seed)}"
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"a tile was not written: {label}"
    bounds = cu.tolist()
    for b, (a, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        if a == e:
            continue
        one, one_lse = flash_attn_func(q[None, a:e], k[None, a:e], v[None, a:e], causal=causal,
                                       return_attn_probs=True)
        assert torch.equal(out[a:e], one[0]), f"sequence {b} ({e - a} rows): out bits differ: {label}"
        assert torch.equal(lse[:, a:e], one_lse[0]), f"sequence {b} ({e - a} rows): lse bits differ: {label}"


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_sequence_longer_than_max_seqlen_q_is_nan(causal):
    """A max_seqlen_q below a sequence's length leaves rows outside the grid: they come out NaN
    (out and lse), and every other row is still right."""
    lengths = [100, 450, 30]
    q, k, v, cu_q, cu_k = _packed(lengths, lengths, 2, 2, 128, torch.bfloat16, seed_of("overlong", causal))
    max_q = 200  # the grid covers the Q tiles of 200 rows: rows 0..255 at hdim 128 (128-row tiles)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max(lengths), causal=causal,
                                      return_attn_probs=True)
    block_m = fwd_tile_config(128, causal).block_m
    grid_rows = -(-max_q // block_m) * block_m
    beyond = torch.zeros(q.shape[0], dtype=torch.bool, device="cuda")
    beyond[100 + grid_rows:100 + 450] = True
    assert torch.isnan(out[beyond]).all() and torch.isnan(lse[:, beyond]).all()
    assert not torch.isnan(out[~beyond]).any() and not torch.isnan(lse[:, ~beyond]).any()
    hi_out, _ = reference.attention_forward_varlen(q, k, v, cu_q.tolist(), cu_k.tolist(), causal=causal,
                                                   compute_dtype=torch.float64)
    lo_out, _ = reference.attention_forward_varlen(q, k, v, cu_q.tolist(), cu_k.tolist(), causal=causal,
                                                   compute_dtype=q.dtype)
    reference.assert_within_bound(out[~beyond], hi_out[~beyond], lo_out[~beyond], "rows inside the grid")


def test_varlen_offsets_on_the_cpu_and_few_ctas():
    """Offsets given on the CPU are checked and copied; the bits do not depend on the grid."""
    lengths_q, lengths_k = LENGTH_CASES["k_longer"]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 4, 2, 64, torch.bfloat16, seed_of("cpu-offsets"))
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True)
    out_cpu = flash_attn_varlen_func(q, k, v, cu_q.cpu(), cu_k.cpu(), max(lengths_q), max(lengths_k), causal=True)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    out_one = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                     sm_margin=sms - 1)
    assert torch.equal(out, out_cpu) and torch.equal(out, out_one)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_forward_bitwise_repeats(causal):
    """The varlen forward's out and LSE keep their bits over 100 runs on grids of every size
    (sm_margin cycling through 0, 1, 33 and all but one SM)."""
    lengths_q, lengths_k = LENGTH_CASES["mixed"]
    seed = seed_of("varlen-fwd-repeats", causal)
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 4, 2, 128, torch.bfloat16, seed)
    longest_q, longest_k = max(lengths_q), max(lengths_k)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    base_out, base_lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, longest_q, longest_k, causal=causal,
                                                return_attn_probs=True)
    for i in range(100):
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, longest_q, longest_k, causal=causal,
                                          sm_margin=(0, 1, 33, sms - 1)[i % 4], return_attn_probs=True)
        assert torch.equal(out, base_out) and torch.equal(lse, base_lse), f"repeat {i} changed the bits {seed_tag(seed)}"


def test_varlen_opcheck_and_compile():
    lengths_q, lengths_k = [33, 0, 140], [70, 12, 140]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 2, 1, 128, torch.bfloat16, seed_of("opcheck"))
    torch.library.opcheck(torch.ops.dash.fwd_varlen, (q, k, v, cu_q, cu_k, 140, 140, 0.125, True, False, "fa3", 0))
    eager = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 140, 140, causal=True)
    compiled = torch.compile(flash_attn_varlen_func, fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(q, k, v, cu_q, cu_k, 140, 140, causal=True), eager)
        # Offsets on the CPU: checked eagerly, data under compile (no guard on each value).
        assert torch.equal(compiled(q, k, v, cu_q.cpu(), cu_k.cpu(), 140, 140, causal=True), eager)


# ---------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------
def _exact_forward(q, k, v, cu_q, cu_k, causal):
    """The float64 reference forward, O rounded to the input dtype as a kernel stores it."""
    out, lse = reference.attention_forward_varlen(q, k, v, cu_q.tolist(), cu_k.tolist(), causal=causal,
                                                  compute_dtype=torch.float64)
    return out.to(q.dtype), lse.float()


def _check_grads(dout, q, k, v, out, lse, cu_q, cu_k, causal, grads, label):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    hi = reference.attention_backward_varlen(dout, q, k, v, out, lse, cq, ck, causal=causal,
                                             compute_dtype=torch.float64)
    lo = reference.attention_backward_varlen(dout, q, k, v, out, lse, cq, ck, causal=causal, compute_dtype=q.dtype)
    for name, g, h, l, cu in zip(("dq", "dk", "dv"), grads, hi, lo, (cq, ck, ck)):
        assert g.shape == h.shape and g.dtype == q.dtype, f"{label} {name}: {g.shape} {g.dtype}"
        reference.assert_within_bound(g, h, l, f"{label} {name}")
        # Per sequence: a short sequence's lost tile stays under the batch's global bound.
        for b in range(len(cu) - 1):
            if cu[b + 1] > cu[b]:
                sl = slice(cu[b], cu[b + 1])
                reference.assert_within_bound(g[sl], h[sl], l[sl], f"{label} {name} sequence {b}")


def _bwd_op(dout, q, k, v, out, lse, cu_q, cu_k, causal, deterministic, schedule):
    return torch.ops.dash.bwd_varlen(dout, q, k, v, out, lse, cu_q, cu_k, int(max((cu_q[1:] - cu_q[:-1]).tolist())),
                                     int(max((cu_k[1:] - cu_k[:-1]).tolist())), q.shape[-1] ** -0.5, causal,
                                     deterministic, schedule, 0)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", ["mixed", "q_longer", "k_longer", "no_keys"])
def test_varlen_backward_matches_reference(case, deterministic, causal, head_dim):
    lengths_q, lengths_k = LENGTH_CASES[case]
    seed = seed_of("varlen-bwd", case, deterministic, causal, head_dim)
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 3, 3, head_dim, torch.bfloat16, seed)
    out, lse = _exact_forward(q, k, v, cu_q, cu_k, causal)
    dout = torch.randn_like(q)
    schedule = "descending" if causal else "interleaved"
    grads = _bwd_op(dout, q, k, v, out, lse, cu_q, cu_k, causal, deterministic, schedule)
    _check_grads(dout, q, k, v, out, lse, cu_q, cu_k, causal, grads,
                 f"varlen bwd {case} det={deterministic} causal={causal} hdim{head_dim} {seed_tag(seed)}")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_backward_gqa_fp16_and_long(causal, head_dim):
    lengths_q, lengths_k = [1500, 3, 2049, 70], [1500, 900, 2049, 0]
    seed = seed_of("varlen-bwd-gqa", causal, head_dim)
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 8, 2, head_dim, torch.float16, seed)
    out, lse = _exact_forward(q, k, v, cu_q, cu_k, causal)
    dout = torch.randn_like(q)
    grads = _bwd_op(dout, q, k, v, out, lse, cu_q, cu_k, causal, True, "fa3")
    _check_grads(dout, q, k, v, out, lse, cu_q, cu_k, causal, grads,
                 f"varlen bwd gqa 8/2 fp16 causal={causal} hdim{head_dim} {seed_tag(seed)}")


@pytest.mark.parametrize("schedule", ["fa3", "interleaved", "descending"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_backward_of_a_skewed_batch(head_dim, causal, schedule):
    """One long sequence beside 100 short ones: most of the padded grid's columns lie past a
    short sequence's keys and are left out of the claims (bwd_varlen_live_columns_kernel; more
    than one chunk of its 1024 threads x 8 items: 101 x 8 heads x 16 columns). Gradients
    against the reference in both modes, and the deterministic bits repeat."""
    gen = random.Random(seed_of("varlen-skewed-lengths", head_dim, causal, schedule))
    lengths = [2048] + [gen.randint(1, 200) for _ in range(100)]
    gen.shuffle(lengths)
    seed = seed_of("varlen-skewed", head_dim, causal, schedule)
    q, k, v, cu_q, cu_k = _packed(lengths, lengths, 8, 2, head_dim, torch.bfloat16, seed)
    out, lse = _exact_forward(q, k, v, cu_q, cu_k, causal)
    dout = torch.randn_like(q)
    label = f"varlen bwd skewed causal={causal} hdim{head_dim} {schedule} {seed_tag(seed)}"
    for deterministic in (False, True):
        grads = _bwd_op(dout, q, k, v, out, lse, cu_q, cu_k, causal, deterministic, schedule)
        _check_grads(dout, q, k, v, out, lse, cu_q, cu_k, causal, grads, f"{label} det={deterministic}")
    for i in range(5):
        again = _bwd_op(dout, q, k, v, out, lse, cu_q, cu_k, causal, True, schedule)
        for name, a, b in zip(("dq", "dk", "dv"), again, grads):
            assert torch.equal(a, b), f"{name} differs on repeat {i}: {label}"


@pytest.mark.parametrize("schedule", ["fa3", "interleaved", "descending"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_backward_of_equal_lengths_gives_the_padded_bits(head_dim, causal, schedule):
    """Equal lengths: every column of the varlen kernel is the padded kernel's, visited and
    turned in the same order, so dq, dk, dv are bit for bit the padded backward's."""
    batch, seqlen, heads, heads_kv = 3, 777, 4, 2
    seed = seed_of("varlen-bwd-bits", head_dim, causal, schedule)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, seqlen, heads_kv, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(batch, seqlen, heads_kv, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    dout = torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = head_dim ** -0.5
    out, lse = torch.ops.dash.fwd(q, k, v, scale, causal, True, schedule, 0)
    padded = torch.ops.dash.bwd(dout, q, k, v, out, lse, scale, causal, True, schedule, 0)
    cu = _offsets([seqlen] * batch)
    vlse = lse.transpose(0, 1).flatten(1, 2).contiguous()
    varlen = torch.ops.dash.bwd_varlen(dout.flatten(0, 1), q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                       out.flatten(0, 1), vlse, cu, cu, seqlen, seqlen, scale, causal, True, schedule, 0)
    for name, a, b in zip(("dq", "dk", "dv"), varlen, padded):
        assert torch.equal(a, b.flatten(0, 1)), f"{name} bits differ from the padded backward ({schedule}) {seed_tag(seed)}"


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_backward_bitwise_repeats(causal):
    lengths_q, lengths_k = LENGTH_CASES["mixed"]
    seed = seed_of("varlen-bwd-repeats", causal)
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 4, 2, 128, torch.bfloat16, seed)
    out, lse = _exact_forward(q, k, v, cu_q, cu_k, causal)
    dout = torch.randn_like(q)
    first = _bwd_op(dout, q, k, v, out, lse, cu_q, cu_k, causal, True, "descending" if causal else "fa3")
    for i in range(100):
        again = _bwd_op(dout, q, k, v, out, lse, cu_q, cu_k, causal, True, "descending" if causal else "fa3")
        for name, a, b in zip(("dq", "dk", "dv"), again, first):
            assert torch.equal(a, b), f"{name} differs on repeat {i} {seed_tag(seed)}"


@pytest.mark.parametrize("heads_kv", [4, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_backward_writes_every_gradient(causal, heads_kv, monkeypatch):
    """DASH_POISON_OUTPUTS=1 NaN-fills dq, dk and dv before the launch (under GQA only what the
    kernel writes: dk, dv in deterministic runs, which the group's last query head writes): none
    may survive, also in sequences without keys or queries."""
    monkeypatch.setenv("DASH_POISON_OUTPUTS", "1")
    lengths_q, lengths_k = [60, 0, 239, 17, 5], [0, 40, 239, 33, 9]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 4, heads_kv, 64, torch.bfloat16, seed_of("bwd-poison", causal))
    out, lse = _exact_forward(q, k, v, cu_q, cu_k, causal)
    grads = _bwd_op(torch.randn_like(q), q, k, v, out, lse, cu_q, cu_k, causal, True, "fa3")
    torch.cuda.synchronize()
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert not torch.isnan(g).any(), f"{name} has unwritten (NaN) elements"
    assert torch.all(grads[0][:60] == 0), "queries without keys get dq = 0"
    assert torch.all(grads[1][:40] == 0) and torch.all(grads[2][:40] == 0), "keys without queries get dk = dv = 0"


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_autograd_end_to_end(causal):
    """flash_attn_varlen_func + torch.autograd.grad, deterministic auto: gradients against the
    reference of the same (kernel) forward, and the same bits again."""
    lengths_q, lengths_k = [333, 1, 700, 64], [333, 20, 700, 200]
    seed = seed_of("varlen-e2e", causal)
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 4, 4, 128, torch.bfloat16, seed)
    q.requires_grad_(True)
    k.requires_grad_(True)
    v.requires_grad_(True)
    dout = torch.randn_like(q)

    def step():
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 700, 700, causal=causal, deterministic=True,
                                          return_attn_probs=True)
        return (out, lse) + torch.autograd.grad(out, (q, k, v), dout)

    out, lse, *grads = step()
    _check(q.detach(), k.detach(), v.detach(), cu_q, cu_k, causal, out.detach(), lse, f"e2e fwd {seed_tag(seed)}")
    _check_grads(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, cu_q, cu_k, causal, grads,
                 f"e2e bwd causal={causal} {seed_tag(seed)}")
    again = step()[2:]
    assert all(torch.equal(a, b) for a, b in zip(again, grads)), f"deterministic varlen autograd differs {seed_tag(seed)}"


def test_varlen_lse_is_a_constant_and_gradients_are_first_order():
    """dash::fwd_varlen's autograd (Python) follows dash::fwd's rules: softmax_lse is returned
    non-differentiable, create_graph=True gives the same gradients bit for bit, and a second
    differentiation through them raises."""
    from dash.ops import NOT_TWICE_DIFFERENTIABLE

    seed = seed_of("varlen-lse-grad")
    q, k, v, cu_q, cu_k = _packed([100, 37], [64, 130], 2, 1, 64, torch.bfloat16, seed)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 100, 130, causal=True, deterministic=True,
                                      return_attn_probs=True)
    assert out.requires_grad and not lse.requires_grad
    plain = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    both = torch.autograd.grad((out * dout).sum() + lse.sum(), (q, k, v), retain_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, both)), seed_tag(seed)
    graphed = torch.autograd.grad(out, (q, k, v), dout, create_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, graphed)), f"create_graph changed the bits {seed_tag(seed)}"
    with pytest.raises(RuntimeError) as e:
        torch.autograd.grad(sum(g.float().pow(2).sum() for g in graphed), (q, k))
    assert NOT_TWICE_DIFFERENTIABLE in str(e.value)


def test_varlen_backward_opcheck():
    lengths_q, lengths_k = [33, 0, 140], [70, 12, 140]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 2, 1, 128, torch.bfloat16, seed_of("bwd-opcheck"))
    out, lse = _exact_forward(q, k, v, cu_q, cu_k, True)
    args = (torch.randn_like(q), q, k, v, out, lse, cu_q, cu_k, 140, 140, 0.125, True, True, "fa3", 0)
    torch.library.opcheck(torch.ops.dash.bwd_varlen, args)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    torch.library.opcheck(torch.ops.dash.fwd_varlen, (qg, kg, vg, cu_q, cu_k, 140, 140, 0.125, True, True, "fa3", 0))


@pytest.mark.parametrize("causal", [False, True])
def test_fa3_entry_points_on_packed_sequences(causal):
    """TransformerEngine's THD path: _flash_attn_forward / _flash_attn_backward with cu_seqlens,
    gradients into caller buffers, against the reference; softmax_d (heads, total_q)."""
    from dash.flash_attn_interface import _flash_attn_backward, _flash_attn_forward

    lengths_q, lengths_k = LENGTH_CASES["q_longer"]
    seed = seed_of("varlen-entry", causal)
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 4, 2, 64, torch.bfloat16, seed)
    mq, mk = max(lengths_q), max(lengths_k)
    out, lse, *_ = _flash_attn_forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq,
                                       max_seqlen_k=mk, causal=causal)
    _check(q, k, v, cu_q, cu_k, causal, out, lse, f"entry fwd causal={causal} {seed_tag(seed)}")
    dout = torch.randn_like(q)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    softmax_d = _flash_attn_backward(dout, q, k, v, out, lse, cu_q, cu_k, None, None, mq, mk, dq, dk, dv,
                                     is_causal=causal, deterministic=True)
    _check_grads(dout, q, k, v, out, lse, cu_q, cu_k, causal, (dq, dk, dv), f"entry bwd causal={causal} {seed_tag(seed)}")
    torch.testing.assert_close(softmax_d, (dout.float() * out.float()).sum(-1).transpose(0, 1))


@pytest.mark.parametrize("too_small", ["max_seqlen_q", "max_seqlen_k"])
@pytest.mark.parametrize("heads_kv", [2, 1])
def test_varlen_backward_of_a_sequence_longer_than_the_max_is_nan(too_small, heads_kv):
    """A sequence longer than a max length gets no work in the backward (its tiles would fall
    outside the padded workspace) and NaN in all its gradients; the other sequences' gradients
    are right, and nothing hangs."""
    lengths = [100, 450, 30]
    seed = seed_of("bwd-overlong", too_small, heads_kv)
    q, k, v, cu_q, cu_k = _packed(lengths, lengths, 2, heads_kv, 128, torch.bfloat16, seed)
    out, lse = _exact_forward(q, k, v, cu_q, cu_k, True)
    dout = torch.randn_like(q)
    maxes = dict(max_seqlen_q=450, max_seqlen_k=450)
    maxes[too_small] = 200
    grads = torch.ops.dash.bwd_varlen(dout, q, k, v, out, lse, cu_q, cu_k, maxes["max_seqlen_q"],
                                      maxes["max_seqlen_k"], 128 ** -0.5, True, True, "fa3", 0)
    torch.cuda.synchronize()
    long_rows = slice(100, 550)
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert torch.isnan(g[long_rows]).all(), f"{name}: the long sequence's gradients must be NaN {seed_tag(seed)}"
        assert not torch.isnan(g[:100]).any() and not torch.isnan(g[550:]).any(), f"{name} {seed_tag(seed)}"
    hi = reference.attention_backward_varlen(dout, q, k, v, out, lse, cu_q.tolist(), cu_k.tolist(), causal=True,
                                             compute_dtype=torch.float64)
    lo = reference.attention_backward_varlen(dout, q, k, v, out, lse, cu_q.tolist(), cu_k.tolist(), causal=True,
                                             compute_dtype=q.dtype)
    for name, g, h, l in zip(("dq", "dk", "dv"), grads, hi, lo):
        for sl in (slice(0, 100), slice(550, 580)):
            reference.assert_within_bound(g[sl], h[sl], l[sl], f"{name} rows {sl} {seed_tag(seed)}")
