"""GPU tests of DASH's variable-length forward (flash_attn_varlen_func, dash::fwd_varlen)
against dash.reference (skipped without an sm_90 GPU).

Accuracy rule (FA3's), per sequence set: max |kernel - ref_f64| <= 2 * max |ref_lowp - ref_f64|
+ floor, for O and the LSE; the -inf LSE of rows that see no key must match exactly and their O
be 0. The varlen kernel runs the padded kernel's math on each Q tile, so a batch of equal
lengths must give the padded forward's bits. Seeds: every failure names its seed and
DASH_TEST_SALT (tests/test_fwd_gpu.py).
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from dash import reference
from dash.api import flash_attn_func, flash_attn_varlen_func

pytestmark = pytest.mark.gpu

SALT = int(os.environ.get("DASH_TEST_SALT") or int.from_bytes(os.urandom(2), "little"))

# (lengths of q, lengths of k) per case: empty sequences, one row, tails off every tile size,
# seqlen_q != seqlen_k both ways, sequences without keys, and one longer than several tiles.
LENGTH_CASES = {
    "mixed": ([1, 0, 239, 128, 300, 17], [1, 5, 239, 128, 300, 33]),
    "q_longer": ([400, 77, 129], [130, 200, 64]),
    "k_longer": ([64, 13, 190], [333, 256, 700]),
    "no_keys": ([50, 70, 9], [0, 70, 0]),
    "long": ([1500, 3, 2049], [1500, 900, 2049]),
}


def _seed(*parts) -> int:
    return (zlib.crc32(repr(parts).encode()) + SALT) % 2**31


def _tag(seed: int) -> str:
    return f"seed={seed} (DASH_TEST_SALT={SALT})"


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
    seed = _seed("varlen", case, causal, head_dim)
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 3, 3, head_dim, torch.bfloat16, seed)
    with torch.no_grad():
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                          return_attn_probs=True)
    _check(q, k, v, cu_q, cu_k, causal, out, lse, f"varlen {case} causal={causal} hdim{head_dim} {_tag(seed)}")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads, heads_kv, dtype", [(8, 2, torch.bfloat16), (6, 1, torch.float16),
                                                    (4, 4, torch.float16)], ids=["gqa4-bf16", "mqa-fp16", "fp16"])
def test_varlen_forward_gqa_and_fp16(heads, heads_kv, dtype, causal, head_dim):
    lengths_q, lengths_k = [200, 1, 513, 64], [150, 40, 513, 0]
    seed = _seed("varlen-gqa", heads, heads_kv, str(dtype), causal, head_dim)
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, heads, heads_kv, head_dim, dtype, seed)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 513, 513, causal=causal, return_attn_probs=True)
    _check(q, k, v, cu_q, cu_k, causal, out, lse, f"varlen {heads}/{heads_kv} {dtype} causal={causal} {_tag(seed)}")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_of_equal_lengths_gives_the_padded_bits(causal, head_dim):
    """Equal lengths: the varlen kernel's tiles are the padded kernel's, with the same blocks in
    the same order, so out and lse are bit for bit the padded forward's."""
    batch, seqlen_q, seqlen_k, heads = 3, 777, 1000, 4
    seed = _seed("varlen-bits", causal, head_dim)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, seqlen_k, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(batch, seqlen_k, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    vout, vlse = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                        _offsets([seqlen_q] * batch), _offsets([seqlen_k] * batch), seqlen_q,
                                        seqlen_k, causal=causal, return_attn_probs=True)
    assert torch.equal(vout, out.flatten(0, 1)), f"out bits differ from the padded forward {_tag(seed)}"
    assert torch.equal(vlse, lse.transpose(0, 1).flatten(1, 2)), f"lse bits differ {_tag(seed)}"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_every_output_element_written(head_dim, causal, monkeypatch):
    """DASH_POISON_OUTPUTS=1 NaN-fills out and lse before the launch: none may survive, also in
    sequences without keys and in tiles the grid skips for shorter sequences."""
    monkeypatch.setenv("DASH_POISON_OUTPUTS", "1")
    lengths_q, lengths_k = LENGTH_CASES["mixed"][0] + [60], LENGTH_CASES["mixed"][1] + [0]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 2, 2, head_dim, torch.bfloat16, _seed("poison", head_dim))
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                      return_attn_probs=True)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_sequence_longer_than_max_seqlen_q_is_nan(causal):
    """A max_seqlen_q below a sequence's length leaves rows outside the grid: they come out NaN
    (out and lse), and every other row is still right."""
    lengths = [100, 450, 30]
    q, k, v, cu_q, cu_k = _packed(lengths, lengths, 2, 2, 128, torch.bfloat16, _seed("overlong", causal))
    max_q = 200  # the grid covers rows 0..255 of each sequence (128-row Q tiles at hdim 128, 2 tiles)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max(lengths), causal=causal,
                                      return_attn_probs=True)
    grid_rows = -(-max_q // 128) * 128
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
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 4, 2, 64, torch.bfloat16, _seed("cpu-offsets"))
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True)
    out_cpu = flash_attn_varlen_func(q, k, v, cu_q.cpu(), cu_k.cpu(), max(lengths_q), max(lengths_k), causal=True)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    out_one = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                     sm_margin=sms - 1)
    assert torch.equal(out, out_cpu) and torch.equal(out, out_one)


def test_varlen_opcheck_and_compile():
    lengths_q, lengths_k = [33, 0, 140], [70, 12, 140]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 2, 1, 128, torch.bfloat16, _seed("opcheck"))
    torch.library.opcheck(torch.ops.dash.fwd_varlen, (q, k, v, cu_q, cu_k, 140, 140, 0.125, True, 0))
    eager = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 140, 140, causal=True)
    compiled = torch.compile(flash_attn_varlen_func, fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(q, k, v, cu_q, cu_k, 140, 140, causal=True), eager)
