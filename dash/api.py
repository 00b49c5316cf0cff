"""DASH's public attention functions, with FA3's interface.

``flash_attn_func`` takes FA3's arguments with FA3's meaning (names, order, return
convention of ``hopper/flash_attn_interface.py``) plus DASH's own ``schedule`` at the end.
Every argument is validated (``dash.validation``) before anything is launched; unsupported
features are accepted by name and rejected with a "not supported yet" error. The work is
done by the ops of ``dash.ops``.

FA3's low-level entry points (``_flash_attn_forward`` / ``_flash_attn_backward``), for
frameworks such as TransformerEngine, are in ``dash.flash_attn_interface``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from dash.ops import (forward_kernel_schedule, resolve_deterministic, run_backward, run_forward,
                      run_forward_varlen, varlen_kernel_schedule)
from dash.validation import (
    TMA_ALIGN_BYTES,
    backward_will_run,
    check_tensor,
    contiguous_last_dim,
    describe_tensor,
    effective_causal,
    reject_unsupported_fa3_arguments,
    require_kernels_unless_tracing,
    validate_backward_inputs,
    validate_for_launch,
    validate_varlen_inputs,
)

__all__ = ["attention_backward", "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func"]


def attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor, *,
    softmax_scale: Optional[float] = None, causal: bool = False, deterministic: Optional[bool] = None,
    schedule: str = "auto", sm_margin: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Run DASH's backward directly on a forward's (out, softmax_lse), whichever forward
    produced them (same LSE convention). Returns (dq, dk, dv) shaped like q, k, v.

    deterministic: as in flash_attn_func: None follows
    ``torch.are_deterministic_algorithms_enabled()``; True makes dq, dk, dv bitwise
    reproducible; False while that global flag is on raises PyTorch's non-determinism alert."""
    validate_backward_inputs(dout, q, k, v, out, softmax_lse, softmax_scale=softmax_scale, causal=causal,
                             sm_margin=sm_margin, schedule=schedule, deterministic=deterministic)
    require_kernels_unless_tracing()
    det = resolve_deterministic(deterministic, needs_grad=True)  # this call is the backward
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return run_backward(dout, q, k, v, out, softmax_lse, scale, causal, det, schedule, sm_margin)


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    qv: Optional[Tensor] = None,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    window_size: Sequence[int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    deterministic: Optional[bool] = None,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
    schedule: str = "auto",
):
    """Attention with FA3's interface; the backward is DASH's.

    q: (batch, seqlen_q, heads, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim),
    heads % heads_kv == 0 (GQA/MQA). bf16 or fp16, on a compute capability 9.0 GPU. As in
    FA3, a tensor whose last dim is strided is copied (the kernels need a unit last stride).
    With a backward (grad mode on and q, k or v requiring grad), batch and heads are at
    most 65535. causal=True aligns the mask to the bottom-right corner (FA3's convention).

    deterministic: None follows ``torch.are_deterministic_algorithms_enabled()``; True makes
        the backward bitwise reproducible; False while that global flag is on raises
        PyTorch's non-determinism alert.
    schedule: the deterministic reduction schedule, "auto" or a name (see
        ``python -m dash simulate --schedule all``).
    sm_margin: SMs to leave free for other work (the persistent grid uses the rest).
    num_splits (0 or 1) and pack_gqa are FA3 performance options with nothing to choose in
    DASH; they are accepted and ignored.

    Returns out (batch, seqlen_q, heads, head_dim), or (out, softmax_lse) with
    return_attn_probs=True; softmax_lse is float32 (batch, heads, seqlen_q). softmax_lse is
    for inspection: no gradient flows back through it, and it says so (requires_grad=False,
    as torch.max's indices; FA3 returns it as differentiable and ignores a gradient that
    arrives). A loss on it alone raises PyTorch's "does not require grad"; in a loss on out and
    softmax_lse, softmax_lse is a constant.

    Gradients are first order: with create_graph=True, dq, dk, dv are exact, but
    differentiating them again (a gradient penalty, a Hessian-vector product) raises
    dash.ops.NOT_TWICE_DIFFERENTIABLE instead of losing attention's second-order term.
    """
    # Read once: the key and the deterministic=None rule below must see the same value even if
    # another thread sets the flag meanwhile (a plan stored under the other value would stick).
    flag = torch.are_deterministic_algorithms_enabled()
    key = plan = None
    if type(q) is Tensor and type(k) is Tensor and type(v) is Tensor and not torch.compiler.is_compiling() \
            and q.is_cuda:
        key = _call_key(q, k, v, softmax_scale, causal, qv, q_descale, k_descale, v_descale, window_size,
                        attention_chunk, softcap, num_splits, deterministic, sm_margin, schedule, flag)
        if key is not None:
            try:
                plan = _CALL_PLANS.get(key)
            except TypeError:  # an unhashable argument (a list for a str, say): the full path names it
                key = None
        if plan is not None and (q.data_ptr() | k.data_ptr() | v.data_ptr()) % TMA_ALIGN_BYTES == 0:
            out, lse = run_forward(q, k, v, *plan)
            return (out, lse) if return_attn_probs else out
    given = (q, k, v)
    reject_unsupported_fa3_arguments(qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                     attention_chunk=attention_chunk, num_splits=num_splits)
    q, k, v = contiguous_last_dim(q), contiguous_last_dim(k), contiguous_last_dim(v)
    validate_for_launch(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                        sm_margin=sm_margin, schedule=schedule, deterministic=deterministic)
    needs_grad = backward_will_run(q, k, v)
    det = resolve_deterministic(deterministic, needs_grad, flag)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    causal = effective_causal(window_size, causal, q.shape[1], k.shape[1])
    plan = (scale, causal, det, forward_kernel_schedule(schedule, q, k, v, causal, det, int(sm_margin)),
            int(sm_margin))
    # Remembered only when the call went through as given (no copy of a strided tensor) and
    # without PyTorch's non-determinism alert (which must fire on every such call).
    alerted = deterministic is False and needs_grad and flag
    if key is not None and not alerted and q is given[0] and k is given[1] and v is given[2]:
        if len(_CALL_PLANS) >= 4096:  # bounded: a long-running process with ever new shapes
            _CALL_PLANS.clear()
        _CALL_PLANS[key] = plan
    out, lse = run_forward(q, k, v, *plan)
    return (out, lse) if return_attn_probs else out


#: flash_attn_func calls that passed validation: the call's key (``_call_key``) -> the
#: arguments of ``run_forward`` after q, k, v (softmax scale, causal after the window,
#: deterministic, kernel schedule, sm_margin). A call with the same key needs only its data
#: pointers' alignment checked: everything else that validation, the ``deterministic=None``
#: rule and the schedule choice look at is in the key. On the H200 host the full path cost
#: 20-40 us of Python per call at a tiny shape, against 150-300 us for a whole forward and
#: backward (tools/host_profile.py).
_CALL_PLANS: dict = {}


def _call_key(q, k, v, softmax_scale, causal, qv, q_descale, k_descale, v_descale, window_size, attention_chunk,
              softcap, num_splits, deterministic, sm_margin, schedule, deterministic_flag):
    """The key of ``_CALL_PLANS`` for one call (hashing it raises TypeError when an argument
    is unhashable), or None for a call that is never remembered: a ``window_size`` other than
    a tuple of ints (0, False and 0.0 are equal keys, but only 0 is a valid window side).
    Values go in with their types (causal=1 is not causal=True); grad mode with q/k/v's
    requires_grad and PyTorch's deterministic-algorithms flag (``deterministic_flag``, as the
    caller read it) decide ``deterministic=None`` and the schedule, so they are in it too."""
    if type(window_size) is not tuple or any(type(w) is not int for w in window_size):
        return None
    return (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(),
           v.dtype, v.device, softmax_scale, type(softmax_scale), causal, type(causal), window_size,
           type(window_size), qv is None and q_descale is None and k_descale is None and v_descale is None,
           attention_chunk, type(attention_chunk), softcap, type(softcap), num_splits, type(num_splits),
           deterministic, type(deterministic), sm_margin, type(sm_margin), schedule, type(schedule),
           backward_will_run(q, k, v), deterministic_flag)


def flash_attn_qkvpacked_func(
    qkv: Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    window_size: Sequence[int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    deterministic: Optional[bool] = None,
    num_heads_q: Optional[int] = None,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
    schedule: str = "auto",
):
    """FA3's packed variant (same arguments and order as FA3's, ``schedule`` last).

    qkv: (batch, seqlen, 3, heads, head_dim), or (batch, seqlen, heads_q + 2*heads_kv, head_dim)
    with ``num_heads_q`` given (GQA packing: q heads first, then k, then v). As in FA3,
    ``num_heads_q`` is ignored for the 5-dim layout."""
    check_tensor("qkv", qkv)
    if qkv.dim() == 5 and qkv.shape[2] == 3:
        q, k, v = qkv.unbind(dim=2)
    elif qkv.dim() == 4 and num_heads_q is not None:
        heads_kv2 = qkv.shape[2] - num_heads_q
        if num_heads_q <= 0 or heads_kv2 <= 0 or heads_kv2 % 2:
            raise ValueError(f"qkv has {qkv.shape[2]} heads, which cannot be num_heads_q={num_heads_q} query heads "
                             "plus equal numbers of key and value heads")
        q, k, v = qkv.split([num_heads_q, heads_kv2 // 2, heads_kv2 // 2], dim=2)
    else:
        raise ValueError(
            f"qkv must be (batch, seqlen, 3, heads, head_dim), or (batch, seqlen, heads_q + 2*heads_kv, head_dim) "
            f"with num_heads_q; got {describe_tensor(qkv)} and num_heads_q={num_heads_q}"
        )
    return flash_attn_func(q, k, v, softmax_scale, causal, None, q_descale, k_descale, v_descale, window_size,
                           attention_chunk, softcap, 1, None, deterministic, sm_margin, return_attn_probs, schedule)


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    seqused_q: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    qv: Optional[Tensor] = None,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    window_size: Sequence[int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    deterministic: Optional[bool] = None,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
    schedule: str = "auto",
):
    """FA3's variable-length attention (same arguments and order as FA3's, ``schedule`` last),
    forward and backward on DASH's Hopper kernels.

    q: (total_q, heads, head_dim) and k, v: (total_k, heads_kv, head_dim) hold the batch's
    sequences packed along the rows: sequence b is rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of
    q and ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k and v (int32 offsets, batch + 1 of them,
    from 0 to the number of rows). ``max_seqlen_q`` / ``max_seqlen_k``: the longest sequence's
    lengths (ints). causal=True aligns the mask to the bottom-right corner of each sequence.

    Offsets on the GPU are not read on the host (that would synchronise), so, as in FA3, their
    values are the caller's contract; offsets on the CPU are checked and copied to q's device.
    A sequence longer than ``max_seqlen_q`` comes out NaN in its rows past that length (out
    and softmax_lse), and one longer than ``max_seqlen_q`` or ``max_seqlen_k`` gets NaN for all
    its dq, dk, dv: never unwritten memory. As in FA3, rows of q, k, v outside every sequence
    (between or after them) must hold finite values: a tile that reaches into them multiplies
    them by exact zeros.

    deterministic, schedule: as in ``flash_attn_func``, for the backward; the varlen backward
    runs the claimed schedules (``fa3``, ``interleaved``, ``descending``; "auto" picks among
    them with the longest lengths), not ``shift``. seqused_q / seqused_k, qv, FP8 descales,
    attention_chunk, softcap, sliding windows and num_splits > 1 raise NotImplementedError.

    Returns out (total_q, heads, head_dim), or (out, softmax_lse) with return_attn_probs=True;
    softmax_lse is float32 (heads, total_q), FA3's varlen layout (natural log; -inf for rows
    that see no key, whose out is 0). As in flash_attn_func, it is non-differentiable
    (requires_grad=False) and the gradients are first order only."""
    reject_unsupported_fa3_arguments(seqused_q=seqused_q, seqused_k=seqused_k, qv=qv, q_descale=q_descale,
                                     k_descale=k_descale, v_descale=v_descale, attention_chunk=attention_chunk,
                                     num_splits=num_splits, softcap=softcap)
    flag = torch.are_deterministic_algorithms_enabled()
    q, k, v = contiguous_last_dim(q), contiguous_last_dim(k), contiguous_last_dim(v)
    is_causal = validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                       softcap=softcap, sm_margin=sm_margin, schedule=schedule,
                                       deterministic=deterministic)
    needs_grad = backward_will_run(q, k, v)
    det = resolve_deterministic(deterministic, needs_grad, flag)
    kernel_schedule = varlen_kernel_schedule(schedule, cu_seqlens_q.shape[0] - 1, q.shape[1], k.shape[1],
                                             int(max_seqlen_q), int(max_seqlen_k), q.shape[2], is_causal, det,
                                             needs_grad)
    cu_seqlens_q, cu_seqlens_k = (cu.to(q.device, non_blocking=True) for cu in (cu_seqlens_q, cu_seqlens_k))
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    out, lse = run_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), scale,
                                  is_causal, det, kernel_schedule, int(sm_margin))
    return (out, lse) if return_attn_probs else out
