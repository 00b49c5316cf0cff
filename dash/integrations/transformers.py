"""DASH as a Hugging Face ``transformers`` attention implementation.

    import dash.integrations.transformers            # registers attn_implementation="dash"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="dash")
    model.set_attn_implementation("dash")            # or switch a loaded model

Importing this module registers the name ``"dash"`` with the default settings
(``deterministic=None``: follow ``torch.use_deterministic_algorithms``; ``schedule="auto"``).
That import-time registration is this module's one side effect and its purpose.
:func:`register` registers again with other settings, or under another name
(``register("dash_det", deterministic=True)``); registering a name twice is harmless, the
last call's settings win.

Two things are registered under the name, both through transformers' public registries:

* the attention function (``transformers.AttentionInterface``, transformers >= 4.51): it
  turns transformers' ``(batch, heads, seqlen, head_dim)`` tensors into DASH's
  ``(batch, seqlen, heads, head_dim)`` views, maps ``scaling`` to ``softmax_scale`` and
  ``is_causal`` / ``module.is_causal`` to ``causal`` and calls
  :func:`dash.api.flash_attn_func`; GQA/MQA key/value heads go in unrepeated.
* a mask function (``transformers.AttentionMaskInterface``, transformers >= 4.53). Without
  one, transformers builds no mask for a custom implementation and drops padding masks
  silently. This one never builds a mask: it returns ``None`` for the plain causal (or
  bidirectional) mask; for a packed batch (``position_ids`` that restart inside a row) or a
  padded one (a 2D mask with zeros) it returns a :class:`VarlenRows` (the sequences' offsets,
  found once per forward), and it raises for anything else -- sliding windows that cut
  something off, chunked attention, custom mask overlays, a static KV cache.

Packed and padded batches run :func:`dash.api.flash_attn_varlen_func` on the kept tokens
(each sequence gets the model's causal or full mask on its own, padded query rows come out as
zeros), as transformers' own flash-attention paths do; so do FA's ``cu_seq_lens_q/k`` /
``max_length_q/k`` keywords (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``).

Every feature DASH lacks raises ``NotImplementedError`` naming the feature and the value:
dropout > 0, sliding windows, softcapping, attention sinks, attention biases, custom masks,
``output_attentions``. Head dims other than 64/128 and dtypes other than bf16/fp16 are
rejected by :func:`~dash.api.flash_attn_func` itself. Nothing ever falls back to another
implementation. Under ``torch.autocast`` float32 query/key/value are cast to the autocast
dtype, as transformers' SDPA and flash-attention paths do.

Cost of the checks: with no mask (the usual training case) there is no device sync except
one small check of ``position_ids`` per forward (cached across layers; per layer under
``torch.inference_mode()``, whose tensors have no version counter). A packed or padded batch
costs one copy of its (batch, seqlen) sequence ids or mask to the host per forward (made by
the mask function; transformers' own flash path syncs in every layer), plus a gather of q, k,
v and a scatter of the output for a padded one. A 2D mask costs one ``all()`` over (batch,
seqlen) per forward; a 4D mask (passed by the user, or built by transformers < 4.53 for
custom implementations) one pass over it per forward in row chunks of at most 2**24
elements, cached across the layers that share it.

``torch.compile``: the attention function traces without graph breaks and the position_ids
check becomes an asynchronous device assert; a mask handed to the attention function is a
graph break per layer. The mask function cannot be traced (it reads transformers' mask
closures), so it is ``torch.compiler.disable``d: a compiled model's forward breaks where
transformers builds the mask, and ``torch.compile(model, fullgraph=True)`` fails; compile the
decoder layers with ``fullgraph=True`` instead (see docs/transformers.md).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import re
import weakref
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from dash import api as _dash_api
from dash.config import KERNEL_SCHEDULES
from dash.validation import SCHEDULE_NAMES

try:
    import transformers as _transformers
except ImportError as _e:  # pragma: no cover - exercised only where transformers is missing
    raise ImportError(
        "dash.integrations.transformers needs the `transformers` package (>= 4.51): pip install 'transformers>=4.51'"
    ) from _e

__all__ = ["MIN_TRANSFORMERS_VERSION", "VarlenRows", "register", "registered_names", "attention_forward"]

#: Oldest transformers with the public ``AttentionInterface`` registry.
MIN_TRANSFORMERS_VERSION = "4.51"
#: Mask functions (``AttentionMaskInterface``) exist from this version; older versions let
#: the model build 4D masks, which the attention function then checks.
MASK_INTERFACE_VERSION = "4.53"

#: Names transformers gives a meaning of its own (``"flash"`` selects flash-attention checks,
#: ``"sdpa"``/``"flex_attention"`` their dispatch checks, ``"paged|"`` paged attention, and
#: ``"org/repo"`` a Hub kernel), so a DASH name must avoid them.
_RESERVED_SUBSTRINGS = ("flash", "sdpa", "flex", "paged", "eager")
_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_\-]*")

#: Row chunk budget (elements) of the 4D mask check: bounds its temporaries.
_MASK_CHECK_CHUNK = 1 << 24
#: An additive float mask "blocks" a position only when its bias is at most this (exp underflows).
_BLOCKED_BIAS = -1.0e4

try:
    from transformers import masking_utils as _masking_utils
except ImportError:  # transformers < 4.53: models build their masks themselves
    _masking_utils = None

#: FA's varlen keywords (transformers' ``FlashAttentionKwargs``, e.g. from
#: ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``). ``seq_idx`` (the same
#: boundaries, for state-space layers) is not read.
_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_OTHER_UNSUPPORTED_KWARGS = {
    "s_aux": "attention sinks (s_aux)",
    "sinks": "attention sinks",
    "position_bias": "an additive attention bias (position_bias)",
    "head_mask": "a head mask (head_mask)",
    "indices": "sparse attention (indices)",
    "block_indices": "sparse attention (block_indices)",
}


# ---------------------------------------------------------------------------------------
# transformers' registries
# ---------------------------------------------------------------------------------------
def _interfaces(tf: Any = None) -> tuple[Any, Any]:
    """``(AttentionInterface, AttentionMaskInterface or None)`` of the installed transformers
    (or of ``tf``); ImportError naming the minimum version when there is no registry."""
    tf = _transformers if tf is None else tf
    attention_interface = getattr(tf, "AttentionInterface", None)
    if attention_interface is None or not callable(getattr(attention_interface, "register", None)):
        version = getattr(tf, "__version__", "unknown")
        raise ImportError(
            f"transformers {version} has no AttentionInterface registry; dash.integrations.transformers needs "
            f"transformers >= {MIN_TRANSFORMERS_VERSION}: pip install -U 'transformers>={MIN_TRANSFORMERS_VERSION}'"
        )
    mask_interface = getattr(tf, "AttentionMaskInterface", None)
    if mask_interface is None and tf is _transformers:
        try:
            from transformers.masking_utils import AttentionMaskInterface as mask_interface  # noqa: N813
        except ImportError:  # transformers < 4.53: models build their masks themselves
            mask_interface = None
    return attention_interface, mask_interface


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"name={name!r} must be a string of letters, digits, '_' or '-' starting with a letter "
            "(transformers reads '/', ':', '@' and '|' as Hub-kernel or paged-attention syntax)"
        )
    lowered = name.lower()
    clash = [s for s in _RESERVED_SUBSTRINGS if s in lowered]
    if clash:
        raise ValueError(
            f"name={name!r} contains {clash[0]!r}, which transformers reserves for its own attention implementations; "
            "choose another name, e.g. 'dash'"
        )
    return name


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------
def _unsupported(name: str, feature: str, detail: str, remedy: str) -> NotImplementedError:
    return NotImplementedError(f"DASH (attn_implementation={name!r}) does not support {feature}: {detail}; {remedy}")


# ---------------------------------------------------------------------------------------
# Verdict cache: a mask / position_ids tensor is shared by all layers of one forward
# ---------------------------------------------------------------------------------------
class _LastVerdict:
    """Remembers the verdict for the last tensor checked (by identity and version), so that
    the layers of one forward, which share their mask / position_ids, check it once.

    Inference tensors (made under ``torch.inference_mode()``) have no version counter, and
    inside inference mode they can still be modified in place: an identity-only cache could
    return a stale verdict, so they are checked on every call instead (no cache).

    The entry is one ``(weakref, key, verdict)`` tuple replaced in a single assignment, so a
    reader in another thread (``nn.DataParallel`` runs replicas in threads) sees a whole
    entry, never one thread's tensor with another thread's verdict."""

    def __init__(self) -> None:
        self._entry: Optional[tuple[weakref.ReferenceType, Any, Any]] = None

    @staticmethod
    def _cacheable(t: Tensor) -> bool:
        # traced tensors are stand-ins: nothing to remember; inference tensors: see above
        return not _compiling() and not t.is_inference()

    def get(self, t: Tensor, key: Any) -> Any:
        if not self._cacheable(t):
            return None
        entry = self._entry
        if entry is not None and entry[0]() is t and entry[1] == (t._version, key):
            return entry[2]
        return None

    def put(self, t: Tensor, key: Any, verdict: Any) -> None:
        if not self._cacheable(t):
            return
        try:
            ref = weakref.ref(t)
        except TypeError:  # pragma: no cover - tensors are weak-referenceable
            self._entry = None
            return
        self._entry = (ref, (t._version, key), verdict)


_mask_verdicts = _LastVerdict()
_position_verdicts = _LastVerdict()


def _compiling() -> bool:
    try:
        return bool(torch.compiler.is_compiling())
    except AttributeError:  # pragma: no cover - torch < 2.3
        return False


# ---------------------------------------------------------------------------------------
# Packed and padded batches: the rows flash_attn_varlen_func takes
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class VarlenRows:
    """A batch's sequences as ``dash.flash_attn_varlen_func`` takes them: which tokens of the
    (batch, seqlen) grid are kept, in order, and where each sequence starts among them.

    DASH's mask function returns one instead of a mask when transformers asks for a packed
    batch (``position_ids`` that restart inside a row) or a padded one (a 2D mask with zeros):
    the model hands it to every attention layer of the forward, so the offsets are found once
    per forward (one device-to-host copy of the (batch, seqlen) mask or sequence ids), not per
    layer. The attention function also builds one from ``cu_seq_lens_q/k`` keywords or from a
    2D padding mask given to it directly.

    ``indices_q`` / ``indices_k``: positions in the flattened (batch * seqlen) grid of the
    query / key tokens kept, ascending (``None``: every token, as in a packed batch); sequence
    ``i`` is kept tokens ``cu_seqlens_*[i] : cu_seqlens_*[i + 1]``; ``max_seqlen_*`` the
    longest. Query rows that are not kept come out as zeros, as in transformers' flash paths."""

    kind: str  # "packed" or "padding": how the batch was described (for error messages)
    cu_seqlens_q: Tensor  # int32 (sequences + 1,), on the batch's device (or on the CPU)
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    indices_q: Optional[Tensor] = None  # int64, on the batch's device
    indices_k: Optional[Tensor] = None


def _offsets(lengths: Tensor) -> Tensor:
    """int32 offsets (n + 1,) from n lengths (on the CPU)."""
    return torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def _rows_from_sequence_ids(sequence_ids: Tensor) -> VarlenRows:
    """A packed batch from transformers' (batch, seqlen) sequence ids (``packed_sequence_mask``:
    the id grows by one where ``position_ids`` do not step by exactly 1). A sequence starts at
    every row's first token and wherever the id changes; a row boundary always ends one (a
    sequence never spans rows, as transformers' packed mask has it). One copy of the ids to
    the host."""
    ids = sequence_ids.detach().to("cpu", torch.int64)
    batch, seqlen = ids.shape
    starts = torch.ones((batch, seqlen), dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    first = starts.reshape(-1).nonzero().reshape(-1)
    lengths = torch.diff(first, append=first.new_tensor([batch * seqlen]))
    cu = _offsets(lengths).to(sequence_ids.device, non_blocking=True)
    longest = int(lengths.max())
    return VarlenRows("packed", cu, cu, longest, longest)


def _rows_from_padding_mask(mask: Tensor, seqlen_q: int) -> VarlenRows:
    """A padded batch from a (batch, keys) mask, nonzero = a real token: the keys kept are the
    mask's nonzero positions, the queries kept those among the last ``seqlen_q`` positions
    (the queries are the newest tokens: seqlen_q == keys in training, fewer when decoding with
    a cache). Per row, the kept tokens form the row's sequence, in order; with the causal mask
    (bottom-right aligned) a kept query then sees exactly the kept keys at or before its own
    position. One copy of the mask to the host."""
    keep_k = mask.detach().to("cpu")
    keep_k = keep_k if keep_k.dtype == torch.bool else keep_k != 0
    seqlen_k = keep_k.shape[-1]
    if not 1 <= seqlen_q <= seqlen_k:
        raise ValueError(f"a padding mask over {seqlen_k} keys cannot place {seqlen_q} queries (the newest tokens)")
    keep_q = keep_k[:, seqlen_k - seqlen_q:]
    lengths_k, lengths_q = keep_k.sum(-1), keep_q.sum(-1)
    device = mask.device
    indices_k = keep_k.reshape(-1).nonzero().reshape(-1).to(device, non_blocking=True)
    cu_k = _offsets(lengths_k).to(device, non_blocking=True)
    if seqlen_q == seqlen_k:
        indices_q, cu_q = indices_k, cu_k
    else:
        indices_q = keep_q.reshape(-1).nonzero().reshape(-1).to(device, non_blocking=True)
        cu_q = _offsets(lengths_q).to(device, non_blocking=True)
    return VarlenRows("padding", cu_q, cu_k, int(lengths_q.max()), int(lengths_k.max()), indices_q, indices_k)


def _rows_from_kwargs(name: str, kwargs: dict) -> Optional[VarlenRows]:
    """FA's varlen keywords (``cu_seq_lens_q/k``, ``max_length_q/k``), as transformers' flash
    paths take them: offsets into the (batch * seqlen) rows. None when none is given."""
    given = {kw: kwargs.get(kw) for kw in _VARLEN_KWARGS if kwargs.get(kw) is not None}
    if not given:
        return None
    cu_q, cu_k = given.get("cu_seq_lens_q"), given.get("cu_seq_lens_k")
    if cu_q is None or cu_k is None:
        raise ValueError(
            f"attn_implementation={name!r}: got {', '.join(given)} but packed sequences need both cu_seq_lens_q and "
            "cu_seq_lens_k (offsets of the sequences along the flattened rows; max_length_q/k optional)"
        )
    offsets = []
    for kw, cu in (("cu_seq_lens_q", cu_q), ("cu_seq_lens_k", cu_k)):
        if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.is_floating_point() or cu.dtype == torch.bool:
            raise ValueError(f"{kw} must be a 1-D integer tensor of offsets; got {cu!r:.80}")
        offsets.append(cu if cu.dtype == torch.int32 else cu.to(torch.int32))
    longest = []
    for kw, cu in (("max_length_q", offsets[0]), ("max_length_k", offsets[1])):
        value = given.get(kw)
        if value is None:  # a device sync, as in transformers' own flash path
            value = int(torch.diff(cu).max()) if cu.numel() > 1 else 0
        elif isinstance(value, Tensor):
            value = int(value.item())
        longest.append(int(value))
    return VarlenRows("packed", offsets[0], offsets[1], longest[0], longest[1])


_padding_rows = _LastVerdict()


# ---------------------------------------------------------------------------------------
# Mask checks (attention side)
# ---------------------------------------------------------------------------------------
def _four_d_mask_kind(mask: Tensor, seqlen_q: int, seqlen_k: int) -> tuple[bool, bool]:
    """(is all-visible, is DASH's bottom-right causal mask) for a 4D mask (B|1, H|1, Sq|1, Sk).

    Bool/int masks: nonzero = visible. Float masks are additive: visible = 0, blocked <= -1e4
    (anything else is a bias DASH cannot apply). Reads the mask once, in row chunks of at most
    ``_MASK_CHECK_CHUNK`` elements, with one device sync at the end."""
    rows_total = mask.shape[-2]
    per_row = max(1, mask.numel() // max(1, rows_total))
    chunk = max(1, _MASK_CHECK_CHUNK // per_row)
    floating = mask.is_floating_point()
    cols = torch.arange(seqlen_k, device=mask.device)[None, :]
    # A single mask row broadcast over several queries cannot be the causal mask.
    causal_possible = rows_total == seqlen_q or seqlen_q == 1
    full_ok = torch.ones((), dtype=torch.bool, device=mask.device)
    causal_ok = torch.full((), causal_possible, dtype=torch.bool, device=mask.device)
    for r0 in range(0, rows_total, chunk):
        r1 = min(rows_total, r0 + chunk)
        m = mask[..., r0:r1, :]
        if floating:
            keep = m == 0
            blocked = m <= _BLOCKED_BIAS
        else:
            keep = m if m.dtype == torch.bool else m != 0
            blocked = ~keep
        full_ok &= keep.all()
        if causal_possible:
            rows = torch.arange(r0, r1, device=mask.device)[:, None] + (seqlen_q - rows_total)
            visible = cols <= rows + (seqlen_k - seqlen_q)  # DASH's causal mask is bottom-right aligned
            causal_ok &= torch.where(visible, keep, blocked).all()
    full, causal = torch.stack([full_ok, causal_ok]).tolist()
    return bool(full), bool(causal)


def _is_padded_causal(mask: Tensor, seqlen_q: int, seqlen_k: int) -> bool:
    """Error path only: is a rejected 4D mask the causal (or full) mask of padded sequences,
    i.e. the plain mask minus some key columns of each batch row? (What transformers < 4.53
    builds from a 2D padding mask.) One more pass over the mask."""
    keep = (mask == 0) if mask.is_floating_point() else (mask if mask.dtype == torch.bool else mask != 0)
    if keep.shape[-2] != seqlen_q:
        return False
    cols = torch.arange(seqlen_k, device=mask.device)[None, :]
    rows = torch.arange(seqlen_q, device=mask.device)[:, None]
    visible = cols <= rows + (seqlen_k - seqlen_q)
    key_used = keep.any(dim=-2, keepdim=True)  # (B, H, 1, Sk): keys some query sees
    for plain in (visible, torch.ones_like(visible)):
        if bool((keep == (plain & key_used)).all()) and not bool(key_used.all()):
            return True
    return False


def _mask_decides_causal(
    name: str, mask: Any, causal: bool, seqlen_q: int, seqlen_k: int
) -> bool:
    """Check a mask handed to the attention function; returns the ``causal`` flag to run with.

    ``None``: the flag as given. A 2D (batch, keys) padding mask: allowed when it masks
    nothing. A 4D mask: allowed when it is exactly the all-visible or exactly DASH's causal
    mask -- then, as transformers' SDPA and eager paths do, the mask decides causality."""
    if mask is None:
        return causal
    if not isinstance(mask, Tensor):
        raise _unsupported(
            name, f"an attention_mask of type {type(mask).__name__}", "DASH takes no mask object",
            "use attn_implementation='flex_attention' for block masks",
        )
    if mask.dim() == 2:
        if mask.shape[-1] < seqlen_k:
            raise ValueError(
                f"attention_mask has shape {tuple(mask.shape)} but the keys have length {seqlen_k}; a 2D mask must "
                "cover every key"
            )
        key = ("2d", seqlen_k)
        verdict = _mask_verdicts.get(mask, key)
        if verdict is None:
            m = mask[:, -seqlen_k:]
            verdict = bool((m if m.dtype == torch.bool else m != 0).all())
            _mask_verdicts.put(mask, key, verdict)
        if not verdict:
            raise _unsupported(
                name, "a padding mask", f"attention_mask (shape {tuple(mask.shape)}) has padded (zero) positions",
                "batch sequences of equal length without padding tokens, or use attn_implementation='sdpa'",
            )
        return causal
    if mask.dim() != 4:
        raise ValueError(f"attention_mask must be None, 2D (batch, keys) or 4D; got shape {tuple(mask.shape)}")
    m = mask[..., :seqlen_k] if mask.shape[-1] > seqlen_k else mask  # transformers < 4.53 pads the key dim
    if m.shape[-1] != seqlen_k or m.shape[-2] not in (1, seqlen_q):
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)}, which does not fit {seqlen_q} queries and {seqlen_k} keys"
        )
    key = ("4d", seqlen_q, seqlen_k)
    verdict = _mask_verdicts.get(mask, key)
    if verdict is None:
        verdict = _four_d_mask_kind(m, seqlen_q, seqlen_k)
        _mask_verdicts.put(mask, key, verdict)
    full, is_causal = verdict
    if full and is_causal:  # e.g. a single query: both masks are the same
        return causal
    if full:
        return False
    if is_causal:
        return True
    if _is_padded_causal(m, seqlen_q, seqlen_k):
        raise _unsupported(
            name, "a padding mask",
            f"the 4D attention_mask (shape {tuple(mask.shape)}) masks padded key positions",
            "batch sequences of equal length without padding tokens, or use attn_implementation='sdpa'",
        )
    raise _unsupported(
        name, "a custom attention mask",
        f"the 4D attention_mask (shape {tuple(mask.shape)}, {mask.dtype}) is neither the causal mask nor all-visible "
        "(padding, packed sequences, a static KV cache, a sliding window or a bias)",
        "pass no attention_mask (or an all-ones 2D one), or use attn_implementation='sdpa'",
    )


def _packing_error(name: str) -> NotImplementedError:
    return _unsupported(
        name, "packed sequences (varlen) described only by position_ids",
        "position_ids restart inside a row (several sequences packed into one) but no description of the sequences "
        "reached the attention layer (transformers >= 4.53 passes one from DASH's mask function when the model "
        "gets no attention_mask; older versions, an explicit mask or torch.compile of the whole model do not)",
        "pass cu_seq_lens_q/k and max_length_q/k (DataCollatorWithFlattening(return_flash_attn_kwargs=True)), "
        "or call the model without an attention_mask on transformers >= 4.53",
    )


def _check_position_ids(name: str, position_ids: Any, seqlen_q: int) -> None:
    """Packed sequences show as position_ids that do not increase by exactly 1 along a row
    (transformers' own packing rule). Only plain (batch, seqlen_q) position_ids are read.

    Eager: one check per position_ids tensor (cached across layers; per layer for inference
    tensors, see _LastVerdict), a Python exception.
    Compiled: an asynchronous device assert, so the check costs no graph break (on CUDA a
    failure surfaces as a device-side assert carrying the same message)."""
    if not isinstance(position_ids, Tensor) or position_ids.dim() != 2 or seqlen_q < 2:
        return
    if position_ids.shape[-1] != seqlen_q or position_ids.is_floating_point():
        return
    if _compiling():
        consecutive = (position_ids[:, 1:] - position_ids[:, :-1] == 1).all()
        torch._assert_async(consecutive, str(_packing_error(name)))
        return
    key = ("pos", seqlen_q)
    verdict = _position_verdicts.get(position_ids, key)
    if verdict is None:
        verdict = bool((position_ids[:, 1:] - position_ids[:, :-1] == 1).all())
        _position_verdicts.put(position_ids, key, verdict)
    if not verdict:
        raise _packing_error(name)


# ---------------------------------------------------------------------------------------
# Mask function (transformers >= 4.53): decides once per forward, builds nothing
# ---------------------------------------------------------------------------------------
def _closure_vars(fn: Callable) -> dict[str, Any]:
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    out = {}
    for var, cell in zip(code.co_freevars, cells):
        try:
            out[var] = cell.cell_contents
        except ValueError:  # empty cell
            pass
    return out


def _mask_leaves(fn: Callable, out: list[tuple[str, Any]], depth: int = 0) -> None:
    """Flatten transformers' mask-function combinators into (kind, detail) leaves. Unknown
    functions become ("unknown", qualname): the caller rejects them."""
    mu = _masking_utils
    if depth > 16:
        out.append(("unknown", "deeply nested mask functions"))
        return
    if fn is getattr(mu, "causal_mask_function", None):
        out.append(("causal", None))
        return
    if fn is getattr(mu, "bidirectional_mask_function", None):
        out.append(("bidirectional", None))
        return
    qualname = getattr(fn, "__qualname__", type(fn).__name__)
    outer = qualname.split(".<locals>.")[0] if ".<locals>." in qualname else ""
    free = _closure_vars(fn)
    if outer in ("and_masks", "or_masks"):
        if outer == "or_masks":
            out.append(("or", None))
        for f in free.get("mask_functions", ()):
            _mask_leaves(f, out, depth + 1)
    elif outer == "sliding_window_overlay":
        out.append(("sliding", free.get("sliding_window")))
    elif outer == "sliding_window_bidirectional_overlay":
        out.append(("sliding_bidirectional", free.get("sliding_window")))
    elif outer == "chunked_overlay":
        out.append(("chunked", free.get("chunk_size")))
    elif outer == "packed_sequence_mask_function":
        out.append(("packed", free.get("packed_sequence_mask")))
    elif outer == "remap_positions_for_packed_sequence":  # goes with packed_sequence_mask_function
        if "mask_function" in free:
            _mask_leaves(free["mask_function"], out, depth + 1)
        else:
            out.append(("unknown", qualname))
    elif outer == "blockwise_overlay":
        out.append(("block", None))
    elif outer == "padding_mask_function":
        out.append(("padding", None))
    else:
        out.append(("unknown", qualname))


def _as_int(x: Any) -> int:
    return int(x.item()) if isinstance(x, Tensor) else int(x)


@torch.compiler.disable
def _mask_function(
    name: str,
    batch_size: Optional[int] = None,
    q_length: Optional[int] = None,
    kv_length: Optional[int] = None,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    mask_function: Optional[Callable] = None,
    attention_mask: Optional[Tensor] = None,
    cache_position: Optional[Tensor] = None,
    **kwargs: Any,
) -> Optional[VarlenRows]:
    """transformers' mask-interface signature (>= 5: ``q_length``/``q_offset``; 4.53-4.5x:
    ``cache_position``). Returns ``None`` (no mask: the attention function's causal flag does
    it) when the requested mask is plain causal or bidirectional, a :class:`VarlenRows` when
    it is that mask within each sequence of a packed batch (``position_ids`` restart) or of a
    padded one (a 2D mask with zeros), for the attention layers to run
    ``flash_attn_varlen_func``; raises otherwise.

    It inspects transformers' mask-function closures, which TorchDynamo cannot trace, so it
    always runs eagerly: under ``torch.compile`` the model's forward breaks at its call (every
    frame on the stack breaks), and ``fullgraph=True`` on a whole model fails."""
    if q_length is None:
        if cache_position is not None:
            q_length = int(cache_position.shape[0])
            q_offset = cache_position[0] if q_length > 0 else 0
        else:
            q_length, q_offset = kv_length, kv_offset
    if kv_length is None:
        kv_length = q_length
    leaves: list[tuple[str, Any]] = []
    if mask_function is not None:
        _mask_leaves(mask_function, leaves)
    else:
        leaves.append(("causal", None))
    # Eager transformers adds the packed-sequence leaf only for really packed rows; while
    # compiling it always adds it, so read its sequence ids (a graph break, only then).
    packed_ids = [d for k, d in leaves if k == "packed"]
    if packed_ids and all(isinstance(t, Tensor) and bool((t[:, -1] == 0).all()) for t in packed_ids):
        leaves = [(k, d) for k, d in leaves if k != "packed"]
    kinds = {k for k, _ in leaves}
    packed_rows = None
    if "packed" in kinds:
        # transformers looks for packing only without a padding mask and without a cache, so
        # the queries are the keys; each sequence attends within itself (packed_ids[0]: the
        # (batch, seqlen) sequence ids), which flash_attn_varlen_func computes directly.
        if attention_mask is not None or q_length != kv_length or not isinstance(packed_ids[0], Tensor):
            raise _unsupported(
                name, "packed sequences with a padding mask or a KV cache",
                f"{q_length} queries against {kv_length} keys, attention_mask "
                f"{'None' if attention_mask is None else tuple(attention_mask.shape)}",
                "pack without padding tokens and without a cache, or use attn_implementation='sdpa'",
            )
        packed_rows = _rows_from_sequence_ids(packed_ids[0])
    if "chunked" in kinds:
        size = next(d for k, d in leaves if k == "chunked")
        raise _unsupported(name, "chunked attention", f"attention_chunk_size={size}", "use attn_implementation='sdpa'")
    if "block" in kinds:
        raise _unsupported(
            name, "block-wise bidirectional masks", "block_sequence_ids were given", "use attn_implementation='sdpa'"
        )
    if "padding" in kinds:
        raise _unsupported(name, "a padding mask", "the mask function includes a padding mask",
                           "use attn_implementation='sdpa'")
    unknown = [d for k, d in leaves if k == "unknown"]
    if unknown or "or" in kinds or len(kinds & {"causal", "bidirectional"}) != 1:
        what = unknown[0] if unknown else "a union (or_mask_function) of masks"
        raise _unsupported(
            name, "a custom mask pattern", f"mask function {what}",
            "DASH computes only the plain causal or full mask; use attn_implementation='sdpa' or 'flex_attention'",
        )
    causal = "causal" in kinds
    q_off, kv_off = _as_int(q_offset), _as_int(kv_offset)
    last_q = q_off + q_length - 1
    for kind, window in leaves:
        if packed_rows is not None and kind in ("sliding", "sliding_bidirectional") and window is not None:
            # within one packed sequence (no cache): a window of the longest one cuts nothing
            reach = packed_rows.max_seqlen_k - 1
            active = reach >= window if kind == "sliding" else reach > window
        elif kind == "sliding" and window is not None:
            active = last_q - kv_off >= window  # keeps kv_idx > q_idx - window
        elif kind == "sliding_bidirectional" and window is not None:
            active = max(last_q - kv_off, kv_off + kv_length - 1 - q_off) > window
        else:
            continue
        if active:
            keys = f"{packed_rows.max_seqlen_k} keys of this forward's longest packed sequence" \
                if packed_rows is not None else f"{kv_length} keys of this forward"
            raise _unsupported(
                name, "sliding-window attention", f"sliding_window={window} is shorter than the {keys}",
                "use sequences no longer than the window, or attn_implementation='sdpa'",
            )
    if packed_rows is not None:
        return packed_rows
    padded = False
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(f"expected a 2D padding mask, got shape {tuple(attention_mask.shape)}")
        seen = attention_mask[:, kv_off : kv_off + kv_length]
        padded = not bool((seen if seen.dtype == torch.bool else seen != 0).all())
    if causal and q_off - kv_off != kv_length - q_length:
        raise _unsupported(
            name, "a KV cache longer than the tokens it holds (e.g. StaticCache)",
            f"{q_length} queries at position {q_off} against {kv_length} key slots from position {kv_off}",
            "use the default DynamicCache, or attn_implementation='sdpa'",
        )
    # transformers pads a 2D mask shorter than the keys with zeros (prepare_padding_mask): the
    # keys it does not cover are padding, e.g. a StaticCache's unfilled slots. With a causal
    # mask the check above catches a static cache first; a bidirectional mask would otherwise
    # let DASH attend to those slots silently.
    if attention_mask is not None and attention_mask.shape[-1] < kv_off + kv_length:
        raise _unsupported(
            name, "a padding mask",
            f"attention_mask (shape {tuple(attention_mask.shape)}) covers {attention_mask.shape[-1]} key positions but "
            f"the keys span positions {kv_off}..{kv_off + kv_length - 1}; transformers masks the uncovered ones as "
            "padding (e.g. the unfilled slots of a StaticCache)",
            "use the default DynamicCache and sequences without padding tokens, or attn_implementation='sdpa'",
        )
    if padded:  # the kept tokens of each row, for flash_attn_varlen_func
        return _rows_from_padding_mask(attention_mask[:, kv_off : kv_off + kv_length], q_length)
    return None


# ---------------------------------------------------------------------------------------
# Attention function
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Settings:
    """What :func:`register` bound to a name."""

    name: str
    deterministic: Optional[bool]
    schedule: str


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except TypeError:  # pragma: no cover - torch < 2.4
        enabled = torch.is_autocast_enabled() if device_type == "cuda" else torch.is_autocast_cpu_enabled()
    if not enabled:
        return None
    try:
        return torch.get_autocast_dtype(device_type)
    except AttributeError:  # pragma: no cover - torch < 2.4
        return torch.get_autocast_gpu_dtype() if device_type == "cuda" else torch.get_autocast_cpu_dtype()


def _needs_copy(t: Tensor, check_pointer: bool) -> bool:
    """DASH reads (batch, seqlen, heads, head_dim) views with a unit last stride and 16-byte
    aligned strides/base; copy only a view that breaks that."""
    if t.stride(-1) != 1:
        return True
    elem = t.element_size()
    if any((s * elem) % 16 for s, n in zip(t.stride()[:3], t.shape[:3]) if n > 1):
        return True
    return check_pointer and t.data_ptr() % 16 != 0


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    sliding_window: Any = None,
    softcap: Optional[float] = None,
    *,
    settings: Settings = Settings("dash", None, "auto"),
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: query (B, Hq, Sq, D), key/value
    (B, Hk, Sk, D) -> (attn_output (B, Sq, Hq, D), None). :func:`register` binds ``settings``."""
    name = settings.name
    seqlen_q, seqlen_k = query.shape[-2], key.shape[-2]
    if dropout and float(dropout) > 0.0:
        raise _unsupported(
            name, "attention dropout", f"dropout={dropout} (the model's attention_dropout, in training mode)",
            "set config.attention_dropout=0.0",
        )
    if softcap not in (None, 0, 0.0):
        raise _unsupported(name, "softcapping", f"softcap={softcap}", "use attn_implementation='eager' or 'sdpa'")
    if sliding_window is not None:
        window = tuple(sliding_window) if isinstance(sliding_window, (tuple, list)) else (sliding_window,)
        if any(isinstance(w, numbers.Integral) and 0 <= int(w) < seqlen_k for w in window):
            raise _unsupported(
                name, "sliding-window attention", f"sliding_window={sliding_window} with {seqlen_k} keys",
                "use sequences no longer than the window, or attn_implementation='sdpa'",
            )
    for kw, feature in _OTHER_UNSUPPORTED_KWARGS.items():
        if kwargs.get(kw) is not None:
            raise _unsupported(name, feature, f"{kw} was given", "use attn_implementation='eager' or 'sdpa'")
    output_attentions = kwargs.get("output_attentions")
    if output_attentions is None:
        output_attentions = getattr(getattr(module, "config", None), "output_attentions", False)
    if output_attentions:
        raise _unsupported(
            name, "output_attentions=True", "DASH never materialises the attention probabilities",
            "use attn_implementation='eager' for the forwards that need them",
        )

    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    rows = _varlen_rows(name, attention_mask, kwargs, seqlen_q, seqlen_k)
    if rows is None:
        # A 2D mask that reaches here pads nothing (_varlen_rows read it): no second read.
        two_d = isinstance(attention_mask, Tensor) and attention_mask.dim() == 2
        causal = _mask_decides_causal(name, None if two_d else attention_mask, causal, seqlen_q, seqlen_k)
        _check_position_ids(name, kwargs.get("position_ids"), seqlen_q)

    # Layout: (B, H, S, D) -> (B, S, H, D) views; a copy only when DASH could not read the view.
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    target = _autocast_dtype(q.device.type)
    if target is not None and target in (torch.bfloat16, torch.float16):
        q, k, v = (t.to(target) if t.dtype == torch.float32 else t for t in (q, k, v))
    check_pointer = not _compiling()
    if rows is not None:
        return _varlen_attention(q, k, v, rows, scaling, causal, settings), None
    q, k, v = (t.contiguous() if _needs_copy(t, check_pointer) else t for t in (q, k, v))
    out = _dash_api.flash_attn_func(
        q, k, v, softmax_scale=scaling, causal=causal, deterministic=settings.deterministic,
        schedule=settings.schedule,
    )
    return out, None


def _padding_of(attention_mask: Tensor, seqlen_q: int, seqlen_k: int) -> Optional[VarlenRows]:
    """The padded rows a 2D (batch, keys) mask describes, None when it pads nothing; read once
    per tensor version (the layers of one forward share the mask)."""
    if attention_mask.shape[-1] < seqlen_k:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but the keys have length {seqlen_k}; a 2D mask "
            "must cover every key"
        )
    key = ("rows", seqlen_q, seqlen_k)
    padded = _padding_rows.get(attention_mask, key)
    if padded is None:
        m = attention_mask[:, -seqlen_k:]
        all_kept = bool((m if m.dtype == torch.bool else m != 0).all())
        padded = False if all_kept else _rows_from_padding_mask(m, seqlen_q)
        _padding_rows.put(attention_mask, key, padded)
    return padded or None


def _varlen_rows(
    name: str, attention_mask: Any, kwargs: dict, seqlen_q: int, seqlen_k: int
) -> Optional[VarlenRows]:
    """The packed or padded rows this call runs on, or None for a plain batch: FA's
    ``cu_seq_lens_*`` keywords first (as transformers' flash paths take them), else the
    :class:`VarlenRows` DASH's mask function made, else a 2D padding mask."""
    given = _rows_from_kwargs(name, kwargs)
    if isinstance(attention_mask, VarlenRows):
        described = attention_mask
    elif isinstance(attention_mask, Tensor) and attention_mask.dim() == 2:
        described = _padding_of(attention_mask, seqlen_q, seqlen_k)
    elif given is not None and attention_mask is not None:
        raise _unsupported(
            name, "packed sequences with an attention mask",
            f"cu_seq_lens_q/k and an attention_mask of shape {tuple(getattr(attention_mask, 'shape', ()))}",
            "pass cu_seq_lens without a mask (each sequence gets the model's causal or full mask)",
        )
    else:
        described = None
    if given is not None and described is not None and described.kind == "padding":
        raise ValueError(
            f"attn_implementation={name!r}: got both a padding mask and cu_seq_lens_q/k; pass one description of "
            "the sequences (a padding-free packed batch with cu_seq_lens, or a padded batch with attention_mask)"
        )
    return given or described


def _varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, rows: VarlenRows, scaling: Optional[float], causal: bool, settings: Settings
) -> Tensor:
    """q (B, Sq, H, D), k/v (B, Sk, Hk, D) -> (B, Sq, H, D) through flash_attn_varlen_func on
    the kept tokens; query rows not kept are zeros."""
    batch, seqlen_q, heads, head_dim = q.shape
    q_rows, k_rows, v_rows = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))  # views for transformers' layouts
    if rows.indices_k is not None:
        k_rows, v_rows = k_rows.index_select(0, rows.indices_k), v_rows.index_select(0, rows.indices_k)
        q_rows = q_rows.index_select(0, rows.indices_q)
    if rows.max_seqlen_q == 0:  # every query row is padding: nothing attends
        return q.new_zeros(q.shape)
    out = _dash_api.flash_attn_varlen_func(
        q_rows, k_rows, v_rows, rows.cu_seqlens_q, rows.cu_seqlens_k, rows.max_seqlen_q, max(rows.max_seqlen_k, 1),
        softmax_scale=scaling, causal=causal, deterministic=settings.deterministic, schedule=settings.schedule,
    )
    if rows.indices_q is not None:
        out = out.new_zeros(batch * seqlen_q, heads, head_dim).index_copy(0, rows.indices_q, out)
    return out.view(batch, seqlen_q, heads, head_dim)


# ---------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------
_registered: dict[str, tuple[Settings, Callable, Callable]] = {}


def register(name: str = "dash", deterministic: Optional[bool] = None, schedule: str = "auto") -> str:
    """Register DASH with transformers as ``attn_implementation=name``; returns ``name``.

    deterministic: None follows ``torch.are_deterministic_algorithms_enabled()`` at each call
        (DASH's rule); True makes every backward bitwise reproducible; False never.
    schedule: the deterministic reduction schedule (see ``python -m dash simulate``).

    Idempotent: registering a name again replaces its settings (the last call wins). Must run
    before ``from_pretrained``/``from_config``/``set_attn_implementation`` use the name, as
    transformers rejects names it does not know."""
    attention_interface, mask_interface = _interfaces()
    _check_name(name)
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be None or a bool, got {deterministic!r}")
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"schedule={schedule!r} is unknown; choose one of {', '.join(SCHEDULE_NAMES)}")
    if schedule != "auto" and schedule not in KERNEL_SCHEDULES:
        raise NotImplementedError(
            f"schedule={schedule!r} is modelled (python -m dash simulate) but not implemented by the kernel yet; "
            f"implemented: {', '.join(KERNEL_SCHEDULES)}"
        )
    settings = Settings(name, deterministic, schedule)
    previous = _registered.get(name)
    if previous is not None and previous[0] == settings:
        attn, mask = previous[1], previous[2]
    else:
        attn = functools.partial(attention_forward, settings=settings)
        functools.update_wrapper(attn, attention_forward)
        attn.__name__ = f"dash_attention_forward[{name}]"  # type: ignore[attr-defined]
        attn.dash_settings = settings  # type: ignore[attr-defined]
        mask = functools.partial(_mask_function, name)
        functools.update_wrapper(mask, _mask_function)
        mask.dash_settings = settings  # type: ignore[attr-defined]
    attention_interface.register(name, attn)
    if mask_interface is not None:
        mask_interface.register(name, mask)
    _registered[name] = (settings, attn, mask)
    return name


def registered_names() -> dict[str, Settings]:
    """The names this module registered, with their settings."""
    return {n: s for n, (s, _, _) in _registered.items()}


register()
