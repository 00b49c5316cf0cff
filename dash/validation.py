"""Every check DASH makes on what a caller passes, before anything is launched.

Each check raises the exception a caller would expect (TypeError for a wrong type,
ValueError for a bad value, NotImplementedError for a feature DASH does not have yet) with a
message that names the argument, the value it got and what is supported. The public
functions (``dash.api``) and FA3's low-level entry points (``dash.flash_attn_interface``)
call these; none of them launches anything.

Order matters for users on the wrong machine: ``validate_inputs`` checks the device before
anything else about the tensors, so a call on CPU tensors says "move them to a Hopper GPU"
rather than reporting a head dim that would also be wrong there.
"""

from __future__ import annotations

import functools

import math
import numbers
from typing import Optional, Sequence

import torch
from torch import Tensor

from dash import _ext
from dash.config import KERNEL_SCHEDULES, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, shift_lanes
from dash.schedules.orders import SCHEDULE_NAMES as MODEL_SCHEDULE_NAMES

#: Every schedule name the API knows (the scheduling model's names plus "auto").
SCHEDULE_NAMES: tuple[str, ...] = ("auto",) + MODEL_SCHEDULE_NAMES

#: dtypes of q, k, v (and of out, dout, dq, dk, dv).
TENSOR_DTYPES: tuple[torch.dtype, ...] = tuple(getattr(torch, name) for name in SUPPORTED_DTYPES)
#: The kernels' TMA loads need 16-byte aligned base pointers and strides.
TMA_ALIGN_BYTES = 16
#: The kernel schedules built for variable-length batches (flash_attn_varlen_func): the claimed
#: ones (csrc/schedule/schedule.h); shift's static waves assume heads of equal length.
VARLEN_KERNEL_SCHEDULES: tuple[str, ...] = tuple(n for n in KERNEL_SCHEDULES if n != "shift")
#: Largest batch and number of query heads the backward runs: its pre/post-process grids are
#: (Q tiles, heads, batch), and CUDA limits a grid's y and z dimensions to 65535.
BWD_MAX_BATCH_HEADS = 65535

#: FA3 arguments for features DASH does not have, each accepted only at its "off" value
#: (None). The text says what the argument is for, so the error explains what is missing.
_FEATURES_OFF_WHEN_NONE: dict[str, str] = {
    "k_new": "appending keys to a KV cache",
    "v_new": "appending values to a KV cache",
    "qv": "a separate query for the value head dim, as in MLA",
    "cu_seqlens_q": "variable-length sequences",
    "cu_seqlens_k": "variable-length sequences",
    "cu_seqlens_k_new": "variable-length appended keys",
    "seqused_q": "per-sequence used query lengths",
    "seqused_k": "per-sequence used key lengths",
    "sequed_q": "per-sequence used query lengths",  # FA3's backward spells seqused_q this way
    "sequed_k": "per-sequence used key lengths",
    "page_table": "a paged KV cache",
    "kv_batch_idx": "KV cache batch indices",
    "leftpad_k": "left-padded keys",
    "rotary_cos": "rotary embedding applied inside attention",
    "rotary_sin": "rotary embedding applied inside attention",
    "seqlens_rotary": "rotary embedding applied inside attention",
    "q_descale": "FP8 attention",
    "k_descale": "FP8 attention",
    "v_descale": "FP8 attention",
    "scheduler_metadata": "FA3's precomputed scheduler metadata from get_scheduler_metadata",
}


# ---------------------------------------------------------------------------------------
# Small checks, shared by the API and the FA3 entry points
# ---------------------------------------------------------------------------------------
def describe_tensor(t: Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_bshd(name: str, t: object) -> Tensor:
    """A tensor of 4 dims (batch, seqlen, heads, head_dim): the first checks validate_inputs
    makes, available alone to code that needs the sequence lengths early."""
    check_tensor(name, t)
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dims (batch, seqlen, heads, head_dim); got {describe_tensor(t)}")
    return t


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


@functools.lru_cache(maxsize=None)
def cuda_device_info(index: Optional[int]) -> tuple[tuple[int, int], int]:
    """(compute capability, SM count) of CUDA device ``index`` (None: the current one), asked
    once per device: a device's properties do not change, and asking costs microseconds of
    host time on every attention call otherwise."""
    if index is None:
        index = torch.cuda.current_device()
        return cuda_device_info(index)
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count


@functools.lru_cache(maxsize=None)
def _check_built(head_dim: int, dtype: torch.dtype) -> None:
    """Raise when this install's kernels were built without ``head_dim`` or ``dtype`` (the
    manifest does not change while the process runs: answered once per pair)."""
    info = _ext.manifest()
    if info.get("kernels_built") and head_dim not in info.get("head_dims", []):
        built = ", ".join(map(str, info.get("head_dims", []))) or "none"
        raise NotImplementedError(
            f"head_dim={head_dim} is not built in this install; built: {built} (rebuild with DASH_HDIMS)"
        )
    if info.get("kernels_built") and str(dtype).replace("torch.", "") not in info.get("dtypes", []):
        built = ", ".join(info.get("dtypes", [])) or "none"
        raise NotImplementedError(
            f"dtype {dtype} is not built in this install; built: {built} (rebuild with DASH_DTYPES)")


def check_cuda_devices(q: Tensor, k: Tensor, v: Tensor) -> None:
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


def is_tma_aligned(t: Tensor) -> bool:
    """The kernels' TMA loads need a unit last stride and 16-byte aligned strides/base."""
    elem = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % TMA_ALIGN_BYTES == 0 and all(
        (s * elem) % TMA_ALIGN_BYTES == 0 for s, n in zip(t.stride()[:3], t.shape[:3]) if n > 1
    )


def backward_will_run(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether flash_attn_func's autograd will record a backward for these inputs: grad mode
    is on and q, k or v requires grad."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def contiguous_last_dim(t: object) -> object:
    """FA3's ``maybe_contiguous``: FA3's entry points copy a tensor whose last dim is strided
    rather than reject it, and so do DASH's (the kernels need a unit last stride). Anything
    else, a non-tensor included, is returned as it is, for validation to report."""
    return t.contiguous() if isinstance(t, Tensor) and t.dim() > 0 and t.stride(-1) != 1 else t


# softcap, attention_chunk and num_splits are a float and ints in FA3's op schema, which
# refuses None: a wrong type is a TypeError here too, not a missing feature.
def check_softcap(softcap: object) -> None:
    if not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a float (0.0: no softcapping), got {softcap!r}")
    if softcap != 0.0:
        raise NotImplementedError(f"softcap={softcap}: softcapping is not supported yet; use 0.0")


def check_attention_chunk(attention_chunk: object) -> None:
    if not isinstance(attention_chunk, numbers.Integral):
        raise TypeError(f"attention_chunk must be an int (0: no chunking), got {attention_chunk!r}")
    if attention_chunk != 0:
        raise NotImplementedError(f"attention_chunk={attention_chunk} is not supported yet; use 0")


def check_num_splits(num_splits: object) -> None:
    # FA3: 1 = no split, > 1 = that many splits, <= 0 = its heuristic decides. DASH's forward
    # never splits, so 0 ("you decide") means the same as 1; negative values, which FA3 treats
    # like 0 without documenting them, are refused rather than guessed at.
    if not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int (1: no split, 0: FA3's heuristic), got {num_splits!r}")
    if num_splits not in (0, 1):
        raise NotImplementedError(f"num_splits={num_splits} (split-KV forward) is not supported yet; use 1")


def reject_unsupported_fa3_arguments(**arguments: object) -> None:
    """NotImplementedError for the first FA3 argument (in the order given) that asks for a
    feature DASH does not have: a tensor argument of ``_FEATURES_OFF_WHEN_NONE`` that is not
    None, ``attention_chunk`` != 0, ``num_splits`` other than 0/1, ``softcap`` != 0 (TypeError
    where one of these three is not a number, None included). Looks only at the arguments'
    values, never at q, k, v, so it can run first."""
    for name, value in arguments.items():
        if name in _FEATURES_OFF_WHEN_NONE:
            if value is not None:
                got = f"a tensor of {describe_tensor(value)}" if isinstance(value, Tensor) else repr(value)
                raise NotImplementedError(
                    f"{name} ({_FEATURES_OFF_WHEN_NONE[name]}) is not supported yet; pass {name}=None (got {got})"
                )
        elif name == "attention_chunk":
            check_attention_chunk(value)
        elif name == "num_splits":
            check_num_splits(value)
        elif name == "softcap":
            check_softcap(value)
        else:
            raise AssertionError(f"reject_unsupported_fa3_arguments has no rule for {name!r}")


# ---------------------------------------------------------------------------------------
# Masks: FA3's window_size / causal normalisation
# ---------------------------------------------------------------------------------------
def _is_int(w: object) -> bool:
    return isinstance(w, numbers.Integral) and not isinstance(w, bool)


def _mask_is_causal(left: int, right: int, causal: bool, seqlen_q: int, seqlen_k: int, given: str,
                    unbounded: str, causal_arg: str) -> bool:
    """FA3's mask normalisation: a window side at least as long as the sequence is unbounded,
    causal forces the right side to 0, and (unbounded, 0) *is* causal. ``given``,
    ``unbounded`` and ``causal_arg`` spell the window and the causal flag the way the
    caller's API does, for the error."""
    left = -1 if left < 0 or left >= seqlen_k - 1 else left
    right = -1 if right < 0 or right >= seqlen_q - 1 else right
    if causal:
        right = 0
    if left < 0 and right < 0:
        return False
    if left < 0 and right == 0:
        return True
    raise NotImplementedError(
        f"{given} ({causal_arg}={causal}): sliding-window attention is not supported yet; use {unbounded}, "
        f"or {causal_arg}=True"
    )


def effective_causal(window_size: Sequence[int], causal: bool, seqlen_q: int, seqlen_k: int) -> bool:
    """Whether ``window_size`` (flash_attn_func's (left, right) pair, -1 unbounded) with
    ``causal`` is the causal mask (True) or no mask (False); raises NotImplementedError for
    a real sliding window (not supported yet)."""
    # The default, an exact tuple (an array or tensor compared with == would not give one bool).
    if type(window_size) is tuple and window_size == (-1, -1) and isinstance(causal, bool):
        return causal
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(_is_int(w) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 meaning unbounded; got {window_size!r}")
    left, right = (int(w) for w in window_size)
    return _mask_is_causal(left, right, causal, seqlen_q, seqlen_k, given=f"window_size={tuple(window_size)}",
                           unbounded="(-1, -1)", causal_arg="causal")


def effective_causal_from_sides(window_size_left: int, window_size_right: int, causal: bool, seqlen_q: int,
                                seqlen_k: int, *, causal_arg: str = "causal") -> bool:
    """effective_causal for FA3's low-level entry points, which take the window as two ints
    (``window_size_left``, ``window_size_right``) and the causal flag as ``causal_arg``
    (the forward's ``causal``, the backward's ``is_causal``); errors name those arguments."""
    for name, w in (("window_size_left", window_size_left), ("window_size_right", window_size_right)):
        if not _is_int(w):
            raise TypeError(f"{name} must be an int (-1 meaning unbounded), got {w!r}")
    return _mask_is_causal(int(window_size_left), int(window_size_right), causal, seqlen_q, seqlen_k,
                           given=f"window_size_left={window_size_left}, window_size_right={window_size_right}",
                           unbounded="window_size_left=-1, window_size_right=-1", causal_arg=causal_arg)


# ---------------------------------------------------------------------------------------
# q, k, v and the options of one call
# ---------------------------------------------------------------------------------------
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
    backward: Optional[bool] = None,
    check_device: bool = True,
) -> None:
    """Raise a clear error (naming the argument, its value and what is supported) for any
    input DASH cannot run. Shapes: q (B, Sq, H, D), k and v (B, Sk, Hk, D), H % Hk == 0.

    ``backward``: whether a backward will run on these inputs, which adds the backward's
    limits (batch and heads at most ``BWD_MAX_BATCH_HEADS``); None means "if grad mode is on
    and q, k or v requires grad", as for flash_attn_func's autograd.

    ``check_device=False`` skips what needs the real device (its type, compute capability,
    SM count and the data pointers' alignment); flash_attn_func passes it while torch.compile
    traces and then checks the device type alone (fake tensors keep it).

    A call whose shapes, strides, dtypes, devices and options (with their types) equal those
    of an earlier valid call needs only the data pointers' alignment checked again: that is
    all of validation that depends on more than the key (a few microseconds of host time per
    attention call saved)."""
    key = None
    if check_device and type(q) is Tensor and type(k) is Tensor and type(v) is Tensor and type(window_size) is tuple:
        if backward is None:
            backward = backward_will_run(q, k, v)
        key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(),
               v.dtype, v.device, window_size, softmax_scale, type(softmax_scale), causal, type(causal), softcap,
               type(softcap), sm_margin, type(sm_margin), schedule, deterministic, type(deterministic), backward)
        try:
            known = key in _VALID_CALLS
        except TypeError:  # an unhashable option (a list for a str, say): full validation names it
            key, known = None, False
        if known and (q.data_ptr() | k.data_ptr() | v.data_ptr()) % TMA_ALIGN_BYTES == 0:
            return
    _validate_inputs(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                     sm_margin=sm_margin, schedule=schedule, deterministic=deterministic, backward=backward,
                     check_device=check_device)
    if key is not None:
        if len(_VALID_CALLS) >= 4096:  # bounded: a long-running process with ever new shapes
            _VALID_CALLS.clear()
        _VALID_CALLS.add(key)


#: Keys of validate_inputs calls that passed (see there).
_VALID_CALLS: set = set()


def _validate_inputs(q: Tensor, k: Tensor, v: Tensor, *, softmax_scale, causal, window_size, softcap, sm_margin,
                     schedule, deterministic, backward, check_device) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_bshd(name, t)
    if check_device:
        check_cuda_devices(q, k, v)
        cc, _ = cuda_device_info(q.device.index)
        if cc != (9, 0):
            raise ValueError(
                f"q is on {torch.cuda.get_device_name(q.device)} with compute capability {cc[0]}.{cc[1]}; "
                "DASH's kernels need compute capability 9.0 (sm_90a: H100/H200/H800/H20)"
            )
    if q.dtype not in TENSOR_DTYPES:
        raise ValueError(f"q has dtype {q.dtype}; supported: torch.bfloat16, torch.float16")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}; q, k, v must share one dtype")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.numel() == 0:
            raise ValueError(f"{name} is empty ({describe_tensor(t)}); batch, seqlen, heads and head_dim must be >= 1")
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
    if backward is None:
        backward = backward_will_run(q, k, v)
    if backward:
        for name, value in (("batch", batch), ("heads", heads)):
            if value > BWD_MAX_BATCH_HEADS:
                raise NotImplementedError(
                    f"{name}={value} is not supported by the backward yet: at most {BWD_MAX_BATCH_HEADS} (a CUDA "
                    f"grid dimension of its pre/post-processing); split the {name} into calls of at most that many"
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
    _check_built(head_dim, q.dtype)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if check_device and not is_tma_aligned(t):
            # .contiguous() of a contiguous tensor is that tensor, misaligned pointer and all.
            fix = ".clone()" if t.is_contiguous() else ".contiguous()"
            raise ValueError(
                f"{name} has strides {tuple(t.stride())} / data pointer not aligned to 16 bytes, which the TMA "
                f"loads need; call {fix}"
            )
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)
        or not math.isfinite(softmax_scale) or softmax_scale <= 0
    ):
        raise ValueError(f"softmax_scale={softmax_scale!r} must be None or a finite positive number")
    check_bool("causal", causal)
    is_causal = effective_causal(window_size, causal, q.shape[1], k.shape[1])
    check_softcap(softcap)
    if not isinstance(sm_margin, numbers.Integral) or isinstance(sm_margin, bool) or sm_margin < 0:
        raise ValueError(f"sm_margin={sm_margin!r} must be an int >= 0")
    sms = cuda_device_info(q.device.index)[1] if check_device else None
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
        lanes, q_tiles = shift_lanes(q.shape[1], k.shape[1], head_dim, sms - sm_margin if sms is not None else 1)
        if lanes > q_tiles:
            raise NotImplementedError(
                f"schedule='shift' needs at most as many concurrently running columns of a head ({lanes}) as Q tiles "
                f"({q_tiles}) (seqlen_q={q.shape[1]}, seqlen_k={k.shape[1]}); use 'auto'")


def validate_varlen_inputs(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: object, cu_seqlens_k: object,
                           max_seqlen_q: object, max_seqlen_k: object, *, softmax_scale, causal, window_size, softcap,
                           sm_margin, schedule, deterministic, backward: Optional[bool] = None) -> bool:
    """validate_inputs for ``flash_attn_varlen_func``: q (total_q, H, D), k and v (total_k, Hk, D)
    hold the sequences packed along the rows; ``cu_seqlens_q`` / ``cu_seqlens_k`` are int32
    tensors of batch + 1 offsets (sequence b is rows cu[b]:cu[b+1]); ``max_seqlen_q`` /
    ``max_seqlen_k`` are ints >= 1, the longest sequence's lengths. Returns the effective
    causal flag (the window normalised with the longest lengths: a side at least that long is
    unbounded for every sequence).

    Offsets on a CUDA device are not read (that would synchronise with the GPU), so their
    values are the caller's contract, as in FA3: non-decreasing, starting at 0 and ending at
    the number of rows, no sequence longer than max_seqlen_*. Offsets on the CPU are checked
    here, and the caller moves them to q's device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dim() != 3:
            raise ValueError(f"{name} must have 3 dims (total_tokens, heads, head_dim) for flash_attn_varlen_func; "
                             f"got {describe_tensor(t)}")
        if t.numel() == 0:
            raise ValueError(f"{name} is empty ({describe_tensor(t)}); total_tokens, heads and head_dim must be >= 1")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"total_k differs between k ({k.shape[0]}) and v ({v.shape[0]})")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not _is_int(value) or not 1 <= value < 2**30:  # numpy ints pass (numbers.Integral)
            raise ValueError(f"{name}={value!r} must be an int in [1, 2^30): the longest sequence's length")
    for name, value in (("total_q", q.shape[0]), ("total_k", k.shape[0])):
        if value >= 2**31:
            raise ValueError(f"{name}={value} rows: at most 2^31 - 1 are supported")
    batch = None
    for name, cu, rows, longest in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
                                    ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)):
        check_tensor(name, cu)
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must be a 1-D int32 tensor of batch + 1 >= 2 offsets; got {describe_tensor(cu)}")
        if batch is not None and cu.shape[0] - 1 != batch:
            raise ValueError(f"cu_seqlens_q has {batch + 1} entries and cu_seqlens_k {cu.shape[0]}; both must be "
                             "batch + 1")
        batch = cu.shape[0] - 1
        # Under torch.compile the values are data (reading them would need a guard on each one):
        # there, as for offsets on the GPU, they are the caller's contract.
        if cu.device.type == "cpu" and not torch.compiler.is_compiling():
            offsets = cu.tolist()
            lengths = [b - a for a, b in zip(offsets, offsets[1:])]
            if offsets[0] != 0 or offsets[-1] != rows or min(lengths) < 0:
                raise ValueError(f"{name} must be non-decreasing offsets from 0 to the {rows} rows of "
                                 f"{'q' if name.endswith('q') else 'k'}; got {offsets[:8]}{' ...' if batch > 7 else ''}"
                                 f"{'' if batch <= 7 else f' (last {offsets[-1]})'}")
            if max(lengths) > longest:
                raise ValueError(f"{name} holds a sequence of {max(lengths)} rows, longer than "
                                 f"{'max_seqlen_q' if name.endswith('q') else 'max_seqlen_k'}={longest}")
        elif cu.device != q.device and not torch.compiler.is_compiling():
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}; put it on q's device (or the CPU)")
    check_bool("causal", causal)
    is_causal = effective_causal(window_size, causal, max_seqlen_q, max_seqlen_k)
    if not isinstance(schedule, str) or schedule not in SCHEDULE_NAMES:
        raise ValueError(f"schedule={schedule!r} is unknown; choose one of {', '.join(SCHEDULE_NAMES)}")
    if schedule not in VARLEN_KERNEL_SCHEDULES + ("auto",):
        raise NotImplementedError(
            f"schedule={schedule!r} is not built for variable-length batches; use one of "
            f"{', '.join(VARLEN_KERNEL_SCHEDULES)} or auto")
    if backward is None:  # flash_attn_varlen_func: whether its autograd will record a backward
        backward = backward_will_run(q, k, v)
    if backward and batch > BWD_MAX_BATCH_HEADS:
        raise NotImplementedError(
            f"{batch} sequences are not supported by the backward yet: at most {BWD_MAX_BATCH_HEADS} (a CUDA grid "
            "dimension of its pre/post-processing); split the batch into calls of at most that many")
    # The padded forward's checks, on the packed tensors as one batch of total rows (heads and
    # the backward's head limit included).
    validate_for_launch(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), softmax_scale=softmax_scale,
                        causal=is_causal, softcap=softcap, sm_margin=sm_margin, deterministic=deterministic,
                        backward=backward)
    return is_causal


def _check_traced_qkv(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether torch.compile is tracing; if so, check what fake tensors still have (tensor types,
    device type), since validate_inputs then runs with ``check_device=False``."""
    tracing = torch.compiler.is_compiling()
    if tracing:
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_tensor(name, t)
        check_cuda_devices(q, k, v)
    return tracing


def require_kernels_unless_tracing() -> None:
    """DASH's kernels must be loadable for a call that launches them; while torch.compile
    traces, nothing is launched, so nothing is required."""
    if not torch.compiler.is_compiling():
        _ext.require_kernels()


def validate_for_launch(q: Tensor, k: Tensor, v: Tensor, **options) -> None:
    """validate_inputs (``options`` are its keywords) for a call that is about to launch
    DASH's kernels, then require that they are loadable.

    While torch.compile traces, tensors are fakes (no data pointer, no device to query):
    only their types and device type are checked here, and the op's C++ checks still run on
    the real tensors. The kernels are required only when not tracing, as tracing runs none."""
    tracing = _check_traced_qkv(q, k, v)
    validate_inputs(q, k, v, check_device=not tracing, **options)
    require_kernels_unless_tracing()


def validate_backward_inputs(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
                             **options) -> None:
    """validate_inputs on q, k, v (``options`` are its keywords) with the backward's limits,
    then the forward's results and the incoming gradient: dout and out shaped like q,
    softmax_lse float32 (B, H, Sq) on q's device. While torch.compile traces, the checks that
    need a real tensor (data pointer alignment, the device's properties) are left to the op's
    C++ checks, as in ``validate_for_launch``."""
    options.setdefault("check_device", not _check_traced_qkv(q, k, v))
    validate_inputs(q, k, v, backward=True, **options)
    for name, t in (("dout", dout), ("out", out)):
        check_tensor(name, t)
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"{name} must match q (shape {tuple(q.shape)}, {q.dtype}, {q.device}); got {describe_tensor(t)}")
    check_tensor("softmax_lse", softmax_lse)
    expected = (q.shape[0], q.shape[2], q.shape[1])
    if tuple(softmax_lse.shape) != expected or softmax_lse.dtype != torch.float32:
        raise ValueError(f"softmax_lse must be float32 of shape {expected}; got {describe_tensor(softmax_lse)}")
    if softmax_lse.device != q.device:
        raise ValueError(f"softmax_lse is on {softmax_lse.device} but q is on {q.device}; all inputs must share "
                         "one device")


def check_output_buffer(name: str, buffer: object, like: Tensor, like_name: str) -> Tensor:
    """A caller-provided output (FA3's ``out_``, ``dq``/``dk``/``dv``): a tensor with
    ``like``'s shape, dtype and device, into which DASH's result is copied."""
    check_tensor(name, buffer)
    if buffer.shape != like.shape or buffer.dtype != like.dtype or buffer.device != like.device:
        raise ValueError(
            f"{name} must match {like_name} (shape {tuple(like.shape)}, {like.dtype}, {like.device}); "
            f"got {describe_tensor(buffer)}"
        )
    return buffer
