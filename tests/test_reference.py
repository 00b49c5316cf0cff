"""Tests of dash.reference, the attention oracle (CPU; a CUDA check runs when a GPU is present)."""

from __future__ import annotations

import math
import re
from functools import lru_cache

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import dash.reference as ref
from dash.config import bwd_tile_config
from dash.reference import (
    assert_within_bound,
    assert_within_bound_blocks,
    attention_backward,
    attention_forward,
    default_floor,
    error_bound,
)

F64 = torch.float64


# ----------------------------------------------------------------------------- naive oracle


@lru_cache(maxsize=None)
def _loop_mask(Sq: int, Sk: int, causal: bool, wl: int, wr: int) -> torch.Tensor:
    """Visibility mask written element by element, independently of the library."""
    if causal:
        wr = 0
    rows = []
    for i in range(Sq):
        row = []
        for j in range(Sk):
            rel = j - (i + Sk - Sq)  # key offset from the bottom-right aligned diagonal
            ok = True
            if wl >= 0 and rel < -wl:
                ok = False
            if wr >= 0 and rel > wr:
                ok = False
            row.append(ok)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool).reshape(Sq, Sk)


def naive_attention(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0):
    """Differentiable float64 attention; returns (out, lse, mask)."""
    B, Sq, Hq, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    G = Hq // Hk
    kr = k.repeat_interleave(G, dim=2)
    vr = v.repeat_interleave(G, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q * scale, kr)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    mask = _loop_mask(Sq, Sk, causal, window[0], window[1]).to(q.device)
    s_masked = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s_masked, dim=-1)
    row_any = mask.any(dim=-1, keepdim=True)
    s_safe = torch.where(row_any, s_masked, torch.zeros_like(s))
    p = torch.softmax(s_safe, dim=-1) * row_any
    out = torch.einsum("bhqk,bkhd->bqhd", p, vr)
    return out, lse, mask


def make_inputs(B, Sq, Sk, Hq, Hk, D, Dv, dtype=F64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, Hq, D, generator=g, dtype=F64)
    k = torch.randn(B, Sk, Hk, D, generator=g, dtype=F64)
    v = torch.randn(B, Sk, Hk, Dv, generator=g, dtype=F64)
    dout = torch.randn(B, Sq, Hq, Dv, generator=g, dtype=F64)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)]


def autograd_reference(q, k, v, dout, scale, causal, window, softcap):
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse, mask = naive_attention(qq, kk, vv, scale, causal, window, softcap)
    dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), dout)
    return out.detach(), lse.detach(), mask, dq, dk, dv


def assert_close64(actual, expected, name, atol=1e-11, rtol=1e-9):
    assert actual.dtype == F64, f"{name}: dtype {actual.dtype}"
    assert not torch.isnan(actual).any(), f"{name}: NaN"
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=False, msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------- grid vs autograd

SEQ_SHAPES = [(1, 1), (239, 1), (113, 203), (17, 64), (64, 17)]
MODES = {
    "full": dict(causal=False, window=(-1, -1), softcap=0.0),
    "causal": dict(causal=True, window=(-1, -1), softcap=0.0),
    "window": dict(causal=False, window=(5, 3), softcap=0.0),
    "window_left_only": dict(causal=False, window=(6, -1), softcap=0.0),
    "window_right_only": dict(causal=False, window=(-1, 2), softcap=0.0),
    "causal_window": dict(causal=True, window=(9, 4), softcap=0.0),  # causal overrides wr
    "softcap": dict(causal=False, window=(-1, -1), softcap=2.5),
    "softcap_causal_window": dict(causal=True, window=(11, -1), softcap=5.0),
}
# (B, Hq, Hk, D, Dv): MHA, GQA, MQA, D != Dv both ways.
HEAD_CONFIGS = [(2, 2, 2, 16, 16), (2, 6, 2, 16, 8), (2, 4, 1, 8, 24)]


@pytest.mark.parametrize("seq", SEQ_SHAPES, ids=lambda s: f"sq{s[0]}_sk{s[1]}")
@pytest.mark.parametrize("mode", list(MODES))
def test_forward_backward_match_autograd(seq, mode):
    Sq, Sk = seq
    cfg = MODES[mode]
    idx = (SEQ_SHAPES.index(seq) + list(MODES).index(mode)) % len(HEAD_CONFIGS)
    B, Hq, Hk, D, Dv = HEAD_CONFIGS[idx]
    q, k, v, dout = make_inputs(B, Sq, Sk, Hq, Hk, D, Dv, seed=Sq * 1000 + Sk)
    scale = 1.0 / math.sqrt(D)
    # softcap runs use a larger scale so that the tanh really saturates
    if cfg["softcap"] > 0:
        scale = 1.3
    out_e, lse_e, mask, dq_e, dk_e, dv_e = autograd_reference(
        q, k, v, dout, scale, cfg["causal"], cfg["window"], cfg["softcap"]
    )
    kwargs = dict(
        softmax_scale=scale if cfg["softcap"] > 0 else None,  # None exercises the default
        causal=cfg["causal"],
        window_size=cfg["window"],
        softcap=cfg["softcap"],
        compute_dtype=F64,
    )
    out, lse = attention_forward(q, k, v, **kwargs)
    assert out.shape == (B, Sq, Hq, Dv) and lse.shape == (B, Hq, Sq)
    assert lse.dtype == F64
    assert_close64(out, out_e, "out")
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_e)), "lse -inf pattern"
    assert_close64(lse, lse_e, "lse")

    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, **kwargs)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert_close64(dq, dq_e, "dq")
    assert_close64(dk, dk_e, "dk")
    assert_close64(dv, dv_e, "dv")

    # Fully masked rows: zeros, -inf lse, zero dq, and no NaN anywhere.
    empty_rows = ~mask.any(dim=-1)
    if bool(empty_rows.any()):
        assert torch.all(out[:, empty_rows] == 0)
        assert torch.all(lse[:, :, empty_rows] == float("-inf"))
        assert torch.all(dq[:, empty_rows] == 0)
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all()


def test_grid_has_fully_masked_rows():
    """The grid above really covers rows that see no key (so the checks in it bite)."""
    assert not _loop_mask(64, 17, True, -1, -1)[:47].any()
    assert _loop_mask(64, 17, True, -1, -1)[47:].any(dim=-1).all()
    assert (~_loop_mask(239, 1, False, 5, 3).any(dim=-1)).sum() == 239 - 4
    assert (~_loop_mask(64, 17, False, -1, 2).any(dim=-1)).sum() == 64 - 17 - 2


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 2),
    Sq=st.integers(1, 24),
    Sk=st.integers(1, 24),
    Hk=st.integers(1, 2),
    G=st.integers(1, 3),
    D=st.integers(1, 9),
    Dv=st.integers(1, 9),
    causal=st.booleans(),
    wl=st.integers(-1, 6),
    wr=st.integers(-1, 6),
    softcap=st.sampled_from([0.0, 0.0, 1.5]),
    scale=st.sampled_from([None, 0.3, 2.0]),
    seed=st.integers(0, 2**16),
)
def test_property_random_shapes(B, Sq, Sk, Hk, G, D, Dv, causal, wl, wr, softcap, scale, seed):
    Hq = Hk * G
    q, k, v, dout = make_inputs(B, Sq, Sk, Hq, Hk, D, Dv, seed=seed)
    eff_scale = 1.0 / math.sqrt(D) if scale is None else scale
    out_e, lse_e, _, dq_e, dk_e, dv_e = autograd_reference(q, k, v, dout, eff_scale, causal, (wl, wr), softcap)
    kw = dict(softmax_scale=scale, causal=causal, window_size=(wl, wr), softcap=softcap, compute_dtype=F64)
    out, lse = attention_forward(q, k, v, **kw)
    assert_close64(out, out_e, "out")
    assert_close64(lse, lse_e, "lse")
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, **kw)
    assert_close64(dq, dq_e, "dq")
    assert_close64(dk, dk_e, "dk")
    assert_close64(dv, dv_e, "dv")


# ----------------------------------------------------------------------------- independent checks


@pytest.mark.parametrize(
    "Sq,Sk,causal,window",
    [(33, 47, False, (-1, -1)), (47, 33, True, (-1, -1)), (40, 40, False, (4, 7)), (50, 30, False, (3, 0))],
)
def test_lse_matches_logsumexp_and_out_matches_sdpa(Sq, Sk, causal, window):
    B, Hq, Hk, D, Dv = 2, 4, 2, 16, 12
    q, k, v, _ = make_inputs(B, Sq, Sk, Hq, Hk, D, Dv, seed=7)
    scale = 0.37
    out, lse = attention_forward(q, k, v, softmax_scale=scale, causal=causal, window_size=window, compute_dtype=F64)

    mask = _loop_mask(Sq, Sk, causal, *window)
    G = Hq // Hk
    qh = q.permute(0, 2, 1, 3)  # (B, Hq, Sq, D)
    kh = k.permute(0, 2, 1, 3).repeat_interleave(G, dim=1)
    vh = v.permute(0, 2, 1, 3).repeat_interleave(G, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) * scale
    expected_lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
    torch.testing.assert_close(lse, expected_lse, atol=1e-12, rtol=1e-12)

    sdpa = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale).permute(0, 2, 1, 3)
    rows = mask.any(dim=-1)  # SDPA's value for rows that see nothing is not specified
    torch.testing.assert_close(out[:, rows], sdpa[:, rows], atol=1e-12, rtol=1e-10)
    assert torch.all(out[:, ~rows] == 0)


def test_softcap_scale_is_inside_tanh():
    """s = softcap * tanh(scale * q.k / softcap), and lse is over those capped scores."""
    q = torch.tensor([[[[2.0, -1.0]]]], dtype=F64)  # (1, 1, 1, 2)
    k = torch.tensor([[[[1.5, 0.5]]], [[[-0.5, 3.0]]]], dtype=F64).reshape(1, 2, 1, 2)
    v = torch.tensor([[[[1.0]]], [[[-2.0]]]], dtype=F64).reshape(1, 2, 1, 1)
    scale, cap = 0.8, 1.7
    x = torch.tensor([2.0 * 1.5 - 0.5, -1.0 - 3.0], dtype=F64) * scale
    s = cap * torch.tanh(x / cap)
    p = torch.softmax(s, dim=0)
    out, lse = attention_forward(q, k, v, softmax_scale=scale, softcap=cap, compute_dtype=F64)
    assert math.isclose(float(lse), float(torch.logsumexp(s, 0)), rel_tol=1e-14)
    assert math.isclose(float(out), float(p[0] * 1.0 + p[1] * -2.0), rel_tol=1e-14)


def test_backward_accepts_plus_inf_lse_for_empty_rows():
    """FA3's kernels store +inf as the lse of fully masked rows; the backward treats ±inf alike."""
    q, k, v, dout = make_inputs(1, 20, 6, 2, 1, 8, 8, seed=3)
    out, lse = attention_forward(q, k, v, causal=True, compute_dtype=F64)
    assert torch.isneginf(lse).any()
    grads_neg = attention_backward(dout, q, k, v, out, lse, causal=True, compute_dtype=F64)
    lse_pos = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    grads_pos = attention_backward(dout, q, k, v, out, lse_pos, causal=True, compute_dtype=F64)
    for a, b in zip(grads_neg, grads_pos):
        assert torch.equal(a, b)
        assert torch.isfinite(a).all()


def test_empty_key_sequence():
    q, k, v, dout = make_inputs(2, 5, 0, 2, 2, 4, 3, seed=1)
    out, lse = attention_forward(q, k, v, compute_dtype=F64)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, compute_dtype=F64)
    assert torch.all(dq == 0) and dk.shape == k.shape and dv.shape == v.shape


def test_chunking_matches_single_chunk(monkeypatch):
    q, k, v, dout = make_inputs(2, 37, 29, 6, 2, 8, 5, seed=11)
    kw = dict(causal=True, window_size=(6, -1), softcap=3.0, softmax_scale=0.9)
    for dtype, tol in ((F64, 1e-13), (torch.float32, 1e-5), (torch.bfloat16, 0.0)):
        out1, lse1 = attention_forward(q, k, v, compute_dtype=dtype, **kw)
        g1 = attention_backward(dout, q, k, v, out1, lse1, compute_dtype=dtype, **kw)
        with monkeypatch.context() as m:
            m.setattr(ref, "CHUNK_ELEMENTS", 3 * 29 * 5)  # 5 rows of one KV head's group per chunk
            assert len(list(ref._chunks(2, 2, 3, 37, 29))) == 2 * 2 * 8
            out2, lse2 = attention_forward(q, k, v, compute_dtype=dtype, **kw)
            g2 = attention_backward(dout, q, k, v, out1, lse1, compute_dtype=dtype, **kw)
        torch.testing.assert_close(out2, out1, atol=tol, rtol=tol)
        torch.testing.assert_close(lse2, lse1, atol=tol, rtol=tol)
        for a, b in zip(g2, g1):
            # bf16 dk/dv are float32 accumulations rounded once: chunk order may move the last bit
            t = 2 ** -7 * b.abs().max().item() if dtype == torch.bfloat16 else tol
            torch.testing.assert_close(a, b, atol=t, rtol=0)


def test_float32_close_to_float64_and_tf32_setting_restored():
    q, k, v, dout = make_inputs(2, 45, 60, 4, 2, 32, 32, seed=5)
    kw = dict(causal=True, window_size=(20, -1))
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        o32, l32 = attention_forward(q.float(), k.float(), v.float(), compute_dtype=torch.float32, **kw)
        g32 = attention_backward(dout.float(), q.float(), k.float(), v.float(), o32, l32, compute_dtype=torch.float32, **kw)
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(previous)
    o64, l64 = attention_forward(q, k, v, compute_dtype=F64, **kw)
    g64 = attention_backward(dout, q, k, v, o64, l64, compute_dtype=F64, **kw)
    assert o32.dtype == l32.dtype == torch.float32
    torch.testing.assert_close(o32.double(), o64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l32.double(), l64, atol=1e-5, rtol=1e-5)
    for a, b in zip(g32, g64):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)


def test_input_validation():
    q, k, v, _ = make_inputs(1, 4, 4, 3, 2, 8, 8)
    with pytest.raises(ValueError, match="multiple"):
        attention_forward(q, k, v)
    q, k, v, _ = make_inputs(1, 4, 4, 2, 2, 8, 8)
    with pytest.raises(ValueError, match="compute_dtype"):
        attention_forward(q, k, v, compute_dtype=torch.int32)
    with pytest.raises(ValueError, match="softcap"):
        attention_forward(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError):
        attention_forward(q, k[:, :, :, :4], v)


# ----------------------------------------------------------------------------- low precision


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap", [0.0, 4.0])
def test_low_precision_really_computes_in_low_precision(low, softcap):
    B, Sq, Sk, Hq, Hk, D, Dv = 2, 70, 90, 4, 2, 64, 64
    q, k, v, dout = make_inputs(B, Sq, Sk, Hq, Hk, D, Dv, dtype=low, seed=21)  # kernel-like inputs
    kw = dict(causal=True, window_size=(40, -1), softcap=softcap)
    o64, l64 = attention_forward(q, k, v, compute_dtype=F64, **kw)
    g64 = attention_backward(dout, q, k, v, o64, l64, compute_dtype=F64, **kw)
    olo, llo = attention_forward(q, k, v, compute_dtype=low, **kw)
    glo = attention_backward(dout, q, k, v, olo, llo, compute_dtype=low, **kw)

    assert olo.dtype == low and llo.dtype == torch.float32
    assert all(g.dtype == low for g in glo)
    eps = torch.finfo(low).eps
    # Loosely close to float64 ...
    for name, lo, hi in [("out", olo, o64), ("dq", glo[0], g64[0]), ("dk", glo[1], g64[1]), ("dv", glo[2], g64[2])]:
        assert torch.isfinite(lo).all(), name
        err = (lo.double() - hi).abs().max().item()
        scale_ = hi.abs().max().item()
        assert err <= 40 * eps * scale_, f"{name}: {err} vs scale {scale_}"
        # ... but not merely float64 rounded to the low dtype: the arithmetic itself is low precision.
        assert not torch.equal(lo, hi.to(low)), name
        assert err > 1.0 * eps * scale_ / 4, name
    finite = torch.isfinite(l64)
    lse_err = (llo.double() - l64)[finite].abs().max().item()
    assert 1e-5 < lse_err < 0.1  # scores were rounded to the low dtype
    assert torch.equal(torch.isinf(llo), torch.isinf(l64))


def test_low_precision_rounds_p_before_pv_and_ptdo():
    """P is rounded to bf16 before P @ V and P^T @ dO (as attention_ref(upcast=False) does).

    Row 0 has scores [2^-10, 0]: P = [0.5 + 2^-12, 0.5 - 2^-12] rounds to [0.5, 0.5] in bf16.
    Row 1 has scores [0, 0]: P = [0.5, 0.5] exactly.
    """
    d = 2.0**-10
    q = torch.tensor([d, 0.0], dtype=torch.bfloat16).reshape(1, 2, 1, 1)
    k = torch.tensor([1.0, 0.0], dtype=torch.bfloat16).reshape(1, 2, 1, 1)
    v = torch.tensor([1.0, -1.0], dtype=torch.bfloat16).reshape(1, 2, 1, 1)
    dout = torch.tensor([1.0, -1.0], dtype=torch.bfloat16).reshape(1, 2, 1, 1)
    kw = dict(softmax_scale=1.0)
    o64, l64 = attention_forward(q, k, v, compute_dtype=F64, **kw)
    assert float(o64[0, 0]) == pytest.approx(math.tanh(d / 2), rel=1e-12)
    olo, llo = attention_forward(q, k, v, compute_dtype=torch.bfloat16, **kw)
    assert float(olo[0, 0]) == 0.0 and float(olo[0, 1]) == 0.0
    _, _, dv64 = attention_backward(dout, q, k, v, o64, l64, compute_dtype=F64, **kw)
    _, _, dvlo = attention_backward(dout, q, k, v, olo, llo, compute_dtype=torch.bfloat16, **kw)
    assert float(dv64[0, 0]) == pytest.approx(2.0**-12, rel=1e-3)
    assert float(dvlo[0, 0]) == 0.0


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_fa3_rule_accepts_fp32_kernel_model_and_rejects_perturbed(low):
    """A kernel modelled as 'float32 math, output rounded to the low dtype' passes the rule
    against (float64, low) references, and a visibly wrong result does not."""
    q, k, v, dout = make_inputs(2, 64, 80, 4, 1, 64, 64, dtype=low, seed=99)
    kw = dict(causal=True, softcap=0.0)
    o64, l64 = attention_forward(q, k, v, compute_dtype=F64, **kw)
    g64 = attention_backward(dout, q, k, v, o64, l64, compute_dtype=F64, **kw)
    olo, llo = attention_forward(q, k, v, compute_dtype=low, **kw)
    glo = attention_backward(dout, q, k, v, olo, llo, compute_dtype=low, **kw)
    o32, l32 = attention_forward(q, k, v, compute_dtype=torch.float32, **kw)
    g32 = attention_backward(dout, q, k, v, o32.to(low), l32, compute_dtype=torch.float32, **kw)

    assert_within_bound(o32.to(low), o64, olo, "out")
    assert_within_bound(l32, l64, llo, "lse")
    for name, a, hi, lo in zip(("dq", "dk", "dv"), g32, g64, glo):
        assert_within_bound(a.to(low), hi, lo, name)
        # a low-order-bit bug in one element (e.g. a wrong mask at one key) must be caught
        bad = a.to(low).clone()
        bad.view(-1)[17] += 5 * error_bound(hi, lo)
        with pytest.raises(AssertionError, match=name):
            assert_within_bound(bad, hi, lo, name)


# ----------------------------------------------------------------------------- error rule


def test_error_bound_formula_and_default_floor():
    hi = torch.tensor([1.0, -4.0, 0.5], dtype=F64)
    lo = torch.tensor([1.0078125, -4.0, 0.5], dtype=torch.bfloat16)
    eps = torch.finfo(torch.bfloat16).eps
    assert default_floor(hi, torch.bfloat16) == pytest.approx(eps * 4.0)
    assert error_bound(hi, lo, factor=3.0, floor=0.25) == pytest.approx(3 * 0.0078125 + 0.25)
    assert error_bound(hi, lo) == pytest.approx(2 * 0.0078125 + eps * 4.0)
    # non-finite reference entries (masked-row lse) are left out
    hi_inf = torch.tensor([float("-inf"), 1.0], dtype=F64)
    lo_inf = torch.tensor([float("-inf"), 1.5], dtype=torch.float32)
    assert error_bound(hi_inf, lo_inf, floor=0.0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        error_bound(torch.tensor([1.0], dtype=F64), torch.tensor([float("nan")]))


def test_assert_within_bound_reports_name_error_bound_and_location():
    g = torch.Generator().manual_seed(0)
    hi = torch.randn(3, 4, 5, generator=g, dtype=F64)
    lo = (hi + 1e-3 * torch.randn(3, 4, 5, generator=g, dtype=F64)).to(torch.float32)
    err, bound = assert_within_bound(hi.float(), hi, lo, "dk_ok")
    assert err <= bound
    actual = hi.clone()
    actual[1, 2, 3] += 1.0
    with pytest.raises(AssertionError) as info:
        assert_within_bound(actual, hi, lo, "dk_bad")
    msg = str(info.value)
    assert "dk_bad" in msg and "(1, 2, 3)" in msg and "exceeds bound" in msg
    assert f"{error_bound(hi, lo):.6e}" in msg


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), float("-inf")])
def test_assert_within_bound_fails_on_non_finite(bad_value):
    hi = torch.linspace(-1, 1, 12, dtype=F64).reshape(3, 4)
    lo = hi.to(torch.bfloat16)
    actual = hi.clone()
    actual[2, 1] = bad_value
    with pytest.raises(AssertionError, match=r"lse_nan.*non-finite.*\(2, 1\)"):
        assert_within_bound(actual, hi, lo, "lse_nan", factor=1e9, floor=1e9)


def test_assert_within_bound_non_finite_reference_entries():
    hi = torch.tensor([[float("-inf"), 0.5], [1.0, 2.0]], dtype=F64)
    lo = hi.float()
    assert_within_bound(hi.clone(), hi, lo, "lse")  # -inf where the reference is -inf: fine
    wrong = hi.clone()
    wrong[0, 0] = 0.0
    with pytest.raises(AssertionError, match="lse.*non-finite"):
        assert_within_bound(wrong, hi, lo, "lse")
    with pytest.raises(AssertionError, match="shape"):
        assert_within_bound(hi[:1], hi, lo, "lse")


# ----------------------------------------------------------------------------- the rule per block


def _kernel_like_backward(dout, q, k, v, out, lse, causal, low):
    """A correct kernel's arithmetic (FA3's backward), per head: float32 scores, P and dP (not
    rounded, unlike the low reference), D = rowsum(dO * O) in float32, P and dS rounded to
    ``low`` before the products, float32 accumulation, results rounded to ``low`` once."""
    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    G = H // Hk
    scale = D**-0.5
    mask = ref.visibility_mask(Sq, Sk, causal)
    dq = torch.zeros(B, Sq, H, D)
    dk = torch.zeros(B, Sk, Hk, D)
    dv = torch.zeros(B, Sk, Hk, v.shape[3])
    for b in range(B):
        for h in range(H):
            qh, kh, vh = q[b, :, h].float(), k[b, :, h // G].float(), v[b, :, h // G].float()
            doh, oh, lh = dout[b, :, h].float(), out[b, :, h].float(), lse[b, h].float()
            lh = torch.where(torch.isfinite(lh), lh, torch.full_like(lh, float("inf")))  # P = 0 on empty rows
            p = torch.exp(qh @ kh.T * scale - lh[:, None])
            if mask is not None:
                p = torch.where(mask, p, torch.zeros_like(p))
            ds = (p * (doh @ vh.T - (doh * oh).sum(-1, keepdim=True))).to(low).float()
            dq[b, :, h] = ds @ kh * scale
            dk[b, :, h // G] += ds.T @ qh * scale
            dv[b, :, h // G] += p.to(low).float().T @ doh
    return dq.to(low), dk.to(low), dv.to(low)


def _block_case(B, H, Sq, Sk, D, causal, low, seed):
    """Kernel-like inputs (rounded to ``low``), the forward a kernel would store (float64
    reference, out rounded, lse float32) and the (float64, low) backward references."""
    q, k, v, dout = make_inputs(B, Sq, Sk, H, H, D, D, dtype=low, seed=seed)
    out, lse = attention_forward(q, k, v, causal=causal, compute_dtype=F64)
    out, lse = out.to(low), lse.float()
    hi = attention_backward(dout, q, k, v, out, lse, causal=causal, compute_dtype=F64)
    lo = attention_backward(dout, q, k, v, out, lse, causal=causal, compute_dtype=low)
    return (q, k, v, dout, out, lse), hi, lo


def _plant(kind, inputs, hi, causal, q_tile, column, b=0, h=0):
    """``hi`` of one gradient with a scheduling bug planted at (batch b, head h), for the tiles
    of ``bwd_tile_config``: Q tile ``q_tile`` lost (``dq_lost``) or got twice (``dq_twice``) the
    dQ partial of column ``column``, or that column's dK (``dk_lost``) or dV (``dv_lost``) lost
    the Q tile's contribution. Returns (index of the gradient, bugged tensor, block rows)."""
    q, k, v, dout, out, lse = inputs
    Sq, Sk, D = q.shape[1], k.shape[1], q.shape[3]
    cfg = bwd_tile_config(D, causal)
    r0, r1 = q_tile * cfg.block_m, min(Sq, (q_tile + 1) * cfg.block_m)
    c0, c1 = column * cfg.block_n, min(Sk, (column + 1) * cfg.block_n)
    scale = D**-0.5
    qh, kh, vh, doh, oh = (t[b, :, h].double() for t in (q, k, v, dout, out))
    p = torch.exp(qh[r0:r1] @ kh[c0:c1].T * scale - lse[b, h, r0:r1].double()[:, None])
    mask = ref.visibility_mask(Sq, Sk, causal, row_start=r0, row_end=r1)
    if mask is not None:
        p = torch.where(mask[:, c0:c1], p, torch.zeros_like(p))
    p = torch.nan_to_num(p, nan=0.0)  # rows that see no key: lse -inf
    ds = p * (doh[r0:r1] @ vh[c0:c1].T - (doh[r0:r1] * oh[r0:r1]).sum(-1, keepdim=True))
    assert p.abs().sum() > 0, "the column does not contribute to the Q tile: nothing to lose"
    if kind in ("dq_lost", "dq_twice"):
        bad = hi[0].clone()
        bad[b, r0:r1, h] += (-1 if kind == "dq_lost" else 1) * scale * ds @ kh[c0:c1]
        return 0, bad, cfg.block_m
    if kind == "dk_lost":
        bad = hi[1].clone()
        bad[b, c0:c1, h] -= scale * ds.T @ qh[r0:r1]
        return 1, bad, cfg.block_n
    bad = hi[2].clone()
    bad[b, c0:c1, h] -= p.T @ doh[r0:r1]
    return 2, bad, cfg.block_n


# (B, H, Sq, Sk, head_dim, causal, dtype); seqlen_q > seqlen_k causal: whole Q tiles see no key (500 x 200:
# the 2 first of 4 at hdim 64; 239 x 1: 3 of 4 at hdim 128, whose last holds one row seeing one key)
BLOCK_CASES = [
    (2, 2, 384, 384, 128, True, torch.bfloat16),
    (2, 2, 384, 384, 64, False, torch.bfloat16),
    (1, 2, 500, 200, 64, True, torch.bfloat16),
    (2, 3, 239, 1, 128, True, torch.bfloat16),
    (1, 2, 300, 333, 128, True, torch.float16),
]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: "b{}h{}_{}x{}_d{}_causal{}_{}".format(
    *c[:6], str(c[6]).split(".")[-1]))
def test_block_rule_passes_correct_kernel_stand_ins(case):
    """Two stand-ins for a correct kernel pass the per-tile rule with room to spare: the kernel's
    arithmetic (float32 P and dP, P and dS rounded) and the float32 reference rounded once."""
    *shape, low = case
    inputs, hi, lo = _block_case(*shape, low, seed=sum(shape))
    q, k, v, dout, out, lse = inputs
    D, causal = shape[4], shape[5]
    cfg = bwd_tile_config(D, causal)
    f32 = attention_backward(dout, q, k, v, out, lse, causal=causal, compute_dtype=torch.float32)
    stand_ins = {"kernel-like": _kernel_like_backward(dout, q, k, v, out, lse, causal, low),
                 "float32 rounded": [g.to(low) for g in f32]}
    for label, grads in stand_ins.items():
        for name, g, h, l, rows in zip(("dq", "dk", "dv"), grads, hi, lo, (cfg.block_m, cfg.block_n, cfg.block_n)):
            assert_within_bound(g, h, l, f"{label} {name}")
            err, bound = assert_within_bound_blocks(g, h, l, f"{label} {name}", rows)
            # measured 0.26 at most here, 0.23 at 4224 x 4224 causal: a correct kernel is far from the bound
            assert err <= 0.5 * bound, f"{label} {name}: {err:.3e} vs block bound {bound:.3e}"
    if shape[2] > shape[3] and causal:  # the tiles that see no key are 0, their bound only the global share
        assert torch.all(stand_ins["kernel-like"][0][:, : shape[2] - shape[3]] == 0)


# (case index, Q tile, column): a middle Q tile with its first and its last (diagonal) column.
PLANTED = [(0, 3, 0), (0, 3, 1), (1, 1, 0), (1, 1, 2), (2, 2, 0), (2, 3, 1), (4, 3, 0), (4, 3, 2)]


@pytest.mark.parametrize("kind", ["dq_lost", "dq_twice", "dk_lost", "dv_lost"])
@pytest.mark.parametrize("plant", PLANTED, ids=lambda p: "case{}_m{}_n{}".format(*p))
def test_block_rule_catches_one_lost_tile_partial(plant, kind):
    """Each scheduling bug of the review (one dQ partial of one Q tile lost or added twice; one
    column's dK or dV missing one Q tile) fails the per-tile rule, by a wide margin."""
    index, q_tile, column = plant
    *shape, low = BLOCK_CASES[index]
    inputs, hi, lo = _block_case(*shape, low, seed=sum(shape))
    i, bad, rows = _plant(kind, inputs, hi, shape[5], q_tile, column, b=shape[0] - 1, h=1)
    name = ("dq", "dk", "dv")[i]
    with pytest.raises(AssertionError, match=rf"{name}: 1 of \d+ blocks of {rows} rows exceed") as info:
        assert_within_bound_blocks(bad.to(low), hi[i], lo[i], name, rows)
    ratio = float(re.search(r"\(([0-9.e+]+)x; =", str(info.value)).group(1))  # the worst block's error / bound
    assert ratio > 3, str(info.value)


def test_block_rule_sees_what_the_global_rule_misses():
    """At a long causal shape the global maximum is set by the first Q tiles' dq and the last
    columns' dk/dv; a bug in a late tile stays under the global bound but not under its own
    (3072 x 3072, hdim 128: Q tiles of 64 rows, columns of 128 keys)."""
    inputs, hi, lo = _block_case(1, 1, 3072, 3072, 128, True, torch.bfloat16, seed=1)
    for kind, q_tile, column in (("dq_lost", 46, 23), ("dk_lost", 46, 23), ("dv_lost", 47, 23)):
        i, bad, rows = _plant(kind, inputs, hi, True, q_tile, column)
        bad = bad.to(torch.bfloat16)
        err, bound = assert_within_bound(bad, hi[i], lo[i], kind)  # the global rule passes ...
        assert err > 0.3 * bound, kind  # ... though the bug is not small
        with pytest.raises(AssertionError, match=f"{kind}: 1 of"):  # ... the per-tile rule does not
            assert_within_bound_blocks(bad, hi[i], lo[i], kind, rows)


def test_block_rule_floor_for_blocks_with_a_zero_reference():
    """A block whose references are all zero (dq of a Q tile that sees no key) passes zeros and
    float32-level noise (BLOCK_GLOBAL_SHARE of the global bound), not a visible error."""
    g = torch.Generator().manual_seed(3)
    hi = torch.randn(2, 256, 3, 16, generator=g, dtype=F64)
    hi[1, :64, 2] = 0.0  # batch 1, rows 0:64, head 2
    lo = hi.to(torch.bfloat16)
    actual = hi.to(torch.bfloat16)
    global_bound = error_bound(hi, lo, floor=default_floor(hi, torch.bfloat16))
    assert_within_bound_blocks(actual, hi, lo, "dq", 64)
    actual[1, 5, 2, 7] = 2**-20 * global_bound  # noise of a float32 cancellation: passes
    assert_within_bound_blocks(actual, hi, lo, "dq", 64)
    actual[1, 5, 2, 7] = 0.1 * global_bound  # visible: fails, and the message says where
    with pytest.raises(AssertionError) as info:
        assert_within_bound_blocks(actual, hi, lo, "dq", 64)
    msg = str(info.value)
    assert "dq: 1 of 24 blocks of 64 rows" in msg and "batch 1, rows 0:64, head 2" in msg
    assert "(1, 5, 2, 7)" in msg
    assert ref.BLOCK_GLOBAL_SHARE * global_bound < 0.1 * global_bound


def test_block_rule_ragged_tail_shapes_and_non_finite():
    hi = torch.linspace(-1, 1, 2 * 130 * 2 * 4, dtype=F64).reshape(2, 130, 2, 4)
    lo = hi.to(torch.bfloat16)
    actual = hi.to(torch.bfloat16).clone()
    actual[0, 129, 1, 3] += 0.25  # in the ragged last block (rows 128:130)
    with pytest.raises(AssertionError, match=r"rows 128:130, head 1"):
        assert_within_bound_blocks(actual, hi, lo, "dk", 64)
    actual[0, 129, 1, 3] = float("nan")
    with pytest.raises(AssertionError, match="dk: 1 non-finite"):
        assert_within_bound_blocks(actual, hi, lo, "dk", 64)
    with pytest.raises(AssertionError, match="shape"):
        assert_within_bound_blocks(actual[:, :64], hi, lo, "dk", 64)
    with pytest.raises(ValueError, match="seq_block"):
        assert_within_bound_blocks(hi, hi, lo, "dk", 0)


# ----------------------------------------------------------------------------- device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    kw = dict(causal=True, window_size=(30, -1), softcap=3.0)
    for dtype in (F64, torch.float32, torch.bfloat16):
        q, k, v, dout = make_inputs(2, 100, 130, 8, 2, 64, 64, seed=4)
        oc, lc = attention_forward(q, k, v, compute_dtype=dtype, **kw)
        gc = attention_backward(dout, q, k, v, oc, lc, compute_dtype=dtype, **kw)
        qd, kd, vd, dd = (t.cuda() for t in (q, k, v, dout))
        og, lg = attention_forward(qd, kd, vd, compute_dtype=dtype, **kw)
        gg = attention_backward(dd, qd, kd, vd, og, lg, compute_dtype=dtype, **kw)
        tol = 1e-12 if dtype == F64 else (1e-5 if dtype == torch.float32 else 2e-2)
        for a, b in zip((og, lg, *gg), (oc, lc, *gc)):
            assert a.is_cuda
            torch.testing.assert_close(a.cpu(), b, atol=tol, rtol=tol)
