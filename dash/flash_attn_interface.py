"""FA3's module, DASH inside: ``hopper/flash_attn_interface.py`` of flash-attention.

For code written against FA3:

    from dash.flash_attn_interface import flash_attn_func

and, for frameworks that drive the forward and backward themselves (TransformerEngine's
FlashAttention-3 backend and its context parallelism), FA3's low-level entry points:

    out, softmax_lse, *_ = _flash_attn_forward(q, k, v, ..., softmax_scale=s, causal=True)
    softmax_d = _flash_attn_backward(dout, q, k, v, out, softmax_lse, ..., dq, dk, dv, ...)

Both take FA3's arguments by FA3's names, in FA3's order, with FA3's defaults, and return
what FA3 returns; each FA3 feature DASH does not have (KV caches, paged KV, rotary, FP8
descales, softcapping, sliding windows, split-KV, per-sequence used lengths, ...) raises
NotImplementedError naming the argument and the value. They run on DASH's ops: ``dash::fwd``
for the forward, ``dash::bwd`` (DASH's deterministic Hopper backward) for the backward, and
with ``cu_seqlens_q`` / ``cu_seqlens_k`` (packed variable-length sequences, TransformerEngine's
THD layout) ``dash::fwd_varlen`` / ``dash::bwd_varlen``.

To make ``import flash_attn_interface`` / ``import flash_attn_3.flash_attn_interface``
load this module, see ``dash.install_as_flash_attn_3`` (``dash.fa3_alias``): opt-in, and
never over a real FA3.

``FlashAttnFunc``, ``FlashAttnQKVPackedFunc`` and ``FlashAttnVarlenFunc`` (FA3's
autograd.Function classes) exist for code that calls their ``apply`` with FA3's positional
arguments: it runs the matching ``flash_attn_*func`` with DASH's autograd.

``flash_attn_with_kvcache``, ``flash_attn_combine`` and ``get_scheduler_metadata`` exist so
that code importing them by name imports; calling them raises NotImplementedError.
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import Tensor

from dash.api import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func
from dash.ops import resolve_deterministic, run_backward, run_backward_varlen, run_forward, varlen_kernel_schedule
from dash.validation import (
    backward_will_run,
    check_bool,
    check_bshd,
    check_output_buffer,
    check_tensor,
    contiguous_last_dim,
    effective_causal_from_sides,
    reject_unsupported_fa3_arguments,
    require_kernels_unless_tracing,
    validate_backward_inputs,
    validate_for_launch,
    validate_varlen_inputs,
)

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "flash_attn_combine",
    "get_scheduler_metadata",
    "FlashAttnFunc",
    "FlashAttnQKVPackedFunc",
    "FlashAttnVarlenFunc",
    "_flash_attn_forward",
    "_flash_attn_backward",
]


def _flash_attn_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_new: Optional[Tensor] = None,
    v_new: Optional[Tensor] = None,
    qv: Optional[Tensor] = None,
    out_: Optional[Tensor] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    cu_seqlens_k_new: Optional[Tensor] = None,
    seqused_q: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    page_table: Optional[Tensor] = None,
    kv_batch_idx: Optional[Tensor] = None,
    leftpad_k: Optional[Tensor] = None,
    rotary_cos: Optional[Tensor] = None,
    rotary_sin: Optional[Tensor] = None,
    seqlens_rotary: Optional[Tensor] = None,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size_left: int = -1,
    window_size_right: int = -1,
    attention_chunk: int = 0,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    scheduler_metadata: Optional[Tensor] = None,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    sm_margin: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """FA3's ``_flash_attn_forward`` (same parameters, order and defaults) on ``dash::fwd``.

    q: (batch, seqlen_q, heads, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim).
    ``causal`` and the window (``window_size_left``, ``window_size_right``; -1 unbounded)
    follow FA3's normalisation: the mask must come out as no mask or the (bottom-right)
    causal mask, e.g. (-1, 0) is causal; a real sliding window raises NotImplementedError.

    Accepted and used: q, k, v, out_ (the result is copied into it and it is returned as
    out), softmax_scale (default head_dim ** -0.5), causal, the window as above, sm_margin,
    and for packed variable-length sequences cu_seqlens_q, cu_seqlens_k, max_seqlen_q and
    max_seqlen_k (then q is (total_q, heads, head_dim), k and v (total_k, heads_kv, head_dim),
    softmax_lse (heads, total_q); see ``flash_attn_varlen_func``). Accepted and ignored, as they
    choose nothing in DASH: max_seqlen_q / max_seqlen_k without cu_seqlens_* (as in FA3),
    rotary_interleaved (only with rotary_cos/sin), pack_gqa, num_splits 0 or 1 (DASH never
    splits KV). Everything else must stay at its default; otherwise NotImplementedError names
    the argument and the value.

    Returns (out, softmax_lse, out_accum, softmax_lse_accum) as FA3 does: out like q,
    softmax_lse float32 (batch, heads, seqlen_q) in FA3's convention (natural log; -inf for
    rows that see no key), and the split-KV partials, which FA3 too returns as empty float32
    tensors when it does not split -- DASH never splits, so they are always empty.

    If q, k or v require grad with grad mode on, the result is differentiable through DASH's
    backward (deterministic as ``torch.are_deterministic_algorithms_enabled()`` says).
    """
    reject_unsupported_fa3_arguments(
        k_new=k_new, v_new=v_new, qv=qv, cu_seqlens_k_new=cu_seqlens_k_new, seqused_q=seqused_q, seqused_k=seqused_k,
        page_table=page_table, kv_batch_idx=kv_batch_idx, leftpad_k=leftpad_k, rotary_cos=rotary_cos,
        rotary_sin=rotary_sin, seqlens_rotary=seqlens_rotary, q_descale=q_descale, k_descale=k_descale,
        v_descale=v_descale, attention_chunk=attention_chunk, softcap=softcap, scheduler_metadata=scheduler_metadata,
        num_splits=num_splits,
    )
    check_bool("causal", causal)
    if _is_varlen_call(cu_seqlens_q, cu_seqlens_k):
        return _varlen_forward(q, k, v, out_, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                               causal, window_size_left, window_size_right, sm_margin)
    q, k, v = (contiguous_last_dim(check_bshd(name, t)) for name, t in (("q", q), ("k", k), ("v", v)))
    # Before the device checks, so an unsupported window is reported as such on any machine.
    is_causal = effective_causal_from_sides(window_size_left, window_size_right, causal, q.shape[1], k.shape[1])
    validate_for_launch(q, k, v, softmax_scale=softmax_scale, causal=is_causal, sm_margin=sm_margin)
    if out_ is not None:
        check_output_buffer("out_", out_, q, "q")
    needs_grad = backward_will_run(q, k, v)
    deterministic = resolve_deterministic(None, needs_grad)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    out, softmax_lse = run_forward(q, k, v, scale, is_causal, deterministic, "auto", int(sm_margin))
    if out_ is not None:
        out = out_.copy_(out)
    out_accum = torch.empty(0, dtype=torch.float32, device=out.device)
    softmax_lse_accum = torch.empty(0, dtype=torch.float32, device=out.device)
    return out, softmax_lse, out_accum, softmax_lse_accum


def _flash_attn_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    sequed_q: Optional[Tensor] = None,
    sequed_k: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    dq: Optional[Tensor] = None,
    dk: Optional[Tensor] = None,
    dv: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    is_causal: bool = False,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    deterministic: bool = False,
    sm_margin: int = 0,
) -> Tensor:
    """FA3's ``_flash_attn_backward`` (same parameters, order and defaults, including FA3's
    spelling ``sequed_q``/``sequed_k``) on ``dash::bwd``.

    dout, out: like q; softmax_lse: float32 (batch, heads, seqlen_q) from the forward (FA3's
    or DASH's: same convention). ``is_causal`` and the window are normalised as in
    ``_flash_attn_forward``. deterministic=True, or torch.use_deterministic_algorithms(True)
    whatever deterministic says, makes dq, dk, dv bitwise reproducible
    (DASH's ordered reduction); sm_margin leaves SMs free for communication kernels.

    dq, dk, dv are outputs, as in FA3: each one given (shaped, typed and placed like q, k, v
    respectively; any strides) receives its gradient. One left None is computed and dropped,
    as FA3 does (its gradient is not returned), so pass all three. DASH's backward op
    allocates its results, which are then copied into the buffers (one extra copy each).

    With cu_seqlens_q / cu_seqlens_k (packed variable-length sequences, as the forward took
    them) it runs ``dash::bwd_varlen``: q, dout, out (total_q, heads, head_dim), k, v (total_k,
    heads_kv, head_dim), softmax_lse (heads, total_q), and max_seqlen_q / max_seqlen_k are
    required; softmax_d is then (heads, total_q), row i of it packed row i (FA3's is padded:
    sequence b starts at row (cu_seqlens_q[b] + b * its tile height) rounded down to that
    height, so index DASH's with the offsets, not FA3's padded ones). Without them
    max_seqlen_q / max_seqlen_k are ignored (as in FA3). sequed_q/k, softcap != 0 and a real sliding window raise
    NotImplementedError naming the argument and the value.

    Returns what FA3 returns: ``softmax_d``, float32 (batch, heads, seqlen_q), the row sums
    of dout * out (the "D" term of the softmax gradient), computed here in float32 from dout
    and out. FA3's tensor has its last dim padded to its tile height, with zeros past
    seqlen_q; DASH's has exactly seqlen_q columns, so ``softmax_d[..., :seqlen_q]`` means the
    same with both.
    """
    reject_unsupported_fa3_arguments(sequed_q=sequed_q, sequed_k=sequed_k, softcap=softcap)
    check_bool("is_causal", is_causal)
    check_bool("deterministic", deterministic)
    # FA3's default is False, so an explicit False cannot be told from a caller that never chose
    # (TransformerEngine passes its own default): under torch.use_deterministic_algorithms(True)
    # the ordered backward runs either way, instead of a non-deterministic one.
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    if _is_varlen_call(cu_seqlens_q, cu_seqlens_k):
        return _varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, dq, dk, dv, softmax_scale, is_causal, window_size_left,
                                window_size_right, deterministic, sm_margin)
    q, k, v = (contiguous_last_dim(check_bshd(name, t)) for name, t in (("q", q), ("k", k), ("v", v)))
    dout, out = (contiguous_last_dim(check_tensor(name, t)) for name, t in (("dout", dout), ("out", out)))
    # Before the device checks, so an unsupported window is reported as such on any machine.
    causal = effective_causal_from_sides(window_size_left, window_size_right, is_causal, q.shape[1], k.shape[1],
                                         causal_arg="is_causal")
    validate_backward_inputs(dout, q, k, v, out, softmax_lse, softmax_scale=softmax_scale, causal=causal,
                             sm_margin=sm_margin, deterministic=deterministic)
    buffers = (dq, dk, dv)
    for name, buffer, like, like_name in zip(("dq", "dk", "dv"), buffers, (q, k, v), ("q", "k", "v")):
        if buffer is not None:
            check_output_buffer(name, buffer, like, like_name)
    require_kernels_unless_tracing()
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    grads = run_backward(dout, q, k, v, out, softmax_lse, scale, causal, deterministic, "auto", int(sm_margin))
    for buffer, grad in zip(buffers, grads):
        if buffer is not None:
            buffer.copy_(grad)
    return _softmax_d(dout, out)


def _is_varlen_call(cu_seqlens_q: object, cu_seqlens_k: object) -> bool:
    """Whether FA3's entry point is called for packed variable-length sequences: both offsets
    given (one alone is an error)."""
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        given, missing = ("cu_seqlens_q", "cu_seqlens_k") if cu_seqlens_k is None else ("cu_seqlens_k", "cu_seqlens_q")
        raise ValueError(f"{given} is given but {missing} is None; packed (varlen) sequences need both offsets")
    return cu_seqlens_q is not None


def _lengths_for_window(max_seqlen_q: object, max_seqlen_k: object) -> tuple[int, int]:
    """The longest lengths the window is normalised with (a side at least this long is
    unbounded); validated first, so that a bad value is reported as such instead of widening
    the window (with lengths of 0 every side would count as unbounded)."""
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not 1 <= value < 2**30:
            raise ValueError(f"{name}={value!r} must be an int in [1, 2^30): the longest sequence's length")
    return int(max_seqlen_q), int(max_seqlen_k)


def _varlen_forward(q, k, v, out_, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                    window_size_left, window_size_right, sm_margin):
    """``_flash_attn_forward`` on packed sequences: ``flash_attn_varlen_func`` (with autograd
    when q, k or v require grad) with the window given as two sides, the result copied into
    ``out_`` when given, and FA3's four return values."""
    is_causal = effective_causal_from_sides(window_size_left, window_size_right, causal, *_lengths_for_window(
        max_seqlen_q, max_seqlen_k))
    if out_ is not None:
        check_output_buffer("out_", out_, check_tensor("q", q), "q")
    out, softmax_lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              softmax_scale=softmax_scale, causal=is_causal, sm_margin=sm_margin,
                                              return_attn_probs=True)
    if out_ is not None:
        out = out_.copy_(out)
    empty = torch.empty(0, dtype=torch.float32, device=out.device)
    return out, softmax_lse, empty, empty.clone()


def _varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dq, dk,
                     dv, softmax_scale, is_causal, window_size_left, window_size_right, deterministic, sm_margin):
    """``_flash_attn_backward`` on packed sequences: ``dash::bwd_varlen``; returns softmax_d
    (heads, total_q)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out), ("softmax_lse", softmax_lse)):
        check_tensor(name, t)
    q, k, v, dout, out = (contiguous_last_dim(t) for t in (q, k, v, dout, out))
    causal = effective_causal_from_sides(window_size_left, window_size_right, is_causal,
                                         *_lengths_for_window(max_seqlen_q, max_seqlen_k), causal_arg="is_causal")
    causal = validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    softmax_scale=softmax_scale, causal=causal, window_size=(-1, -1), softcap=0.0,
                                    sm_margin=sm_margin, schedule="auto", deterministic=deterministic, backward=True)
    for name, t in (("dout", dout), ("out", out)):
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must match q (shape {tuple(q.shape)}, {q.dtype}, {q.device}); got "
                             f"shape {tuple(t.shape)}, {t.dtype}, {t.device}")
    lse_shape = (q.shape[1], q.shape[0])
    if softmax_lse.dtype != torch.float32 or tuple(softmax_lse.shape) != lse_shape:
        raise ValueError(f"softmax_lse must be float32 (heads, total_q) = {lse_shape} for packed sequences; got "
                         f"shape {tuple(softmax_lse.shape)}, {softmax_lse.dtype}")
    buffers = (dq, dk, dv)
    for name, buffer, like, like_name in zip(("dq", "dk", "dv"), buffers, (q, k, v), ("q", "k", "v")):
        if buffer is not None:
            check_output_buffer(name, buffer, like, like_name)
    schedule = varlen_kernel_schedule("auto", cu_seqlens_q.shape[0] - 1, q.shape[1], k.shape[1], int(max_seqlen_q),
                                      int(max_seqlen_k), q.shape[2], causal, deterministic, True)
    cu_seqlens_q, cu_seqlens_k = (cu.to(q.device, non_blocking=True) for cu in (cu_seqlens_q, cu_seqlens_k))
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    grads = run_backward_varlen(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                int(max_seqlen_k), scale, causal, deterministic, schedule, int(sm_margin))
    for buffer, grad in zip(buffers, grads):
        if buffer is not None:
            buffer.copy_(grad)
    return _softmax_d(dout.unsqueeze(0), out.unsqueeze(0))[0]


#: Elements of dout per slice of _softmax_d (two fp32 temporaries of 64 MiB each at most).
_SOFTMAX_D_SLICE_ELEMENTS = 1 << 24


def _softmax_d(dout: Tensor, out: Tensor) -> Tensor:
    """D_i = sum_d dout[i, d] * out[i, d] in float32, (batch, heads, seqlen_q), as FA3's
    backward preprocessing returns it. Computed over slices of the sequence, so that a long
    context does not allocate two float32 copies of dout and out at once (at 128k tokens,
    32 heads and head dim 128: 2 GiB each)."""
    batch, seqlen, heads, head_dim = out.shape
    d = torch.empty(batch, heads, seqlen, dtype=torch.float32, device=out.device)
    rows = max(1, _SOFTMAX_D_SLICE_ELEMENTS // max(1, batch * heads * head_dim))
    for s0 in range(0, seqlen, rows):
        s1 = min(seqlen, s0 + rows)
        d[:, :, s0:s1] = (dout[:, s0:s1].float() * out[:, s0:s1].float()).sum(dim=-1).transpose(1, 2)
    return d


def flash_attn_with_kvcache(*args, **kwargs):
    """FA3's KV-cache (inference) API: not supported."""
    raise NotImplementedError(
        "flash_attn_with_kvcache (KV-cache inference) is not supported by DASH; use flash_attn_func on the full keys "
        "and values"
    )


def flash_attn_combine(*args, **kwargs):
    """FA3's combination of split-KV partial results: not supported (DASH never splits KV)."""
    raise NotImplementedError("flash_attn_combine (merging split-KV partials) is not supported by DASH, which never "
                              "splits KV; flash_attn_func returns the final output")


def get_scheduler_metadata(*args, **kwargs):
    """FA3's scheduler metadata for flash_attn_with_kvcache: not supported."""
    raise NotImplementedError("get_scheduler_metadata (FA3's KV-cache scheduler) is not supported by DASH; "
                              "pass scheduler_metadata=None")


# FA3's autograd.Function classes, for callers of ``FlashAttnFunc.apply(...)``. They are not
# torch.autograd.Function subclasses: DASH's autograd is in its ops (csrc/autograd.cpp, and
# dash.ops for varlen), so ``apply`` is the functional entry point under FA3's positional order.
class FlashAttnFunc:
    """``FlashAttnFunc.apply(q, k, v, softmax_scale, causal, qv, q_descale, k_descale, v_descale,
    window_size, attention_chunk, softcap, num_splits, pack_gqa, deterministic, sm_margin,
    return_softmax)``: FA3's order, which is ``flash_attn_func``'s; runs it."""

    apply = staticmethod(flash_attn_func)


class FlashAttnQKVPackedFunc:
    """``FlashAttnQKVPackedFunc.apply(qkv, softmax_scale, causal, q_descale, k_descale, v_descale,
    window_size, attention_chunk, softcap, deterministic, num_heads_q, sm_margin,
    return_softmax)``: FA3's order, which is ``flash_attn_qkvpacked_func``'s; runs it."""

    apply = staticmethod(flash_attn_qkvpacked_func)


class FlashAttnVarlenFunc:
    """``FlashAttnVarlenFunc.apply(...)`` with FA3's positional order, which differs from
    ``flash_attn_varlen_func``'s (seqused_q / seqused_k before the longest lengths); runs it."""

    @staticmethod
    def apply(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale,
              causal, qv=None, q_descale=None, k_descale=None, v_descale=None, window_size=(-1, -1),
              attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=None, sm_margin=0,
              return_softmax=False):
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                      seqused_k, softmax_scale, causal, qv, q_descale, k_descale, v_descale,
                                      window_size, attention_chunk, softcap, num_splits, pack_gqa, deterministic,
                                      sm_margin, return_softmax)
