"""GPU tests of DASH's Hopper backward against dash.reference (skipped without an sm_90 GPU).

Accuracy rule (FA3's): max |kernel - ref_f64| <= 2 * max |ref_lowp - ref_f64| + floor, where
ref_lowp is the same computation done by PyTorch in the input precision.
Determinism: bitwise torch.equal over many repeated calls, fresh random inputs per test.
"""

from __future__ import annotations

import os

import pytest
import torch

from dash import reference
from dash.api import attention_backward, flash_attn_func

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SEQLEN_PAIRS = [(1, 1), (239, 1), (113, 203), (64, 128), (128, 64), (1023, 1024), (1000, 777), (4224, 4224)]


def _inputs(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, seqlen_k, heads_k, head_dim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, seqlen_k, heads_k, head_dim, device="cuda", dtype=dtype, generator=gen)
    dout = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    return q, k, v, dout


def _forward(q, k, v, causal):
    """Exact forward (float64 reference), O rounded to the input dtype as a kernel would store it."""
    out, lse = reference.attention_forward(q, k, v, causal=causal, compute_dtype=torch.float64)
    return out.to(q.dtype), lse.float()


def _check_against_reference(q, k, v, dout, out, lse, causal, grads, label):
    hi = reference.attention_backward(dout, q, k, v, out, lse, causal=causal, compute_dtype=torch.float64)
    lo = reference.attention_backward(dout, q, k, v, out, lse, causal=causal, compute_dtype=q.dtype)
    for name, g, h, l in zip(("dq", "dk", "dv"), grads, hi, lo):
        assert g.shape == h.shape and g.dtype == q.dtype, f"{label} {name}: shape/dtype {g.shape} {g.dtype}"
        reference.assert_within_bound(g, h, l, f"{label} {name}")


def _seed(*parts) -> int:
    return abs(hash(parts)) % (2**31) + int.from_bytes(os.urandom(2), "little")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("seqlens", SEQLEN_PAIRS)
def test_backward_matches_reference(seqlens, deterministic, causal, head_dim, dtype):
    if dtype == "fp16" and seqlens not in [(113, 203), (1023, 1024)]:
        pytest.skip("fp16 runs on a subset of shapes")
    seqlen_q, seqlen_k = seqlens
    batch, heads = (1, 2) if seqlen_q * seqlen_k > 10**6 else (2, 3)
    q, k, v, dout = _inputs(batch, seqlen_q, seqlen_k, heads, heads, head_dim, DTYPES[dtype], _seed(seqlens, causal))
    out, lse = _forward(q, k, v, causal)
    grads = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)
    _check_against_reference(q, k, v, dout, out, lse, causal, grads, f"{seqlens} causal={causal} d={head_dim}")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_one_head_one_batch_and_gqa(head_dim):
    for heads, heads_k, causal in [(1, 1, False), (1, 1, True), (8, 2, True), (6, 1, False)]:
        q, k, v, dout = _inputs(1, 300, 333, heads, heads_k, head_dim, torch.bfloat16, _seed(heads, heads_k))
        out, lse = _forward(q, k, v, causal)
        grads = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
        _check_against_reference(q, k, v, dout, out, lse, causal, grads, f"H={heads} Hk={heads_k}")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_every_output_element_written(head_dim, causal, monkeypatch):
    """dq/dk/dv are filled with NaN before the launch (DASH_POISON_OUTPUTS); none may survive."""
    monkeypatch.setenv("DASH_POISON_OUTPUTS", "1")
    q, k, v, dout = _inputs(2, 333, 517, 2, 2, head_dim, torch.bfloat16, _seed("poison"))
    out, lse = _forward(q, k, v, causal)
    for deterministic in (False, True):
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)
        for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
            assert torch.isfinite(g).all(), f"{name} has unwritten (NaN) elements"


def test_poison_bytes_decode_as_nan():
    """The poison hook writes all-ones bytes; the test above relies on that being NaN."""
    for dt in (torch.bfloat16, torch.float16):
        assert torch.isnan(torch.full((8,), 255, dtype=torch.uint8, device="cuda").view(dt)).all()


def _bitwise_repeats(q, k, v, dout, out, lse, causal, repeats, side_stream_work=False):
    ref = [t.clone() for t in attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)]
    side = torch.cuda.Stream() if side_stream_work else None
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) if side_stream_work else None
    for i in range(repeats):
        if side is not None:
            with torch.cuda.stream(side):
                for _ in range(4):
                    a = (a @ a).clamp_(-1, 1)
        grads = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
        for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
            assert torch.equal(g, r), f"repeat {i}: {name} differs bitwise from the first call"
    torch.cuda.synchronize()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_bitwise_100_repeats(head_dim, causal):
    q, k, v, dout = _inputs(2, 1536, 1536, 4, 4, head_dim, torch.bfloat16, _seed("det", head_dim, causal))
    out, lse = _forward(q, k, v, causal)
    _bitwise_repeats(q, k, v, dout, out, lse, causal, 100)


@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_bitwise_with_busy_side_stream(causal):
    q, k, v, dout = _inputs(1, 2048, 2048, 8, 8, 128, torch.bfloat16, _seed("busy", causal))
    out, lse = _forward(q, k, v, causal)
    _bitwise_repeats(q, k, v, dout, out, lse, causal, 30, side_stream_work=True)


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_bitwise_1000_repeats(head_dim, causal):
    q, k, v, dout = _inputs(4, 2048, 2048, 8, 8, head_dim, torch.bfloat16, _seed("det1000", head_dim, causal))
    out, lse = _forward(q, k, v, causal)
    _bitwise_repeats(q, k, v, dout, out, lse, causal, 1000)


def test_deterministic_mode_really_orders_the_reduction():
    """Non-deterministic runs of a many-column shape should differ in their last bits at
    least once, while deterministic ones never do; otherwise the determinism tests above
    would prove nothing about the semaphore protocol."""
    q, k, v, dout = _inputs(1, 4096, 4096, 16, 16, 128, torch.bfloat16, _seed("nondet"))
    out, lse = _forward(q, k, v, False)
    first = attention_backward(dout, q, k, v, out, lse, deterministic=False)[0].clone()
    differs = any(not torch.equal(first, attention_backward(dout, q, k, v, out, lse, deterministic=False)[0])
                  for _ in range(20))
    if not differs:
        pytest.skip("non-deterministic mode happened to be bitwise stable in 20 runs on this GPU")
    _bitwise_repeats(q, k, v, dout, out, lse, False, 20)


@pytest.mark.parametrize("causal", [False, True])
def test_nondeterministic_agrees_with_deterministic(causal):
    q, k, v, dout = _inputs(2, 2000, 2000, 4, 4, 128, torch.bfloat16, _seed("agree", causal))
    out, lse = _forward(q, k, v, causal)
    det = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
    nondet = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=False)
    hi = reference.attention_backward(dout, q, k, v, out, lse, causal=causal, compute_dtype=torch.float64)
    lo = reference.attention_backward(dout, q, k, v, out, lse, causal=causal, compute_dtype=q.dtype)
    for name, a, b, h, l in zip(("dq", "dk", "dv"), det, nondet, hi, lo):
        bound = reference.error_bound(h, l)
        assert (a.double() - b.double()).abs().max().item() <= bound, name


@pytest.mark.parametrize("causal", [False, True])
def test_sm_margin_and_fewer_ctas_same_result_per_grid(causal):
    """sm_margin shrinks the persistent grid; the fa3 order is independent of the grid size,
    so results stay bitwise equal across margins."""
    q, k, v, dout = _inputs(1, 1024, 1024, 4, 4, 64, torch.bfloat16, _seed("margin", causal))
    out, lse = _forward(q, k, v, causal)
    base = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
    for margin in (1, 33, 131):
        got = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, sm_margin=margin)
        for a, b in zip(base, got):
            assert torch.equal(a, b), f"sm_margin={margin} changed the bits"


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_end_to_end(causal):
    q, k, v, dout = _inputs(2, 777, 777, 4, 2, 128, torch.bfloat16, _seed("e2e", causal))
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = flash_attn_func(qs, ks, vs, causal=causal, deterministic=True, return_attn_probs=True)
    out.backward(dout)
    ref_out, ref_lse = reference.attention_forward(q, k, v, causal=causal, compute_dtype=torch.float64)
    lo_out, _ = reference.attention_forward(q, k, v, causal=causal, compute_dtype=q.dtype)
    reference.assert_within_bound(out, ref_out, lo_out, "out")
    assert torch.allclose(lse.double(), ref_lse, atol=1e-3, rtol=0)
    _check_against_reference(q, k, v, dout, out.detach(), lse, causal, (qs.grad, ks.grad, vs.grad), "e2e")


def test_deterministic_follows_torch_global_flag():
    q, k, v, dout = _inputs(1, 256, 256, 2, 2, 64, torch.bfloat16, _seed("flag"))
    qs = q.detach().requires_grad_()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RuntimeError, match="deterministic"):
            flash_attn_func(qs, k, v, deterministic=False)
        flash_attn_func(qs, k, v).backward(dout)  # deterministic=None follows the flag
    finally:
        torch.use_deterministic_algorithms(False)


def test_opcheck_ops():
    q, k, v, dout = _inputs(1, 200, 300, 2, 2, 64, torch.bfloat16, _seed("opcheck"))
    out, lse = _forward(q, k, v, False)
    torch.library.opcheck(torch.ops.dash.bwd.default,
                          (dout, q, k, v, out, lse, 0.125, False, True, "fa3", 0))
    torch.library.opcheck(torch.ops.dash.fwd.default, (q, k, v, 0.125, True, True, "fa3", 0))


def test_torch_compile_fullgraph():
    q, k, v, dout = _inputs(1, 512, 512, 2, 2, 128, torch.bfloat16, _seed("compile"))

    def step(q, k, v):
        return flash_attn_func(q, k, v, causal=True, deterministic=True)

    compiled = torch.compile(step, fullgraph=True)
    qs = q.detach().requires_grad_()
    compiled(qs, k, v).backward(dout)
    q2 = q.detach().requires_grad_()
    step(q2, k, v).backward(dout)
    assert torch.equal(qs.grad, q2.grad)


def test_window_equivalent_to_causal_runs_the_causal_kernel():
    """FA3's normalisation: window_size=(-1, 0) is the causal mask; results are bitwise the
    same as causal=True."""
    q, k, v, dout = _inputs(1, 300, 500, 2, 2, 64, torch.bfloat16, _seed("window"))
    grads = []
    for kwargs in (dict(causal=True), dict(window_size=(-1, 0))):
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        flash_attn_func(qs, ks, vs, deterministic=True, **kwargs).backward(dout)
        grads.append((qs.grad, ks.grad, vs.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("heads_k", [2, 8])
def test_gqa_dk_dv_keep_the_layout_of_k_and_v(heads_k):
    """dk/dv come back in k's/v's layout (what the op's fake promises torch.compile), also under
    GQA where the kernel accumulates into contiguous fp32 buffers; a permuted (B, H, S, D)
    k/v through torch.compile gives the eager gradients bit for bit."""
    q, k, v, dout = _inputs(2, 384, 384, 8, heads_k, 64, torch.bfloat16, _seed("gqa-layout", heads_k))
    k_bhsd = k.transpose(1, 2).contiguous().transpose(1, 2)  # (B, S, H, D) view of a (B, H, S, D) tensor
    v_bhsd = v.transpose(1, 2).contiguous().transpose(1, 2)
    out, lse = _forward(q, k_bhsd, v_bhsd, True)
    dq, dk, dv = torch.ops.dash.bwd(dout, q, k_bhsd, v_bhsd, out, lse, 0.125, True, True, "fa3", 0)
    assert dk.stride() == k_bhsd.stride() and dv.stride() == v_bhsd.stride()
    torch.library.opcheck(torch.ops.dash.bwd.default, (dout, q, k_bhsd, v_bhsd, out, lse, 0.125, True, True, "fa3", 0))

    def step(q, k, v):
        return flash_attn_func(q, k, v, causal=True, deterministic=True)

    grads = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k_bhsd, v_bhsd))
        fn(qs, ks, vs).backward(dout)
        grads.append((qs.grad, ks.grad, vs.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_gradient_at_a_misaligned_offset_is_accepted():
    """cat's backward hands the attention output's gradient over as a contiguous slice at an
    odd storage offset (not 16-byte aligned, which TMA needs): the op copies it and the
    gradients are bitwise those of an aligned gradient."""
    q, k, v, dout = _inputs(1, 256, 256, 2, 2, 128, torch.bfloat16, _seed("misaligned"))
    grads = []
    for pad in (3, 8):
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        out = flash_attn_func(qs, ks, vs, causal=True, deterministic=True)
        flat = torch.cat([torch.zeros(pad, device="cuda", dtype=out.dtype), out.flatten()])
        weight = torch.cat([torch.zeros(pad, device="cuda", dtype=out.dtype), dout.flatten()])
        (flat.float() * weight.float()).sum().backward()
        grads.append((qs.grad, ks.grad, vs.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_forward_op_refuses_a_schedule_its_backward_cannot_run():
    """dash::fwd carries the schedule for the backward it saves; a bad one is refused at the
    forward, before activations are kept for a backward that cannot run."""
    q, k, v, _ = _inputs(1, 128, 128, 2, 2, 64, torch.bfloat16, _seed("fwd-schedule"))
    with pytest.raises(NotImplementedError, match="bogus"):
        torch.ops.dash.fwd(q, k, v, 0.125, False, True, "bogus", 0)
    with pytest.raises(NotImplementedError, match="shift"):
        torch.ops.dash.fwd(q, k, v, 0.125, True, True, "shift", 0)
