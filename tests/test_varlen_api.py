"""flash_attn_varlen_func on the CPU: FA3's signature, the validation of its arguments (each
error names the argument, the value and what is supported), what reaches the op (the
backward's schedule and determinism included), and the varlen reference against the padded
one. Nothing here launches a kernel; the kernel's own
tests are in tests/test_fwd_varlen_gpu.py.
"""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")

import dash  # noqa: E402
from dash import reference  # noqa: E402
from dash.api import flash_attn_varlen_func  # noqa: E402

#: hopper/flash_attn_interface.py::flash_attn_varlen_func, parameter names in order, with defaults.
FA3_VARLEN = [
    ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty), ("v", inspect.Parameter.empty),
    ("cu_seqlens_q", inspect.Parameter.empty), ("cu_seqlens_k", inspect.Parameter.empty),
    ("max_seqlen_q", inspect.Parameter.empty), ("max_seqlen_k", inspect.Parameter.empty),
    ("seqused_q", None), ("seqused_k", None), ("softmax_scale", None), ("causal", False), ("qv", None),
    ("q_descale", None), ("k_descale", None), ("v_descale", None), ("window_size", (-1, -1)),
    ("attention_chunk", 0), ("softcap", 0.0), ("num_splits", 1), ("pack_gqa", None), ("deterministic", False),
    ("sm_margin", 0), ("return_attn_probs", False),
]


def _packed(lengths_q=(5, 0, 17), lengths_k=None, heads=4, heads_kv=None, head_dim=64, dtype=torch.bfloat16):
    lengths_k = lengths_q if lengths_k is None else lengths_k
    heads_kv = heads if heads_kv is None else heads_kv
    q = torch.randn(sum(lengths_q), heads, head_dim, dtype=dtype)
    k = torch.randn(sum(lengths_k), heads_kv, head_dim, dtype=dtype)
    v = torch.randn(sum(lengths_k), heads_kv, head_dim, dtype=dtype)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k)


def test_signature_is_fa3s_plus_schedule():
    params = inspect.signature(flash_attn_varlen_func).parameters
    assert list(params) == [n for n, _ in FA3_VARLEN] + ["schedule"]
    for name, fa3_default in FA3_VARLEN:
        if name == "deterministic":
            assert params[name].default is None  # follows torch.are_deterministic_algorithms_enabled()
        else:
            assert params[name].default == fa3_default, name
    assert dash.flash_attn_varlen_func is flash_attn_varlen_func
    from dash.flash_attn_interface import flash_attn_varlen_func as drop_in

    assert drop_in is flash_attn_varlen_func


def test_valid_call_reaches_the_device_check_on_cpu():
    with pytest.raises(ValueError, match=r"^q is on device cpu"):
        flash_attn_varlen_func(*_packed())


@pytest.mark.parametrize("causal", [False, True])
def test_what_reaches_the_op(cpu_as_sm90, causal):
    q, k, v, cu_q, cu_k, mq, mk = _packed(lengths_q=(5, 0, 17), lengths_k=(9, 3, 12), heads=4, heads_kv=2)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal, return_attn_probs=True)
    (call,) = cpu_as_sm90
    assert call["q"] is q and call["k"] is k and call["v"] is v
    assert torch.equal(call["cu_seqlens_q"], cu_q) and torch.equal(call["cu_seqlens_k"], cu_k)
    assert (call["max_seqlen_q"], call["max_seqlen_k"], call["causal"], call["sm_margin"]) == (17, 12, causal, 0)
    assert call["softmax_scale"] == pytest.approx(64 ** -0.5)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    assert flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk).shape == q.shape  # out alone by default


def test_window_that_is_the_causal_mask(cpu_as_sm90):
    """FA3's normalisation with the longest lengths: (-1, 0) is causal, a side at least the
    longest sequence is unbounded."""
    q, k, v, cu_q, cu_k, mq, mk = _packed()
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, window_size=(-1, 0))
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, window_size=(mk, mq))
    assert [c["causal"] for c in cpu_as_sm90] == [True, False]
    with pytest.raises(NotImplementedError, match=r"sliding-window attention is not supported yet"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, window_size=(3, 0))


def test_no_backward_no_schedule(cpu_as_sm90):
    """Without a backward the schedule is never used: "auto" stays unresolved ("fa3")."""
    flash_attn_varlen_func(*_packed(), causal=True)
    assert cpu_as_sm90[0]["schedule"] == "fa3" and cpu_as_sm90[0]["deterministic"] is False


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [True, False])
def test_auto_schedule_of_a_varlen_backward_is_a_claimed_one(cpu_as_sm90, causal, deterministic):
    """With a backward, "auto" resolves on the longest lengths to a schedule built for varlen
    batches (never shift, whose static waves assume equal heads)."""
    # The last batch's longest sequence (16400 tokens, hdim 128, full mask) is where the padded
    # problem's non-deterministic rule picks shift: varlen must run fa3 instead.
    from dash.schedules.auto import nondeterministic_kernel_schedule
    assert nondeterministic_kernel_schedule(16400, 16400, 128, False, 132) == "shift"
    for lengths in ([5, 0, 17], [3000, 100, 4100], [16400, 7]):
        q, k, v, cu_q, cu_k, mq, mk = _packed(lengths_q=lengths, heads=2, head_dim=128)
        q.requires_grad_(True)
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal, deterministic=deterministic)
    assert [c["deterministic"] for c in cpu_as_sm90] == [deterministic] * 3
    for call in cpu_as_sm90:
        assert call["schedule"] in ("fa3", "interleaved", "descending"), call["schedule"]
    if not deterministic and not causal:
        assert cpu_as_sm90[-1]["schedule"] == "fa3"


def test_deterministic_follows_the_global_flag(cpu_as_sm90):
    q, k, v, cu_q, cu_k, mq, mk = _packed()
    q.requires_grad_(True)
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk)
        with pytest.raises(RuntimeError, match="does not have a deterministic implementation"):
            flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, deterministic=False)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert cpu_as_sm90[0]["deterministic"] is True


@pytest.mark.parametrize("schedule", ["fa3", "interleaved", "descending"])
def test_named_schedules_reach_the_op(cpu_as_sm90, schedule):
    q, k, v, cu_q, cu_k, mq, mk = _packed()
    q.requires_grad_(True)
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, deterministic=True, schedule=schedule)
    assert cpu_as_sm90[0]["schedule"] == schedule


def test_shift_is_not_built_for_varlen(cpu_as_sm90):
    q, k, v, cu_q, cu_k, mq, mk = _packed()
    with pytest.raises(NotImplementedError, match=r"schedule='shift' is not built for variable-length batches; use "
                                                  r"one of fa3, interleaved, descending or auto"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, schedule="shift")
    assert cpu_as_sm90 == []


@pytest.mark.parametrize("name", ["seqused_q", "seqused_k", "qv", "q_descale", "k_descale", "v_descale"])
def test_unsupported_tensor_arguments(name):
    q, k, v, cu_q, cu_k, mq, mk = _packed()
    with pytest.raises(NotImplementedError) as e:
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, **{name: torch.zeros(3)})
    assert str(e.value).startswith(f"{name} (") and "not supported yet" in str(e.value)


@pytest.mark.parametrize("kw, match", [
    (dict(softcap=1.0), r"softcap=1.0: softcapping is not supported yet"),
    (dict(attention_chunk=64), r"attention_chunk=64 is not supported yet"),
    (dict(num_splits=2), r"num_splits=2 \(split-KV forward\) is not supported yet"),
], ids=["softcap", "attention_chunk", "num_splits"])
def test_unsupported_options(kw, match):
    with pytest.raises(NotImplementedError, match=match):
        flash_attn_varlen_func(*_packed(), **kw)


def _call_with(cpu_as_sm90_calls, **changes):
    q, k, v, cu_q, cu_k, mq, mk = _packed()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk)
    args.update(changes)
    return flash_attn_varlen_func(**args)


@pytest.mark.parametrize("changes, match", [
    (dict(q=torch.randn(2, 22, 4, 64, dtype=torch.bfloat16)),
     r"^q must have 3 dims \(total_tokens, heads, head_dim\) for flash_attn_varlen_func; got shape \(2, 22, 4, 64\)"),
    (dict(v=torch.randn(21, 4, 64, dtype=torch.bfloat16)), r"^total_k differs between k \(22\) and v \(21\)"),
    (dict(cu_seqlens_q=torch.tensor([0, 5, 5, 22])), r"^cu_seqlens_q must be a 1-D int32 tensor .* torch.int64"),
    (dict(cu_seqlens_k=torch.tensor([22], dtype=torch.int32)), r"^cu_seqlens_k must be a 1-D int32 tensor"),
    (dict(cu_seqlens_k=torch.tensor([0, 22], dtype=torch.int32)),
     r"^cu_seqlens_q has 4 entries and cu_seqlens_k 2; both must be batch \+ 1"),
    (dict(cu_seqlens_q=torch.tensor([1, 5, 5, 22], dtype=torch.int32)),
     r"^cu_seqlens_q must be non-decreasing offsets from 0 to the 22 rows of q; got \[1, 5, 5, 22\]"),
    (dict(cu_seqlens_q=torch.tensor([0, 5, 5, 21], dtype=torch.int32)),
     r"^cu_seqlens_q must be non-decreasing offsets from 0 to the 22 rows of q"),
    (dict(cu_seqlens_k=torch.tensor([0, 6, 5, 22], dtype=torch.int32)),
     r"^cu_seqlens_k must be non-decreasing offsets from 0 to the 22 rows of k"),
    (dict(max_seqlen_q=16), r"^cu_seqlens_q holds a sequence of 17 rows, longer than max_seqlen_q=16"),
    (dict(max_seqlen_k=0), r"^max_seqlen_k=0 must be an int in \[1, 2\^30\)"),
    (dict(max_seqlen_q=17.0), r"^max_seqlen_q=17.0 must be an int"),
    (dict(cu_seqlens_q=[0, 5, 5, 22]), r"^cu_seqlens_q must be a torch.Tensor, got list"),
], ids=["4-dim q", "total_k", "int64 offsets", "one offset", "offset counts", "first offset", "last offset",
        "decreasing", "longer than max", "max 0", "max float", "list"])
def test_bad_arguments(cpu_as_sm90, changes, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _call_with(cpu_as_sm90, **changes)
    assert cpu_as_sm90 == []


def test_other_checks_of_the_padded_forward_apply(cpu_as_sm90):
    q, k, v, cu_q, cu_k, mq, mk = _packed(head_dim=96)
    with pytest.raises(NotImplementedError, match=r"head_dim=96 is not supported yet"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk)
    q, k, v, cu_q, cu_k, mq, mk = _packed(heads=6, heads_kv=4)
    with pytest.raises(ValueError, match=r"q has 6 heads, which is not divisible by the 4 heads of k/v"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk)
    q, k, v, cu_q, cu_k, mq, mk = _packed()
    with pytest.raises(ValueError, match=r"schedule='nope' is unknown"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, schedule="nope")
    with pytest.raises(ValueError, match=r"softmax_scale=-1.0 must be None or a finite positive number"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=-1.0)
    with pytest.raises(TypeError, match=r"causal must be a bool"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=1)
    with pytest.raises(ValueError, match=r"q has dtype torch.float32"):
        flash_attn_varlen_func(q.float(), k.float(), v.float(), cu_q, cu_k, mq, mk)
    assert cpu_as_sm90 == []


# ---------------------------------------------------------------------------------------
# The varlen reference
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_reference_of_equal_lengths_is_the_padded_reference(causal):
    batch, seqlen_q, seqlen_k, heads, heads_kv, d = 3, 19, 27, 4, 2, 16
    q = torch.randn(batch, seqlen_q, heads, d, dtype=torch.float64)
    k = torch.randn(batch, seqlen_k, heads_kv, d, dtype=torch.float64)
    v = torch.randn(batch, seqlen_k, heads_kv, d, dtype=torch.float64)
    out, lse = reference.attention_forward(q, k, v, causal=causal, compute_dtype=torch.float64)
    vout, vlse = reference.attention_forward_varlen(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), range(0, batch * seqlen_q + 1, seqlen_q),
        range(0, batch * seqlen_k + 1, seqlen_k), causal=causal, compute_dtype=torch.float64)
    torch.testing.assert_close(vout, out.flatten(0, 1), rtol=0, atol=1e-12)
    torch.testing.assert_close(vlse, lse.permute(1, 0, 2).flatten(1, 2), rtol=0, atol=1e-12)


def _autograd_oracle(q, k, v, dout, lengths_q, lengths_k, causal):
    """Attention written out in float64 per sequence and head, differentiated by autograd: an
    oracle that shares no code with dash.reference. Causal is bottom-right aligned (query i of
    a sequence sees keys j <= i + seqlen_k - seqlen_q); a row that sees no key gives 0."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    q0 = k0 = 0
    for sq, sk in zip(lengths_q, lengths_k):
        for h in range(q.shape[1]):
            qs, ks, vs = q[q0:q0 + sq, h], k[k0:k0 + sk, h // group], v[k0:k0 + sk, h // group]
            s = (qs @ ks.T) * q.shape[-1] ** -0.5
            if causal:
                s = s.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq), float("-inf"))
            shift = s.detach().amax(-1, keepdim=True) if sk else torch.zeros(sq, 1, dtype=s.dtype)
            shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
            e = torch.exp(s - shift)
            total = e.sum(-1, keepdim=True)
            outs.append(((e / torch.where(total > 0, total, torch.ones_like(total))) @ vs, q0, h))
            lses.append((torch.log(total[:, 0]) + shift[:, 0], q0, h))
        q0, k0 = q0 + sq, k0 + sk
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=q.dtype)
    for (o, start, h), (l, _, _) in zip(outs, lses):
        out[start:start + o.shape[0], h] = o
        lse[h, start:start + l.shape[0]] = l.detach()
    grads = torch.autograd.grad((out * dout).sum(), (q, k, v), allow_unused=True)
    return out.detach(), lse, [torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v))]


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_reference_backward_matches_an_autograd_oracle(causal):
    """reference.attention_backward_varlen (what every varlen backward test on the GPU trusts)
    against autograd of attention written out per sequence: GQA, a sequence without queries,
    one without keys, seqlen_q > seqlen_k (causal rows that see no key) and the reverse."""
    lengths_q, lengths_k = (5, 0, 9, 3, 7), (8, 4, 3, 0, 11)
    gen = torch.Generator().manual_seed(1 + causal)
    heads, heads_kv, d = 4, 2, 8
    q = torch.randn(sum(lengths_q), heads, d, dtype=torch.float64, generator=gen)
    k = torch.randn(sum(lengths_k), heads_kv, d, dtype=torch.float64, generator=gen)
    v = torch.randn(sum(lengths_k), heads_kv, d, dtype=torch.float64, generator=gen)
    dout = torch.randn(q.shape, dtype=torch.float64, generator=gen)
    out, lse, want = _autograd_oracle(q, k, v, dout, lengths_q, lengths_k, causal)
    cu_q = [0, *torch.tensor(lengths_q).cumsum(0).tolist()]
    cu_k = [0, *torch.tensor(lengths_k).cumsum(0).tolist()]
    ref_out, ref_lse = reference.attention_forward_varlen(q, k, v, cu_q, cu_k, causal=causal,
                                                          compute_dtype=torch.float64)
    torch.testing.assert_close(ref_out, out, rtol=1e-10, atol=1e-12)
    assert torch.equal(torch.isneginf(ref_lse), torch.isneginf(lse))
    got = reference.attention_backward_varlen(dout, q, k, v, out, ref_lse, cu_q, cu_k, causal=causal,
                                              compute_dtype=torch.float64)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11, msg=lambda m: f"{name}: {m}")
    assert torch.all(got[1][8:12] == 0) and torch.all(got[2][8:12] == 0)


def test_varlen_reference_keeps_sequences_apart():
    """A sequence's result does not change when its neighbours change, and rows of a sequence
    without keys are 0 with LSE -inf."""
    q, k, v, cu_q, cu_k, _, _ = _packed(lengths_q=(4, 6, 3), lengths_k=(5, 0, 7), dtype=torch.float64)
    out, lse = reference.attention_forward_varlen(q, k, v, cu_q.tolist(), cu_k.tolist(), causal=True,
                                                  compute_dtype=torch.float64)
    k2, v2 = k.clone(), v.clone()
    k2[:5] += 1.0
    v2[:5] -= 2.0
    out2, lse2 = reference.attention_forward_varlen(q, k2, v2, cu_q.tolist(), cu_k.tolist(), causal=True,
                                                    compute_dtype=torch.float64)
    assert torch.equal(out[4:], out2[4:]) and torch.equal(lse[:, 4:], lse2[:, 4:])
    assert not torch.equal(out[:4], out2[:4])
    assert torch.all(out[4:10] == 0) and torch.all(torch.isneginf(lse[:, 4:10]))
    # The last sequence (3 queries, 7 keys, causal bottom-right): query i sees keys 0..i+4.
    alone, alone_lse = reference.attention_forward(q[None, 10:], k[None, 5:], v[None, 5:], causal=True,
                                                   compute_dtype=torch.float64)
    assert torch.equal(out[10:], alone[0]) and torch.equal(lse[:, 10:], alone_lse[0])
    with pytest.raises(ValueError, match="must be non-decreasing offsets from 0"):
        reference.attention_forward_varlen(q, k, v, [0, 4, 13], cu_k.tolist()[:3])
