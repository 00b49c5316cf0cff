"""FA3-compatible attention API.

``flash_attn_func`` takes FA3's arguments with FA3's meaning (names, order, return
convention of ``hopper/flash_attn_interface.py``) plus DASH's own ``schedule`` at the end.
Every argument is validated before anything is launched; unsupported features are
accepted by name and rejected with a "not supported yet" error.

Ops (registered with ``torch.library`` so ``torch.compile`` traces them):

* ``dash::fwd``  -- the forward. Until DASH's own forward kernel exists it runs PyTorch's
  SDPA (flash, or memory-efficient with an explicit bottom-right causal bias when
  seqlen_q != seqlen_k) and returns (out, lse) in FA3's layout and LSE convention
  (natural log of sum_j exp(scale * s_ij); -inf for rows that see no key).
* ``dash::bwd``  -- DASH's Hopper backward (C++/CUDA), deterministic or not.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

import torch
from torch import Tensor

from dash import _ext
from dash.config import KERNEL_SCHEDULES, PORTABLE_KERNEL_SCHEDULES, SUPPORTED_HEAD_DIMS, bwd_tile_config
from dash.schedules.orders import SCHEDULE_NAMES as MODEL_SCHEDULE_NAMES

#: Every schedule name the API knows (the scheduling model's names plus "auto").
SCHEDULE_NAMES: tuple[str, ...] = ("auto",) + MODEL_SCHEDULE_NAMES

_DTYPES = (torch.bfloat16, torch.float16)
_TMA_ALIGN_BYTES = 16


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------
def _describe(t: Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _check_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def validate_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    sm_margin: int = 0,
    schedule: str = "auto",
    deterministic: Optional[bool] = None,
    check_device: bool = True,
) -> None:
    """Raise a clear error (naming the argument, its value and what is supported) for any
    input DASH cannot run. Shapes: q (B, Sq, H, D), k and v (B, Sk, Hk, D), H % Hk == 0.

    ``check_device=False`` skips what needs the real device (its type, compute capability,
    SM count and the data pointers' alignment); flash_attn_func passes it while torch.compile
    traces and then checks the device type alone (fake tensors keep it)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (batch, seqlen, heads, head_dim); got {_describe(t)}")
    if check_device:
        _check_cuda_devices(q, k, v)
        cc = torch.cuda.get_device_capability(q.device)
        if cc != (9, 0):
            raise ValueError(
                f"q is on {torch.cuda.get_device_name(q.device)} with compute capability {cc[0]}.{cc[1]}; "
                "DASH's kernels need compute capability 9.0 (sm_90a: H100/H200/H800/H20)"
            )
    if q.dtype not in _DTYPES:
        raise ValueError(f"q has dtype {q.dtype}; supported: torch.bfloat16, torch.float16")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}; q, k, v must share one dtype")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if any(s == 0 for s in t.shape):
            raise ValueError(f"{name} is empty ({_describe(t)}); batch, seqlen, heads and head_dim must be >= 1")
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous in its last dim (stride 1), got strides {tuple(t.stride())}; "
                "call .contiguous()"
            )
    batch, _, heads, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"batch sizes differ: q {batch}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"seqlen_k differs between k ({k.shape[1]}) and v ({v.shape[1]})")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"heads differ between k ({k.shape[2]}) and v ({v.shape[2]})")
    if heads % k.shape[2] != 0:
        raise ValueError(
            f"q has {heads} heads, which is not divisible by the {k.shape[2]} heads of k/v "
            "(GQA/MQA need heads_q % heads_kv == 0)"
        )
    if k.shape[3] != head_dim:
        raise ValueError(f"k has head_dim {k.shape[3]} but q has {head_dim}; they must match")
    if v.shape[3] != head_dim:
        raise NotImplementedError(
            f"v has head_dim {v.shape[3]} != q's {head_dim}; a different value head dim is not supported yet"
        )
    if head_dim not in SUPPORTED_HEAD_DIMS:
        supported = ", ".join(map(str, SUPPORTED_HEAD_DIMS))
        raise NotImplementedError(f"head_dim={head_dim} is not supported yet; supported head dims: {supported}")
    info = _ext.manifest()
    if info.get("kernels_built") and head_dim not in info.get("head_dims", []):
        built = ", ".join(map(str, info.get("head_dims", []))) or "none"
        raise NotImplementedError(
            f"head_dim={head_dim} is not built in this install; built: {built} (rebuild with DASH_HDIMS)"
        )
    if info.get("kernels_built") and str(q.dtype).replace("torch.", "") not in info.get("dtypes", []):
        built = ", ".join(info.get("dtypes", [])) or "none"
        raise NotImplementedError(f"dtype {q.dtype} is not built in this install; built: {built} (rebuild with DASH_DTYPES)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if check_device and not _aligned(t):
            raise ValueError(
                f"{name} has strides {tuple(t.stride())} / data pointer not aligned to 16 bytes, which the TMA "
                "loads need; call .contiguous()"
            )
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)
        or not math.isfinite(softmax_scale) or softmax_scale <= 0
    ):
        raise ValueError(f"softmax_scale={softmax_scale!r} must be None or a finite positive number")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    is_causal = effective_causal(window_size, causal, q.shape[1], k.shape[1])
    if softcap != 0.0:
        raise NotImplementedError(f"softcap={softcap}: softcapping is not supported yet; use 0.0")
    if not isinstance(sm_margin, numbers.Integral) or isinstance(sm_margin, bool) or sm_margin < 0:
        raise ValueError(f"sm_margin={sm_margin!r} must be an int >= 0")
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if check_device else None
    if sms is not None and sm_margin >= sms:
        raise ValueError(f"sm_margin={sm_margin} leaves no SM free on this GPU ({sms} SMs)")
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be None or a bool, got {deterministic!r}")
    if not isinstance(schedule, str) or schedule not in SCHEDULE_NAMES:
        raise ValueError(f"schedule={schedule!r} is unknown; choose one of {', '.join(SCHEDULE_NAMES)}")
    if schedule != "auto" and schedule not in KERNEL_SCHEDULES:
        raise NotImplementedError(
            f"schedule={schedule!r} is modelled (python -m dash simulate) but not implemented by the kernel yet; "
            f"implemented: {', '.join(KERNEL_SCHEDULES)}, auto"
        )
    if schedule == "shift":
        if is_causal:
            raise NotImplementedError("schedule='shift' is for full masks; with causal=True use 'descending', "
                                      "'interleaved', 'fa3' or 'auto'")
        ctas = sms - sm_margin if sms is not None else None
        cfg = bwd_tile_config(head_dim, False)
        lanes = min(-(-k.shape[1] // cfg.block_n), ctas or 1)
        if lanes > -(-q.shape[1] // cfg.block_m):
            raise NotImplementedError(
                f"schedule='shift' needs at most as many concurrently running columns of a head ({lanes}) as Q tiles "
                f"({-(-q.shape[1] // cfg.block_m)}) (seqlen_q={q.shape[1]}, seqlen_k={k.shape[1]}); use 'auto'")


def _check_cuda_devices(q: Tensor, k: Tensor, v: Tensor) -> None:
    """q, k, v on one CUDA device. Works on torch.compile's fake tensors too (they keep their
    device), so a compiled call on CPU tensors gets DASH's error, not the dispatcher's."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cuda":
            raise ValueError(
                f"{name} is on device {t.device}; DASH runs on CUDA devices of compute capability 9.0 "
                "(H100/H200/H800/H20). Move the tensors with .cuda()."
            )
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all inputs must share one device")


def effective_causal(window_size: Sequence[int], causal: bool, seqlen_q: int, seqlen_k: int) -> bool:
    """FA3's mask normalisation: a window side at least as long as the sequence is unbounded,
    causal forces the right side to 0, and (unbounded, 0) *is* causal. Returns whether the
    mask is causal; raises for a real sliding window (not supported yet)."""
    if window_size is None or len(tuple(window_size)) != 2 or not all(
        isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window_size
    ):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 meaning unbounded; got {window_size!r}")
    left, right = (int(w) for w in window_size)
    left = -1 if left < 0 or left >= seqlen_k - 1 else left
    right = -1 if right < 0 or right >= seqlen_q - 1 else right
    if causal:
        right = 0
    if left < 0 and right < 0:
        return False
    if left < 0 and right == 0:
        return True
    raise NotImplementedError(
        f"window_size={tuple(window_size)} (causal={causal}): sliding-window attention is not supported yet; "
        "use (-1, -1), or causal=True"
    )


def resolve_schedule(schedule: str, q: Tensor, k: Tensor, causal: bool, deterministic: bool, sm_margin: int) -> str:
    """Map ``schedule`` to a kernel schedule: a name as given, or for ``auto`` the portable
    schedule the calibrated scheduling model ranks fastest for this shape and grid
    (``dash.schedules.auto.choose_kernel_schedule``; cached per shape). ``auto`` never picks a
    schedule whose bits depend on the GPU's SM count."""
    if schedule != "auto":
        return schedule
    batch, seqlen_q, heads, head_dim = (int(x) for x in q.shape)
    seqlen_k, heads_kv = int(k.shape[1]), int(k.shape[2])
    device = q.device.index if q.device.type == "cuda" else -1
    return _auto_schedule(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, bool(causal), device,
                          int(sm_margin), bool(deterministic))


@torch._dynamo.assume_constant_result
def _auto_schedule(batch: int, heads: int, heads_kv: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                   causal: bool, device: int, sm_margin: int, deterministic: bool) -> str:
    """``auto``'s choice for a shape. A pure function of its arguments (the model is cached
    per shape), so torch.compile runs it once while tracing and keeps the name as a constant
    instead of tracing the NumPy model."""
    from dash.schedules.auto import choose_kernel_schedule

    return choose_kernel_schedule(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, causal,
                                  _grid_ctas(device, sm_margin), deterministic)


def _grid_ctas(device: int | torch.device | None, sm_margin: int) -> int:
    """CTAs of the persistent grid: the device's SMs minus ``sm_margin`` (132, an H100/H200,
    where no CUDA device is there to ask)."""
    try:
        if isinstance(device, int) and device < 0:
            raise RuntimeError("not a CUDA device")
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    except Exception:
        sms = 132
    return max(1, sms - int(sm_margin))


def _resolve_deterministic(deterministic: Optional[bool], needs_grad: bool) -> bool:
    globally = torch.are_deterministic_algorithms_enabled()
    if deterministic is None:
        return globally
    if not deterministic and globally and needs_grad:
        from torch._prims_common import alert_not_deterministic

        alert_not_deterministic("dash.flash_attn_func backward with deterministic=False")
    return deterministic


# ---------------------------------------------------------------------------------------
# Forward (PyTorch SDPA until DASH's forward kernel lands)
# ---------------------------------------------------------------------------------------
def _sdpa_forward(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    if heads_k != heads:
        k = k.repeat_interleave(heads // heads_k, dim=2)
        v = v.repeat_interleave(heads // heads_k, dim=2)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, S, D) views
    if not causal or seqlen_q == seqlen_k:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal, False, scale=softmax_scale)[:2]
    else:
        # FA3's bottom-right causal alignment (SDPA's is_causal is top-left): key j is
        # visible to query i iff j <= i + seqlen_k - seqlen_q. The bias' last dim is padded
        # to a multiple of 16 elements, as the memory-efficient kernel requires.
        rows = torch.arange(seqlen_q, device=q.device)[:, None]
        cols = torch.arange(seqlen_k, device=q.device)[None, :]
        padded = (seqlen_k + 15) // 16 * 16
        bias = torch.zeros(seqlen_q, padded, dtype=q.dtype, device=q.device)[:, :seqlen_k]
        bias.masked_fill_(cols > rows + (seqlen_k - seqlen_q), float("-inf"))
        bias = bias.expand(batch, heads, seqlen_q, seqlen_k)
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            qt, kt, vt, bias, True, 0.0, False, scale=softmax_scale
        )[:2]
        lse = lse[:, :, :seqlen_q]
        empty_rows = seqlen_q - seqlen_k  # rows that see no key (only when seqlen_q > seqlen_k)
        if empty_rows > 0:
            out = out.clone()
            lse = lse.clone()
            out[:, :, :empty_rows] = 0
            lse[:, :, :empty_rows] = float("-inf")
    return out.transpose(1, 2).contiguous(), lse.float().contiguous()


@torch.library.custom_op("dash::fwd", mutates_args=(), device_types="cuda")
def _fwd_op(
    q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, deterministic: bool, schedule: str,
    sm_margin: int,
) -> tuple[Tensor, Tensor]:
    return _sdpa_forward(q, k, v, softmax_scale, causal)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, deterministic, schedule, sm_margin):
    batch, seqlen_q, heads, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        (batch, heads, seqlen_q), dtype=torch.float32
    )


def _aligned(t: Tensor) -> bool:
    """The backward's TMA loads need a unit last stride and 16-byte aligned strides/base."""
    elem = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % _TMA_ALIGN_BYTES == 0 and all(
        (s * elem) % _TMA_ALIGN_BYTES == 0 for s, n in zip(t.stride()[:3], t.shape[:3]) if n > 1
    )


def _fwd_setup_context(ctx, inputs, output) -> None:
    q, k, v, softmax_scale, causal, deterministic, schedule, sm_margin = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.deterministic = deterministic
    ctx.schedule = schedule
    ctx.sm_margin = sm_margin


def _fwd_backward(ctx, dout: Tensor, dlse: Optional[Tensor]):
    # The LSE output is for inspection (return_attn_probs); like FA3, no gradient flows
    # through it.
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.dash.bwd(
        dout.contiguous(), q, k, v, out, lse, ctx.softmax_scale, ctx.causal, ctx.deterministic, ctx.schedule,
        ctx.sm_margin,
    )
    return dq, dk, dv, None, None, None, None, None


torch.library.register_autograd("dash::fwd", _fwd_backward, setup_context=_fwd_setup_context)


if _ext.kernels_available():  # the C++ schema of dash::bwd exists only when dash._C loaded

    @torch.library.register_fake("dash::bwd")
    def _bwd_fake(dout, q, k, v, out, softmax_lse, softmax_scale, causal, deterministic, schedule, sm_margin):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    @torch.library.register_fake("dash::bwd_trace")
    def _bwd_trace_fake(dout, q, k, v, out, softmax_lse, softmax_scale, causal, deterministic, schedule, sm_margin):
        from dash.schedules import Problem, tile_problem

        p = Problem(q.shape[0], q.shape[2], q.shape[1], k.shape[1], head_dim=q.shape[3], heads_kv=k.shape[2],
                    causal=causal)
        steps = tile_problem(p).total_steps  # over all batches and heads
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                q.new_empty((steps, 8), dtype=torch.int64))


def attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor, *,
    softmax_scale: Optional[float] = None, causal: bool = False, deterministic: bool = False,
    schedule: str = "auto", sm_margin: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Run DASH's backward directly on a forward's (out, softmax_lse), whichever forward
    produced them (same LSE convention). Returns (dq, dk, dv) shaped like q, k, v."""
    validate_inputs(q, k, v, softmax_scale=softmax_scale, causal=causal, sm_margin=sm_margin, schedule=schedule,
                    deterministic=deterministic)
    for name, t in (("dout", dout), ("out", out)):
        _check_tensor(name, t)
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must match q (shape {tuple(q.shape)}, {q.dtype}, {q.device}); got {_describe(t)}")
    _check_tensor("softmax_lse", softmax_lse)
    expected = (q.shape[0], q.shape[2], q.shape[1])
    if tuple(softmax_lse.shape) != expected or softmax_lse.dtype != torch.float32:
        raise ValueError(f"softmax_lse must be float32 of shape {expected}; got {_describe(softmax_lse)}")
    _ext.require_kernels()
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return torch.ops.dash.bwd(dout.contiguous(), q, k, v, out.contiguous(), softmax_lse.contiguous(), float(scale),
                              causal, deterministic, resolve_schedule(schedule, q, k, causal, deterministic, sm_margin),
                              sm_margin)


# ---------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------
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
    heads % heads_kv == 0 (GQA/MQA). bf16 or fp16, on a compute capability 9.0 GPU.
    causal=True aligns the mask to the bottom-right corner (FA3's convention).

    deterministic: None follows ``torch.are_deterministic_algorithms_enabled()``; True makes
        the backward bitwise reproducible; False while that global flag is on raises
        PyTorch's non-determinism alert.
    schedule: the deterministic reduction schedule, "auto" or a name (see
        ``python -m dash simulate --schedule all``).
    sm_margin: SMs to leave free for other work (the persistent grid uses the rest).

    Returns out (batch, seqlen_q, heads, head_dim), or (out, softmax_lse) with
    return_attn_probs=True; softmax_lse is float32 (batch, heads, seqlen_q).
    """
    if qv is not None:
        raise NotImplementedError("qv is not supported yet; pass qv=None")
    for name, val in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if val is not None:
            raise NotImplementedError(f"{name} (FP8 attention) is not supported yet; pass {name}=None")
    if attention_chunk != 0:
        raise NotImplementedError(f"attention_chunk={attention_chunk} is not supported yet; use 0")
    if num_splits not in (0, 1):
        raise NotImplementedError(f"num_splits={num_splits} (split-KV forward) is not supported yet; use 1")
    # While torch.compile traces, tensors are fakes (no data pointer, no device to query);
    # the op's C++ checks still run on the real tensors.
    tracing = torch.compiler.is_compiling()
    if tracing:
        for name, t in (("q", q), ("k", k), ("v", v)):
            _check_tensor(name, t)
        _check_cuda_devices(q, k, v)
    validate_inputs(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                    sm_margin=sm_margin, schedule=schedule, deterministic=deterministic, check_device=not tracing)
    if not tracing:
        _ext.require_kernels()
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    det = _resolve_deterministic(deterministic, needs_grad)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    causal = effective_causal(window_size, causal, q.shape[1], k.shape[1])
    sched = resolve_schedule(schedule, q, k, causal, det, int(sm_margin))
    out, lse = torch.ops.dash.fwd(q, k, v, scale, causal, det, sched, int(sm_margin))
    return (out, lse) if return_attn_probs else out


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
    with ``num_heads_q`` given (GQA packing: q heads first, then k, then v)."""
    _check_tensor("qkv", qkv)
    if qkv.dim() == 5 and qkv.shape[2] == 3 and num_heads_q is None:
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
            f"with num_heads_q; got {_describe(qkv)} and num_heads_q={num_heads_q}"
        )
    return flash_attn_func(q, k, v, softmax_scale, causal, None, q_descale, k_descale, v_descale, window_size,
                           attention_chunk, softcap, 1, None, deterministic, sm_margin, return_attn_probs, schedule)


def flash_attn_varlen_func(*args, **kwargs):
    """FA3's variable-length API: not supported yet."""
    raise NotImplementedError(
        "flash_attn_varlen_func (variable-length sequences) is not supported yet; pad to a batch and use flash_attn_func"
    )
