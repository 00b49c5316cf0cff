"""DASH's torch ops and the decisions made for them at call time.

Ops (registered with ``torch.library`` so ``torch.compile`` traces them):

* ``dash::fwd``  -- DASH's Hopper forward (C++/CUDA, registered by ``dash._C``). Returns
  (out, lse) in FA3's layout and LSE convention (natural log of sum_j exp(scale * s_ij);
  -inf for rows that see no key). This module gives it a fake; its autograd runs
  ``dash::bwd``; ``deterministic``, ``schedule`` and ``sm_margin`` travel with the op for
  the backward. Its autograd is C++ (csrc/autograd.cpp): the backward node calls
  ``dash::bwd`` through the dispatcher, so torch.compile traces both ops. The LSE output
  is non-differentiable (returned with requires_grad=False: no gradient flows through it,
  as in FA3, which ignores one arriving there), and the gradients are first order only: a
  second differentiation raises NOT_TWICE_DIFFERENTIABLE (see ``dash.api.flash_attn_func``).
* ``dash::fwd_varlen`` / ``dash::bwd_varlen`` -- the same forward and backward on
  variable-length sequences packed along the rows (FA3's ``flash_attn_varlen_func``): out
  (total_q, heads, head_dim) and lse (heads, total_q); the forward's autograd (registered
  here, in Python) runs ``dash::bwd_varlen`` with the claimed schedules.
* ``dash::bwd``  -- DASH's Hopper backward (C++/CUDA, registered by ``dash._C``),
  deterministic or not; ``dash::bwd_trace`` is the same with the kernel's step trace. This
  module gives both their fake (meta) implementations.

Call-time decisions: which kernel schedule ``"auto"`` means for a shape
(``resolve_schedule``), how many CTAs the persistent grid has (``grid_ctas``), and what
``deterministic=None`` means (``resolve_deterministic``).

Nothing here validates user input: callers run ``dash.validation`` first.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from dash import _ext
from dash.validation import backward_will_run


# ---------------------------------------------------------------------------------------
# Call-time decisions
# ---------------------------------------------------------------------------------------
def resolve_schedule(schedule: str, q: Tensor, k: Tensor, causal: bool, deterministic: bool, sm_margin: int) -> str:
    """Map ``schedule`` to a kernel schedule: a name as given, or for ``auto``
    ``dash.schedules.auto.choose_kernel_schedule`` (cached per shape): deterministic, the
    portable schedule the calibrated scheduling model ranks fastest for this shape, ranked for
    the same 132-CTA grid on every GPU so that neither the choice nor its bits depend on the
    SM count or ``sm_margin``; non-deterministic, a fixed measured rule
    (``dash.schedules.auto.nondeterministic_kernel_schedule``: causal ``descending`` from 2048
    queries, below that ``interleaved`` at hdim 128 and ``fa3`` at hdim 64; full ``fa3``, but
    ``shift`` at hdim 128 from 16384 queries where it runs), whose bits are not reproducible
    anyway.

    Under torch.compile with dynamic shapes the non-deterministic rule is traced on the
    symbolic sizes (guards on size ranges); the deterministic choice runs the model, which
    needs the sizes' values, so the graph is specialised on the shape (``_specialized_int``)."""
    if schedule != "auto":
        return schedule
    if not deterministic:
        from dash.schedules.auto import nondeterministic_kernel_schedule

        device = q.device.index if q.device.type == "cuda" else -1
        return nondeterministic_kernel_schedule(q.shape[1], k.shape[1], _specialized_int(q.shape[3]), bool(causal),
                                                _grid_ctas_constant(device, int(sm_margin)))
    batch, seqlen_q, heads, head_dim = (_specialized_int(x) for x in q.shape)
    seqlen_k, heads_kv = _specialized_int(k.shape[1]), _specialized_int(k.shape[2])
    return _auto_schedule(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, bool(causal))


def _specialized_int(size) -> int:
    """A size as a Python int, also while a graph is traced with symbolic sizes.

    The deterministic ``auto`` choice runs the scheduling model on the shape and the op needs
    it as a constant string. Under Dynamo with dynamic shapes (``dynamic=True``, or automatic
    dynamic shapes after a second shape) a size is symbolic and ``int()`` keeps it so;
    formatting it makes Dynamo specialise the graph on its value, with a guard (inside Dynamo a
    symbolic size also passes as an ``int``, so this test must come first). Outside Dynamo
    (``make_fx``, non-strict ``torch.export``) a ``SymInt`` is specialised with ``guard_int``.
    Either way each shape gets the schedule, and the bits, that eager mode gives it."""
    if torch.compiler.is_dynamo_compiling():
        return int(f"{size}")
    if isinstance(size, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import guard_int

        return guard_int(size)
    return int(size)


@torch._dynamo.assume_constant_result
def _auto_schedule(batch: int, heads: int, heads_kv: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                   causal: bool) -> str:
    """Deterministic ``auto``'s choice for a shape. A pure function of its arguments (the model
    is cached per shape and ranks for ``AUTO_REFERENCE_CTAS`` whatever the GPU), so
    torch.compile runs it once while tracing and keeps the name as a constant instead of
    tracing the NumPy model."""
    from dash.schedules.auto import AUTO_REFERENCE_CTAS, choose_kernel_schedule

    return choose_kernel_schedule(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, causal, AUTO_REFERENCE_CTAS,
                                  True)


@torch._dynamo.assume_constant_result
def _grid_ctas_constant(device: int, sm_margin: int) -> int:
    """``grid_ctas`` run once while torch.compile traces (it asks the CUDA runtime), kept as a
    constant of the graph."""
    return grid_ctas(device, sm_margin)


def grid_ctas(device: int | torch.device | None, sm_margin: int) -> int:
    """CTAs of the persistent grid: the device's SMs minus ``sm_margin`` (132, an H100/H200,
    where no CUDA device is there to ask)."""
    try:
        if isinstance(device, int) and device < 0:
            raise RuntimeError("not a CUDA device")
        from dash.validation import cuda_device_info

        index = device.index if isinstance(device, torch.device) else device
        sms = cuda_device_info(index)[1]
    except Exception:
        sms = 132
    return max(1, sms - int(sm_margin))


def resolve_deterministic(deterministic: Optional[bool], needs_grad: bool,
                          globally: Optional[bool] = None) -> bool:
    """``deterministic=None`` follows ``torch.are_deterministic_algorithms_enabled()``. An
    explicit False while that flag is on raises PyTorch's non-determinism alert, but only
    when a backward will run (``needs_grad``): a forward alone is deterministic anyway.

    ``globally``: the flag as the caller already read it (None: read it here), so that a
    caller that keys a decision on the flag decides on the same reading, whatever another
    thread sets meanwhile."""
    if globally is None:
        globally = torch.are_deterministic_algorithms_enabled()
    if deterministic is None:
        return globally
    if not deterministic and globally and needs_grad:
        from torch._prims_common import alert_not_deterministic

        alert_not_deterministic("DASH's attention backward with deterministic=False")
    return deterministic


#: What a second differentiation through DASH's attention raises (the same text as
#: csrc/autograd.cpp's kNotTwiceDifferentiable).
NOT_TWICE_DIFFERENTIABLE = (
    "DASH's attention backward is not differentiable: with create_graph=True its dq, dk, dv are exact first-order "
    "gradients, but differentiating them again (a gradient penalty, a Hessian-vector product) is not supported")


def first_order_only(grads: tuple[Tensor, ...], inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """The gradients as the backward returns them: themselves, or under create_graph=True (grad
    mode on, an input requiring grad) aliases whose node raises NOT_TWICE_DIFFERENTIABLE when a
    second backward reaches it, with edges to ``inputs`` so that it does when differentiating
    with respect to them (csrc/autograd.cpp says why)."""
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        return tuple(grads)
    error = torch._C._functions.DelayedError(NOT_TWICE_DIFFERENTIABLE.encode(), len(grads) + len(inputs))
    return tuple(error(*grads, *inputs)[:len(grads)])


# ---------------------------------------------------------------------------------------
# Forward and backward (C++, registered by dash._C): fakes for torch.compile, autograd
# ---------------------------------------------------------------------------------------
def forward_impl(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """DASH's forward kernel without autograd bookkeeping (benchmarks and tools call it).

    q (B, Sq, H, D), k and v (B, Sk, Hk, D) validated by ``dash.validation``, ``causal``
    bottom-right aligned; returns out (B, Sq, H, D) contiguous in q's dtype and lse (B, H, Sq)
    float32, -inf (and out 0) for rows that see no key."""
    with torch.no_grad():
        return torch.ops.dash.fwd(q, k, v, float(softmax_scale), bool(causal), False, "fa3", 0)


def _fwd_fake(q, k, v, softmax_scale, causal, deterministic, schedule, sm_margin):
    batch, seqlen_q, heads, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        (batch, heads, seqlen_q), dtype=torch.float32
    )


if _ext.kernels_available():  # the C++ schemas exist only when dash._C loaded
    # dash::fwd's autograd (the backward node running dash::bwd) is registered in C++
    # (csrc/autograd.cpp): a Python one cost more host time per call than the kernels.
    torch.library.register_fake("dash::fwd")(_fwd_fake)

    @torch.library.register_fake("dash::fwd_varlen")
    def _fwd_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                         deterministic, schedule, sm_margin):
        return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
            (q.shape[1], q.shape[0]), dtype=torch.float32
        )

    @torch.library.register_fake("dash::bwd_varlen")
    def _bwd_varlen_fake(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         softmax_scale, causal, deterministic, schedule, sm_margin):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    # The varlen forward's autograd, in Python (dash::fwd's is C++ for its host time at tiny
    # shapes; a packed batch is a training-sized call), with dash::fwd's rules: softmax_lse is
    # returned as a constant (no gradient flows through it), and under create_graph=True the
    # gradients are first order only (csrc/autograd.cpp, first_order_only).
    def _fwd_varlen_setup_context(ctx, inputs, output):
        q, k, v, cu_seqlens_q, cu_seqlens_k = inputs[:5]
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.mark_non_differentiable(lse)
        ctx.options = inputs[5:]  # max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic, schedule, sm_margin

    def _fwd_varlen_backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        with torch.no_grad():  # dash::bwd_varlen has no autograd of its own
            dq, dk, dv = torch.ops.dash.bwd_varlen(dout.contiguous(), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                   *ctx.options)
        return first_order_only((dq, dk, dv), (q, k, v)) + (None,) * 9

    torch.library.register_autograd("dash::fwd_varlen", _fwd_varlen_backward, setup_context=_fwd_varlen_setup_context)

    @torch.library.register_fake("dash::bwd")
    def _bwd_fake(dout, q, k, v, out, softmax_lse, softmax_scale, causal, deterministic, schedule, sm_margin):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    @torch.library.register_fake("dash::bwd_trace")
    def _bwd_trace_fake(dout, q, k, v, out, softmax_lse, softmax_scale, causal, deterministic, schedule, sm_margin):
        from dash.schedules import Problem, tile_problem

        # The step count sizes the trace: the model needs the sizes' values (symbolic under
        # dynamic shapes), so the graph is specialised on them as for auto's choice.
        batch, seqlen_q, heads, head_dim = (_specialized_int(x) for x in q.shape)
        seqlen_k, heads_kv = _specialized_int(k.shape[1]), _specialized_int(k.shape[2])
        p = Problem(batch, heads, seqlen_q, seqlen_k, head_dim=head_dim, heads_kv=heads_kv, causal=causal)
        steps = tile_problem(p).total_steps  # over all batches and heads
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                q.new_empty((steps, 8), dtype=torch.int64))


# ---------------------------------------------------------------------------------------
# Launching the ops on validated inputs
# ---------------------------------------------------------------------------------------
def forward_kernel_schedule(schedule: str, q: Tensor, k: Tensor, v: Tensor, causal: bool, deterministic: bool,
                            sm_margin: int) -> str:
    """The kernel schedule ``dash::fwd`` carries for its backward: ``schedule`` resolved as
    ``resolve_schedule`` does, except that "auto" stays unresolved ("fa3") when no backward
    will run: the schedule is then never used (and under torch.compile with dynamic shapes
    resolving it would specialise the graph on the shape for nothing)."""
    if schedule == "auto" and not backward_will_run(q, k, v):
        return "fa3"
    return resolve_schedule(schedule, q, k, causal, deterministic, sm_margin)


def run_forward(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, deterministic: bool,
                schedule: str, sm_margin: int) -> tuple[Tensor, Tensor]:
    """``dash::fwd`` (with autograd) on validated inputs; ``schedule`` may be "auto", which
    is resolved here (``forward_kernel_schedule``) because the backward it is saved for needs
    a kernel schedule."""
    kernel_schedule = forward_kernel_schedule(schedule, q, k, v, causal, deterministic, sm_margin)
    # The autograd registered on dash::fwd in C++ is the user path's autograd node.
    return torch.ops.dash.fwd(q, k, v, float(softmax_scale), causal, deterministic, kernel_schedule, int(sm_margin))


def _next_power_of_two(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def varlen_kernel_schedule(schedule: str, batch: int, heads: int, heads_kv: int, max_seqlen_q: int,
                           max_seqlen_k: int, head_dim: int, causal: bool, deterministic: bool,
                           needs_grad: bool) -> str:
    """The kernel schedule of a varlen batch's backward: ``schedule`` as given, or for "auto"
    the padded problem's choice (``resolve_schedule``'s rules on the longest lengths, ranked
    deterministically on power-of-two buckets of them and of the batch) among the claimed
    schedules, which are the ones built for varlen: deterministic ``auto`` only ever
    picks portable (claimed) ones; the non-deterministic rule's ``shift`` becomes ``fa3``, its
    fallback there. "fa3" when no backward will run (nothing uses it)."""
    if schedule != "auto":
        return schedule
    if not needs_grad:
        return "fa3"
    if deterministic:
        # Ranked on power-of-two buckets of the batch and the longest lengths: they change from
        # step to step in varlen training, and the model costs up to a second per new shape
        # (it is cached per shape). The choice stays a function of the call's arguments.
        batch, heads, heads_kv, head_dim = (_specialized_int(x) for x in (batch, heads, heads_kv, head_dim))
        bucket = _next_power_of_two
        return _auto_schedule(bucket(batch), heads, heads_kv, bucket(max_seqlen_q), bucket(max_seqlen_k), head_dim,
                              bool(causal))
    from dash.schedules.auto import nondeterministic_kernel_schedule

    chosen = nondeterministic_kernel_schedule(max_seqlen_q, max_seqlen_k, _specialized_int(head_dim), bool(causal),
                                              132)
    return "fa3" if chosen == "shift" else chosen


def run_forward_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                       max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, deterministic: bool,
                       schedule: str, sm_margin: int) -> tuple[Tensor, Tensor]:
    """``dash::fwd_varlen`` (with autograd through ``dash::bwd_varlen``) on validated inputs;
    ``schedule`` a kernel schedule (``varlen_kernel_schedule``). Returns out (total_q, heads,
    head_dim) and softmax_lse (heads, total_q)."""
    return torch.ops.dash.fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     float(softmax_scale), bool(causal), bool(deterministic), schedule, int(sm_margin))


def run_backward_varlen(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
                        cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                        softmax_scale: float, causal: bool, deterministic: bool, schedule: str,
                        sm_margin: int) -> tuple[Tensor, Tensor, Tensor]:
    """``dash::bwd_varlen`` on validated inputs (``schedule`` a kernel schedule,
    ``varlen_kernel_schedule``); returns new (dq, dk, dv) packed like q, k, v."""
    return torch.ops.dash.bwd_varlen(dout.contiguous(), q, k, v, out.contiguous(), softmax_lse.contiguous(),
                                     cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                     float(softmax_scale), bool(causal), bool(deterministic), schedule, int(sm_margin))


def run_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
                 softmax_scale: float, causal: bool, deterministic: bool, schedule: str,
                 sm_margin: int) -> tuple[Tensor, Tensor, Tensor]:
    """``dash::bwd`` on validated inputs; returns new (dq, dk, dv) tensors."""
    kernel_schedule = resolve_schedule(schedule, q, k, causal, deterministic, sm_margin)
    return torch.ops.dash.bwd(dout.contiguous(), q, k, v, out.contiguous(), softmax_lse.contiguous(),
                              float(softmax_scale), causal, deterministic, kernel_schedule, int(sm_margin))
