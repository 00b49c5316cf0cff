"""Reference attention math: the oracle for every DASH kernel test.

Plain PyTorch, no device-specific code: the same functions run on CPU and CUDA
tensors.  Layout and semantics follow FlashAttention-3:

* ``q``: ``(B, Sq, Hq, D)``; ``k``: ``(B, Sk, Hk, D)``; ``v``: ``(B, Sk, Hk, Dv)``.
* GQA / MQA: ``Hq % Hk == 0`` and query head ``h`` reads KV head ``h // (Hq // Hk)``.
* Scores: ``x_ij = softmax_scale * q_i . k_j``; with ``softcap > 0`` the scores are
  ``s_ij = softcap * tanh(x_ij / softcap)`` (the scale is applied *inside* the
  tanh, as in FA3), otherwise ``s_ij = x_ij``.
* ``lse_i = log(sum_j exp(s_ij))`` over the keys row ``i`` may see (natural log).
* Masks are aligned bottom-right.  With ``off = Sk - Sq`` query ``i`` sees key ``j``
  iff ``i + off - wl <= j <= i + off + wr`` for ``window_size = (wl, wr)``, where a
  negative bound means "unbounded" on that side.  ``causal=True`` is the window
  ``(wl, 0)`` (it overrides ``wr``), i.e. ``j <= i + Sk - Sq``.
* A row that sees no key at all ("fully masked", e.g. ``Sq > Sk`` causal, or a
  narrow window) has ``out = 0``, ``lse = -inf`` and contributes zero gradients.
  No NaN is ever produced for such rows.  (FA3's kernels store ``-inf`` there too,
  ``hopper/softmax.h``, as DASH's do; FlashAttention-2 and earlier FA3 versions store
  ``+inf``, so :func:`attention_backward` accepts either infinity.)

Precision (``compute_dtype``)
-----------------------------
* ``torch.float64`` / ``torch.float32``: every step in that dtype (the "high"
  reference).  Float32 matrix products are run with TF32 disabled, whatever the
  global setting (:func:`torch.get_float32_matmul_precision` is restored after).
* ``torch.bfloat16`` / ``torch.float16``: "the same computation in low precision",
  modelled on FA3's ``attention_ref(..., upcast=False)``.  Inputs are rounded to
  the low dtype; every matrix product takes low-precision operands, accumulates
  in float32 (as tensor cores do) and rounds its result to the low dtype; the
  softcap is applied with low-precision elementwise ops; the softmax statistics
  (row max, sum of exponentials, ``lse``, ``exp``) are float32, and the
  probabilities ``P`` are rounded to the low dtype before ``P @ V`` (forward) and
  ``P^T @ dO`` (backward).  In the backward, ``dP = dO @ V^T`` is rounded to the
  low dtype, ``D = rowsum(dO * O)`` and ``dS`` are float32, and ``dS`` is rounded
  to the low dtype before the ``dS @ K`` / ``dS^T @ Q`` products.  ``dk``/``dv``
  of a GQA group and of all row chunks are accumulated in float32 and rounded
  once at the end.

Memory: the work is split over (batch, KV-head range, query-row range) chunks of at
most :data:`CHUNK_ELEMENTS` score elements, so the peak extra memory is a handful
of ``CHUNK_ELEMENTS``-sized buffers (about 1-2 GiB in float32) regardless of the
problem size.

Error rule (FA3's tests): a kernel result ``actual`` passes when
``max|actual - ref_high| <= factor * max|ref_low - ref_high| + floor``; see
:func:`error_bound` and :func:`assert_within_bound`.  The same rule per block of rows
(:func:`assert_within_bound_blocks`) sees a wrong tile of a long sequence that the global
maximum hides.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = [
    "CHUNK_ELEMENTS",
    "LOW_PRECISION_DTYPES",
    "attention_forward",
    "attention_backward",
    "visibility_mask",
    "error_bound",
    "default_floor",
    "assert_within_bound",
    "assert_within_bound_blocks",
    "BLOCK_GLOBAL_SHARE",
]

#: Upper bound on the number of score elements (rows x keys x heads) one chunk of
#: the reference computation materialises.  Tests may lower it to exercise chunking.
CHUNK_ELEMENTS: int = 1 << 25

#: compute dtypes that are emulated as "low-precision operands, float32 accumulation".
LOW_PRECISION_DTYPES: Tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
_HIGH_PRECISION_DTYPES: Tuple[torch.dtype, ...] = (torch.float32, torch.float64)


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _highest_matmul_precision() -> Iterator[None]:
    """Disable TF32 for float32 matrix products while the reference runs."""
    previous = torch.get_float32_matmul_precision()
    if previous == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _stats_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """dtype of the softmax statistics and of the gradient accumulators."""
    return torch.float64 if compute_dtype == torch.float64 else torch.float32


def _check_compute_dtype(compute_dtype: torch.dtype) -> None:
    if compute_dtype not in _HIGH_PRECISION_DTYPES + LOW_PRECISION_DTYPES:
        raise ValueError(
            "compute_dtype must be one of float64, float32, bfloat16, float16; "
            f"got {compute_dtype}"
        )


def _normalize_window(window_size: Optional[Sequence[Optional[int]]], causal: bool) -> Tuple[int, int]:
    if window_size is None:
        window_size = (-1, -1)
    if len(window_size) != 2:
        raise ValueError(f"window_size must have two entries, got {window_size!r}")
    wl, wr = (-1 if w is None else int(w) for w in window_size)
    wl = -1 if wl < 0 else wl
    wr = -1 if wr < 0 else wr
    if causal:
        wr = 0
    return wl, wr


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> Tuple[int, int, int, int, int, int, int]:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "q, k, v must be 4-D (batch, seqlen, heads, head_dim); got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, Sq, Hq, D = q.shape
    Bk, Sk, Hk, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}")
    if tuple(v.shape[:3]) != (B, Sk, Hk):
        raise ValueError(f"v shape {tuple(v.shape)} does not match k shape {tuple(k.shape)}")
    if Hk == 0 or Hq % Hk != 0:
        raise ValueError(f"number of query heads ({Hq}) must be a multiple of KV heads ({Hk})")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v on different devices: {q.device}, {k.device}, {v.device}")
    return B, Sq, Sk, Hq, Hk, D, v.shape[3]


def _resolve_scale(softmax_scale: Optional[float], head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    return float(softmax_scale)


def visibility_mask(
    seqlen_q: int,
    seqlen_k: int,
    causal: bool = False,
    window_size: Sequence[Optional[int]] = (-1, -1),
    device: Optional[torch.device] = None,
    row_start: int = 0,
    row_end: Optional[int] = None,
) -> Optional[Tensor]:
    """Boolean ``(rows, seqlen_k)`` mask, True where query row ``i`` may see key ``j``.

    Rows ``row_start:row_end`` of the full ``(seqlen_q, seqlen_k)`` mask (default:
    all).  Bottom-right aligned, as described in the module docstring.  Returns
    ``None`` when nothing is masked (no causal flag and both window sides
    unbounded), so callers can skip the masking step.
    """
    wl, wr = _normalize_window(window_size, causal)
    if wl < 0 and wr < 0:
        return None
    if row_end is None:
        row_end = seqlen_q
    rows = torch.arange(row_start, row_end, device=device, dtype=torch.long).unsqueeze(1)
    cols = torch.arange(seqlen_k, device=device, dtype=torch.long).unsqueeze(0)
    diag = rows + (seqlen_k - seqlen_q)  # key index aligned with query row
    visible = torch.ones(rows.shape[0], seqlen_k, dtype=torch.bool, device=device)
    if wl >= 0:
        visible &= cols >= diag - wl
    if wr >= 0:
        visible &= cols <= diag + wr
    return visible


def _chunks(B: int, Hk: int, G: int, Sq: int, Sk: int) -> Iterator[Tuple[int, int, int, int, int]]:
    """Yield ``(b, h0, h1, r0, r1)`` chunks of at most ~CHUNK_ELEMENTS scores each."""
    budget = max(1, int(CHUNK_ELEMENTS))
    per_row = max(1, G * Sk)  # score elements one query row of one KV head creates
    rows = max(1, min(Sq, budget // per_row)) if Sq > 0 else 0
    if rows >= Sq:
        heads = max(1, min(Hk, budget // max(1, per_row * max(Sq, 1))))
        rows = Sq
    else:
        heads = 1
    for b in range(B):
        for h0 in range(0, Hk, heads):
            h1 = min(Hk, h0 + heads)
            if Sq == 0:
                yield b, h0, h1, 0, 0
                continue
            for r0 in range(0, Sq, rows):
                yield b, h0, h1, r0, min(Sq, r0 + rows)


def _group_rows(x: Tensor, b: int, r0: int, r1: int, h0: int, h1: int, G: int) -> Tensor:
    """``x[b, r0:r1]`` with shape ``(R, Hq, E)`` -> ``(h1 - h0, G, R, E)`` (KV head, group)."""
    xb = x[b, r0:r1]
    R, Hq, E = xb.shape
    xb = xb.reshape(R, Hq // G, G, E)[:, h0:h1]
    return xb.permute(1, 2, 0, 3)


def _lowp_matmul(a: Tensor, b: Tensor, low: torch.dtype) -> Tensor:
    """Low-precision operands, float32 accumulation, float32 result (not rounded)."""
    return torch.matmul(a.to(low).float(), b.to(low).float())


class _Computer:
    """Shared per-chunk arithmetic of the forward and backward references."""

    def __init__(self, compute_dtype: torch.dtype, scale: float, softcap: float) -> None:
        _check_compute_dtype(compute_dtype)
        if softcap < 0 or not math.isfinite(softcap):
            raise ValueError(f"softcap must be a finite number >= 0, got {softcap}")
        self.cd = compute_dtype
        self.st = _stats_dtype(compute_dtype)
        self.low = compute_dtype in LOW_PRECISION_DTYPES
        self.scale = scale
        self.softcap = float(softcap)

    def mm(self, a: Tensor, b: Tensor) -> Tensor:
        """Matrix product in the compute precision, result in the stats dtype.

        For low precision the result is NOT rounded; callers round where FA3's
        reference would store the product in the low dtype.
        """
        if self.low:
            return _lowp_matmul(a, b, self.cd)
        return torch.matmul(a.to(self.cd), b.to(self.cd))

    def round(self, x: Tensor) -> Tensor:
        """Round to the compute dtype, returned in the stats dtype."""
        return x.to(self.cd).to(self.st) if self.low else x.to(self.st)

    def scores(self, qg: Tensor, kh: Tensor, mask: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
        """Masked scores (stats dtype, -inf where masked) and tanh(x/softcap) or None.

        qg: (H, G, R, D); kh: (H, Sk, D); mask: (R, Sk) or None.
        """
        H, G, R, D = qg.shape
        qs = qg.to(self.cd) * self.scale  # rounded to the low dtype if low
        # (H, G*R, D) @ (H, D, Sk): the G query heads of a KV head share one product.
        x = self.mm(qs.reshape(H, G * R, D), kh.transpose(1, 2)).view(H, G, R, -1)
        t: Optional[Tensor] = None
        if self.low:
            x = x.to(self.cd)
            if self.softcap > 0:
                tl = torch.tanh(x / self.softcap)
                s = (tl * self.softcap).to(self.st)
                t = tl.to(self.st)
            else:
                s = x.to(self.st)
        else:
            if self.softcap > 0:
                t = torch.tanh(x / self.softcap)
                s = t * self.softcap
            else:
                s = x
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return s, t

    @staticmethod
    def lse(s: Tensor) -> Tensor:
        """Row log-sum-exp of masked scores; -inf for rows without visible keys."""
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        return (s - m).exp().sum(dim=-1).log() + m.squeeze(-1)

    @staticmethod
    def probs(s: Tensor, lse: Tensor) -> Tensor:
        """exp(s - lse) with rows of non-finite lse (fully masked) set to 0."""
        finite = torch.isfinite(lse).unsqueeze(-1)
        lse_safe = torch.where(finite, lse.unsqueeze(-1), torch.zeros_like(lse.unsqueeze(-1)))
        p = (s - lse_safe).exp()
        return torch.where(finite, p, torch.zeros_like(p))


# --------------------------------------------------------------------------- forward


def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[Optional[int]] = (-1, -1),
    softcap: float = 0.0,
    compute_dtype: torch.dtype = torch.float32,
) -> Tuple[Tensor, Tensor]:
    """Reference attention forward.

    Args:
        q: ``(B, Sq, Hq, D)``, any floating dtype.
        k: ``(B, Sk, Hk, D)``, ``Hq % Hk == 0``.
        v: ``(B, Sk, Hk, Dv)``.
        softmax_scale: multiplies ``q . k``; default ``1 / sqrt(D)``.
        causal: bottom-right aligned causal mask (window ``(wl, 0)``).
        window_size: ``(wl, wr)`` sliding window, negative = unbounded side.
        softcap: if > 0, scores are ``softcap * tanh(scale * q.k / softcap)``.
        compute_dtype: float64, float32 (high references) or bfloat16/float16
            (low-precision emulation, see the module docstring).

    Returns:
        ``(out, lse)``: ``out`` is ``(B, Sq, Hq, Dv)`` in ``compute_dtype``;
        ``lse`` is ``(B, Hq, Sq)``, float64 if ``compute_dtype`` is float64 else
        float32, natural-log log-sum-exp of the (softcapped) scores over visible
        keys, ``-inf`` for fully masked rows (whose ``out`` rows are 0).
    """
    B, Sq, Sk, Hq, Hk, D, Dv = _check_shapes(q, k, v)
    G = Hq // Hk
    scale = _resolve_scale(softmax_scale, D)
    comp = _Computer(compute_dtype, scale, softcap)
    wl, wr = _normalize_window(window_size, causal)
    device = q.device

    out = torch.zeros(B, Sq, Hq, Dv, dtype=compute_dtype, device=device)
    lse = torch.full((B, Hq, Sq), float("-inf"), dtype=comp.st, device=device)
    if B == 0 or Sq == 0 or Hq == 0 or Sk == 0:
        return out, lse

    with torch.no_grad(), _highest_matmul_precision():
        for b, h0, h1, r0, r1 in _chunks(B, Hk, G, Sq, Sk):
            R = r1 - r0
            mask = visibility_mask(Sq, Sk, False, (wl, wr), device, r0, r1)
            qg = _group_rows(q, b, r0, r1, h0, h1, G)  # (H, G, R, D)
            kh = k[b, :, h0:h1].transpose(0, 1)  # (H, Sk, D)
            vh = v[b, :, h0:h1].transpose(0, 1)  # (H, Sk, Dv)
            s, _ = comp.scores(qg, kh, mask)
            row_lse = comp.lse(s)  # (H, G, R)
            p = comp.probs(s, row_lse)
            H = h1 - h0
            o = comp.mm(comp.round(p).reshape(H, G * R, Sk), vh).view(H, G, R, Dv)
            # (H, G, R, Dv) -> (R, H*G, Dv)
            out[b, r0:r1, h0 * G : h1 * G] = o.permute(2, 0, 1, 3).reshape(R, (h1 - h0) * G, Dv).to(compute_dtype)
            lse[b, h0 * G : h1 * G, r0:r1] = row_lse.reshape((h1 - h0) * G, R)
    return out, lse


def _varlen_offsets(cu_seqlens_q: Sequence[int], cu_seqlens_k: Sequence[int], q: Tensor,
                    k: Tensor) -> Tuple[list, list]:
    """The offsets as lists of ints, checked: one length, non-decreasing from 0 to the rows of
    q and of k."""
    cq, ck = [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]
    if len(cq) != len(ck) or len(cq) < 2 or cq[0] != 0 or ck[0] != 0 or cq[-1] != q.shape[0] \
            or ck[-1] != k.shape[0] or any(b < a for a, b in zip(cq, cq[1:])) or any(b < a for a, b in zip(ck, ck[1:])):
        raise ValueError(f"cu_seqlens_q={cq} / cu_seqlens_k={ck} must be non-decreasing offsets from 0 to the "
                         f"rows of q ({q.shape[0]}) and k ({k.shape[0]}), of one length")
    return cq, ck


def attention_forward_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Sequence[int],
    cu_seqlens_k: Sequence[int],
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> Tuple[Tensor, Tensor]:
    """Reference forward of a variable-length batch (FA3's varlen layout).

    ``q``: ``(total_q, Hq, D)``, ``k`` / ``v``: ``(total_k, Hk, D)``, sequence ``b`` being rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k and
    v (offsets from 0 to the row counts, non-decreasing). Each sequence is attended alone by
    :func:`attention_forward` (the causal mask aligned to its own bottom-right corner).

    Returns ``(out, lse)``: ``out`` ``(total_q, Hq, D)`` in ``compute_dtype``, ``lse``
    ``(Hq, total_q)``; rows of a sequence without keys have ``out = 0`` and ``lse = -inf``.
    """
    cq, ck = _varlen_offsets(cu_seqlens_q, cu_seqlens_k, q, k)
    scale = _resolve_scale(softmax_scale, q.shape[-1])
    stats = torch.float64 if compute_dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=compute_dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=stats, device=q.device)
    for b in range(len(cq) - 1):
        (q0, q1), (k0, k1) = (cq[b], cq[b + 1]), (ck[b], ck[b + 1])
        if q1 == q0 or k1 == k0:
            continue  # no rows, or rows without keys (out 0, lse -inf)
        o, l = attention_forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale, causal=causal,
                                 compute_dtype=compute_dtype)
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
    return out, lse


# --------------------------------------------------------------------------- backward


def attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[Optional[int]] = (-1, -1),
    softcap: float = 0.0,
    compute_dtype: torch.dtype = torch.float32,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Reference attention backward, written out explicitly (no autograd).

    With ``P = exp(s - lse)`` (0 where masked or where ``lse`` is +-inf),
    ``D_i = sum_d dO_id O_id``, ``dP = dO V^T``, ``dS = P * (dP - D)``, and with a
    softcap ``dS *= 1 - tanh^2(x / softcap)``:
    ``dq = scale * dS K``, ``dk = scale * dS^T Q``, ``dv = P^T dO``; for GQA ``dk``
    and ``dv`` are summed over the query heads of each KV head's group.

    Args:
        dout: ``(B, Sq, Hq, Dv)`` gradient of ``out``.
        q, k, v: as in :func:`attention_forward`.
        out: ``(B, Sq, Hq, Dv)`` forward output (used only for ``D``).
        lse: ``(B, Hq, Sq)`` forward log-sum-exp (natural log); ``-inf`` or ``+inf``
            marks a fully masked row.
        softmax_scale, causal, window_size, softcap, compute_dtype: as in the
            forward; must match the values that produced ``out`` and ``lse``.

    Returns:
        ``(dq, dk, dv)`` with the shapes of ``q``, ``k``, ``v``, in ``compute_dtype``.
    """
    B, Sq, Sk, Hq, Hk, D, Dv = _check_shapes(q, k, v)
    G = Hq // Hk
    if tuple(dout.shape) != (B, Sq, Hq, Dv) or tuple(out.shape) != (B, Sq, Hq, Dv):
        raise ValueError(
            f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must be {(B, Sq, Hq, Dv)}"
        )
    if tuple(lse.shape) != (B, Hq, Sq):
        raise ValueError(f"lse shape {tuple(lse.shape)} must be {(B, Hq, Sq)}")
    scale = _resolve_scale(softmax_scale, D)
    comp = _Computer(compute_dtype, scale, softcap)
    wl, wr = _normalize_window(window_size, causal)
    device = q.device
    st = comp.st

    dq = torch.zeros(B, Sq, Hq, D, dtype=compute_dtype, device=device)
    dk_acc = torch.zeros(B, Hk, Sk, D, dtype=st, device=device)
    dv_acc = torch.zeros(B, Hk, Sk, Dv, dtype=st, device=device)
    if B == 0 or Sq == 0 or Hq == 0 or Sk == 0:
        return (
            dq,
            torch.zeros(B, Sk, Hk, D, dtype=compute_dtype, device=device),
            torch.zeros(B, Sk, Hk, Dv, dtype=compute_dtype, device=device),
        )

    with torch.no_grad(), _highest_matmul_precision():
        for b, h0, h1, r0, r1 in _chunks(B, Hk, G, Sq, Sk):
            R = r1 - r0
            H = h1 - h0
            mask = visibility_mask(Sq, Sk, False, (wl, wr), device, r0, r1)
            qg = _group_rows(q, b, r0, r1, h0, h1, G)  # (H, G, R, D)
            dog = _group_rows(dout, b, r0, r1, h0, h1, G)  # (H, G, R, Dv)
            og = _group_rows(out, b, r0, r1, h0, h1, G)  # (H, G, R, Dv)
            kh = k[b, :, h0:h1].transpose(0, 1)  # (H, Sk, D)
            vh = v[b, :, h0:h1].transpose(0, 1)  # (H, Sk, Dv)
            lse_c = lse[b, h0 * G : h1 * G, r0:r1].reshape(H, G, R).to(st)

            s, t = comp.scores(qg, kh, mask)
            p = comp.probs(s, lse_c)  # (H, G, R, Sk)
            p_low = comp.round(p)
            do_c = comp.round(dog.to(st))
            # dv = P^T dO, summed over the G query heads and the R rows of the chunk.
            dv_acc[b, h0:h1] += comp.mm(
                p_low.reshape(H, G * R, Sk).transpose(1, 2), do_c.reshape(H, G * R, Dv)
            ).to(st)
            dp = comp.round(comp.mm(do_c.reshape(H, G * R, Dv), vh.transpose(1, 2))).view(H, G, R, Sk)
            delta = (dog.to(st) * og.to(st)).sum(dim=-1, keepdim=True)  # (H, G, R, 1)
            ds = p * (dp - delta)
            if t is not None:
                ds = ds * (1.0 - t * t)
            ds = comp.round(ds)
            dq_c = (comp.mm(ds.reshape(H, G * R, Sk), kh) * scale).view(H, G, R, D)
            dq[b, r0:r1, h0 * G : h1 * G] = dq_c.permute(2, 0, 1, 3).reshape(R, H * G, D).to(compute_dtype)
            dk_acc[b, h0:h1] += (
                comp.mm(ds.reshape(H, G * R, Sk).transpose(1, 2), qg.reshape(H, G * R, D)) * scale
            ).to(st)

    dk = dk_acc.transpose(1, 2).to(compute_dtype)
    dv = dv_acc.transpose(1, 2).to(compute_dtype)
    return dq, dk, dv


# --------------------------------------------------------------------------- error rule


def attention_backward_varlen(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Sequence[int],
    cu_seqlens_k: Sequence[int],
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Reference backward of a variable-length batch (the layout of
    :func:`attention_forward_varlen`): each sequence by :func:`attention_backward`.

    ``dout``, ``out``: ``(total_q, Hq, Dv)``; ``lse``: ``(Hq, total_q)``. Returns ``(dq, dk,
    dv)`` packed like ``q``, ``k``, ``v``; rows of a sequence without queries or keys get 0.
    """
    cq, ck = _varlen_offsets(cu_seqlens_q, cu_seqlens_k, q, k)
    dq = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=compute_dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=compute_dtype, device=v.device)
    scale = _resolve_scale(softmax_scale, q.shape[-1])
    for b in range(len(cq) - 1):
        (q0, q1), (k0, k1) = (cq[b], cq[b + 1]), (ck[b], ck[b + 1])
        if q1 == q0 or k1 == k0:
            continue  # nothing attends: every gradient of the sequence is 0
        g = attention_backward(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
                               lse[None, :, q0:q1], scale, causal=causal, compute_dtype=compute_dtype)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


def default_floor(ref_high: Tensor, low_dtype: torch.dtype) -> float:
    """Default absolute floor of :func:`error_bound`: ``eps(low_dtype) * max|ref_high|``.

    ``eps`` is the spacing of ``low_dtype`` at 1.0 (2**-7 for bfloat16, 2**-10 for
    float16), so the floor is one to two units in the last place of ``low_dtype``
    at the tensor's largest magnitude: a result that differs from the reference
    only by its final rounding to ``low_dtype`` always passes, even where
    ``ref_low`` happens to be exact.  This is the size of FA3's
    ``2 * (x + 0.3 - 0.3 - x).abs().max()`` floor without its 0.3 offset, so it
    scales with tensors of small magnitude.  Non-finite entries of ``ref_high``
    are ignored; an all-zero (or empty) tensor gives ``0.0``.
    """
    if not low_dtype.is_floating_point:
        raise ValueError(f"low_dtype must be a floating dtype, got {low_dtype}")
    h = ref_high.detach().to(torch.float64)
    h = h[torch.isfinite(h)]
    if h.numel() == 0:
        return 0.0
    return torch.finfo(low_dtype).eps * float(h.abs().max())


def _max_finite_diff(a: Tensor, ref_high: Tensor) -> Tuple[float, Optional[Tuple[int, ...]]]:
    """max |a - ref_high| over entries where ref_high is finite, and its index."""
    h = ref_high.detach().to(torch.float64)
    x = a.detach().to(device=h.device, dtype=torch.float64)
    finite = torch.isfinite(h)
    diff = torch.where(finite, (x - h).abs(), torch.zeros_like(h))
    if diff.numel() == 0:
        return 0.0, None
    flat = int(torch.argmax(torch.nan_to_num(diff, nan=float("inf")).reshape(-1)))
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    return float(diff.reshape(-1)[flat]), idx


def error_bound(
    ref_high: Tensor,
    ref_low: Tensor,
    factor: float = 2.0,
    floor: Optional[float] = None,
) -> float:
    """FA3's test rule: ``factor * max|ref_low - ref_high| + floor``.

    ``ref_high`` is a high-precision reference (float64 or float32 compute) and
    ``ref_low`` the same computation in the kernel's low precision
    (``compute_dtype=torch.bfloat16`` / ``float16``); a kernel result is accepted
    when its max error against ``ref_high`` is at most this bound.

    Entries where ``ref_high`` is not finite (the ``-inf`` lse of fully masked
    rows) are left out of the max; ``ref_low`` must be finite wherever
    ``ref_high`` is (``ValueError`` otherwise: a broken reference would make the
    bound meaningless).  ``floor=None`` picks :func:`default_floor` with
    ``ref_low``'s dtype.
    """
    if tuple(ref_high.shape) != tuple(ref_low.shape):
        raise ValueError(f"shapes differ: ref_high {tuple(ref_high.shape)}, ref_low {tuple(ref_low.shape)}")
    h = ref_high.detach().to(torch.float64)
    lo = ref_low.detach().to(device=h.device, dtype=torch.float64)
    bad = torch.isfinite(h) & ~torch.isfinite(lo)
    if bool(bad.any()):
        raise ValueError(f"ref_low is not finite at {int(bad.sum())} entries where ref_high is finite")
    ref_err, _ = _max_finite_diff(lo, h)
    if floor is None:
        floor = default_floor(h, ref_low.dtype)
    return float(factor) * ref_err + float(floor)


def assert_within_bound(
    actual: Tensor,
    ref_high: Tensor,
    ref_low: Tensor,
    name: str,
    factor: float = 2.0,
    floor: Optional[float] = None,
) -> Tuple[float, float]:
    """Assert ``max|actual - ref_high| <= error_bound(ref_high, ref_low, factor, floor)``.

    Raises ``AssertionError`` (message names ``name``, the max error, the bound,
    the reference error, and the index and values of the worst element) when:

    * the shapes differ;
    * ``actual`` is NaN or +-inf anywhere ``ref_high`` is finite;
    * ``actual`` differs from ``ref_high`` where ``ref_high`` is not finite
      (e.g. ``-inf`` lse of a fully masked row must be ``-inf``);
    * the max error exceeds the bound.

    ``floor=None`` uses :func:`default_floor` with the coarser of ``actual``'s and
    ``ref_low``'s dtypes.  Returns ``(max_error, bound)`` on success.
    """
    if tuple(actual.shape) != tuple(ref_high.shape):
        raise AssertionError(
            f"{name}: shape {tuple(actual.shape)} differs from reference shape {tuple(ref_high.shape)}"
        )
    h = ref_high.detach().to(torch.float64)
    a = actual.detach().to(device=h.device, dtype=torch.float64)
    _check_non_finite(a, h, name)

    if floor is None:
        floor = default_floor(h, _coarser_dtype(actual, ref_low))
    bound = error_bound(h, ref_low, factor=factor, floor=floor)
    err, idx = _max_finite_diff(a, h)
    if not err <= bound:
        lo = ref_low.detach().to(device=h.device, dtype=torch.float64)
        ref_err, _ = _max_finite_diff(lo, h)
        raise AssertionError(
            f"{name}: max |actual - ref_high| = {err:.6e} exceeds bound {bound:.6e} "
            f"(= {factor} * ref_low error {ref_err:.6e} + floor {floor:.6e}); "
            f"worst at index {idx}: actual={float(a[idx]):.8e}, ref_high={float(h[idx]):.8e}, "
            f"ref_low={float(lo[idx]):.8e}"
        )
    return err, bound


def _coarser_dtype(actual: Tensor, ref_low: Tensor) -> torch.dtype:
    """The coarser of ``actual``'s and ``ref_low``'s floating dtypes (the floor's eps)."""
    low_dtype = ref_low.dtype
    if actual.dtype.is_floating_point and torch.finfo(actual.dtype).eps > torch.finfo(low_dtype).eps:
        low_dtype = actual.dtype
    return low_dtype


def _check_non_finite(a: Tensor, h: Tensor, name: str) -> None:
    """AssertionError where ``a`` is not finite but ``h`` is, or ``a`` differs from a non-finite ``h``."""
    h_finite = torch.isfinite(h)
    bad = h_finite & ~torch.isfinite(a)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{name}: {int(bad.sum())} non-finite value(s) where the reference is finite; "
            f"first at index {first}: actual={float(a[first])!r}, ref_high={float(h[first])!r}"
        )
    nonfinite_ref = ~h_finite
    if bool(nonfinite_ref.any()):
        mismatch = nonfinite_ref & ~((a == h) | (torch.isnan(a) & torch.isnan(h)))
        if bool(mismatch.any()):
            first = tuple(int(i) for i in mismatch.nonzero()[0])
            raise AssertionError(
                f"{name}: {int(mismatch.sum())} value(s) differ where the reference is non-finite; "
                f"first at index {first}: actual={float(a[first])!r}, ref_high={float(h[first])!r}"
            )


# --------------------------------------------------------------------------- the rule per block

#: Share of the tensor's global bound (:func:`error_bound`) that every block's bound of
#: :func:`assert_within_bound_blocks` includes.  A block whose reference is ~0 by cancellation
#: (a row that sees one key: ``P = 1``, so ``dS = dP - D = 0``; the one visible row of a
#: causal ``239 x 1`` tile) has a bound of ``factor * |ref_low - ref_high|`` alone, from
#: ``dP`` rounded to the low dtype (up to 2**-9 of ``|dP|`` in bfloat16), while a correct
#: kernel's float32 cancellation leaves about 2**-20 of it; were ``dP`` exact in the low dtype
#: on every row of the block (about 2**-16 per row), the bound would be ~0.  1/64 of the global
#: bound covers that (16-64 times the kernel's float32 noise) and keeps the bugs it is for far
#: over the block's bound: at 4224 x 4224 causal (hdim 64 and 128) a Q tile that lost one
#: column's dQ partial, or a diagonal column's dK/dV that lost one Q tile, measured 6-25 times
#: it (with 1/16: 3.6-17), a correct kernel's arithmetic 0.23 at most.  (Column 0 losing one
#: late Q tile, a small part of its long sum, stays at 0.4-2 under either rule: noise size.)
BLOCK_GLOBAL_SHARE: float = 1.0 / 64


def _block_amax(x: Tensor, seq_block: int) -> Tensor:
    """Non-negative ``(B, S, H, ...)`` -> ``(B, ceil(S / seq_block), H)``: the max over each
    block of ``seq_block`` rows of dim 1 and over the dims after the heads."""
    B, S, H = x.shape[:3]
    nb = -(-S // seq_block)
    x = x.reshape(B, S, H, -1)
    pad = nb * seq_block - S
    if pad:  # zeros do not change a max of absolute values
        x = torch.cat([x, x.new_zeros(B, pad, H, x.shape[-1])], dim=1)
    if x.shape[-1] == 0:
        return x.new_zeros(B, nb, H)
    return x.reshape(B, nb, seq_block, H, -1).amax(dim=(2, 4))


def assert_within_bound_blocks(
    actual: Tensor,
    ref_high: Tensor,
    ref_low: Tensor,
    name: str,
    seq_block: int,
    factor: float = 2.0,
    global_share: float = BLOCK_GLOBAL_SHARE,
) -> Tuple[float, float]:
    """The rule of :func:`assert_within_bound` per (batch, block of ``seq_block`` rows, head).

    Tensors are ``(B, S, H, ...)`` (``dq``, ``dk``, ``dv`` in FA3's layout); a block is
    ``seq_block`` consecutive rows of dim 1 (the last one ragged) of one batch and one head,
    the kernel's tile: ``kBlockM`` (``bwd_tile_config(...).block_m``) for ``dq``, ``kBlockN``
    (``block_n``) for ``dk``/``dv``.  Block ``k`` passes when

        max_k |actual - ref_high| <= factor * max_k |ref_low - ref_high|
                                     + eps * max_k |ref_high| + global_share * global_bound

    with ``eps`` that of the coarser of ``actual``'s and ``ref_low``'s dtypes and
    ``global_bound = error_bound(ref_high, ref_low, factor)`` with that eps (see
    :data:`BLOCK_GLOBAL_SHARE`).  A global maximum is set by the tensor's largest
    entries (at long causal shapes, the first Q tiles' dq, the last columns' dk/dv): there
    a tile that lost one column's dQ partial, or a column that lost one Q tile, stays
    under the global bound (0.5-0.95 of it at 4224 x 4224 causal), while each block's own
    bound is set by its own magnitude.  A block whose references are all zero (dq rows of
    a Q tile that sees no key) must be zero up to ``global_share * global_bound``.

    Raises ``AssertionError`` as :func:`assert_within_bound` does (shape, non-finite
    values), and when a block exceeds its bound: the message names ``name``, the number of
    failing blocks and the worst one (batch, rows, head), its error, bound and their parts,
    and its worst element.  Returns ``(error, bound)`` of the block with the largest
    ``error / bound``.
    """
    if tuple(actual.shape) != tuple(ref_high.shape) or tuple(ref_low.shape) != tuple(ref_high.shape):
        raise AssertionError(
            f"{name}: shape {tuple(actual.shape)} (ref_low {tuple(ref_low.shape)}) differs from reference shape "
            f"{tuple(ref_high.shape)}"
        )
    if actual.dim() < 3:
        raise ValueError(f"{name}: blocks need (batch, seqlen, heads, ...) tensors; got shape {tuple(actual.shape)}")
    if int(seq_block) < 1:
        raise ValueError(f"seq_block must be >= 1, got {seq_block}")
    seq_block = int(seq_block)
    h = ref_high.detach().to(torch.float64)
    a = actual.detach().to(device=h.device, dtype=torch.float64)
    lo = ref_low.detach().to(device=h.device, dtype=torch.float64)
    _check_non_finite(a, h, name)
    if h.numel() == 0:
        return 0.0, 0.0
    finite = torch.isfinite(h)
    if bool((finite & ~torch.isfinite(lo)).any()):
        raise ValueError(f"{name}: ref_low is not finite where ref_high is finite")
    zero = torch.zeros_like(h)
    err_abs = torch.where(finite, (a - h).abs(), zero)
    ref_abs = torch.where(finite, (lo - h).abs(), zero)
    eps = torch.finfo(_coarser_dtype(actual, ref_low)).eps
    global_bound = error_bound(h, lo, factor=factor, floor=default_floor(h, _coarser_dtype(actual, ref_low)))
    err_b = _block_amax(err_abs, seq_block)
    ref_b = _block_amax(ref_abs, seq_block)
    mag_b = _block_amax(torch.where(finite, h.abs(), zero), seq_block)
    bound_b = float(factor) * ref_b + eps * mag_b + float(global_share) * global_bound
    ratio = torch.where(bound_b > 0, err_b / bound_b.clamp_min(torch.finfo(torch.float64).tiny),
                        torch.where(err_b > 0, torch.full_like(err_b, float("inf")), torch.zeros_like(err_b)))
    worst = tuple(int(i) for i in torch.unravel_index(torch.argmax(ratio.reshape(-1)), ratio.shape))
    err, bound = float(err_b[worst]), float(bound_b[worst])
    failing = int((err_b > bound_b).sum())
    if failing:
        b, blk, hd = worst
        r0, r1 = blk * seq_block, min(h.shape[1], (blk + 1) * seq_block)
        sub = err_abs[b, r0:r1, hd]
        rest = tuple(int(i) for i in torch.unravel_index(torch.argmax(sub.reshape(-1)), sub.shape))
        idx = (b, r0 + rest[0], hd) + rest[1:]
        raise AssertionError(
            f"{name}: {failing} of {ratio.numel()} blocks of {seq_block} rows exceed their bound; worst: batch {b}, "
            f"rows {r0}:{r1}, head {hd}: max |actual - ref_high| = {err:.6e} exceeds bound {bound:.6e} "
            f"({err / bound if bound > 0 else float('inf'):.3g}x; = {factor} * ref_low error "
            f"{float(ref_b[worst]):.6e} + {eps:.3g} * max |ref_high| {float(mag_b[worst]):.6e} + {global_share:.4g} "
            f"* global bound {global_bound:.6e}); worst at index {idx}: actual={float(a[idx]):.8e}, "
            f"ref_high={float(h[idx]):.8e}, ref_low={float(lo[idx]):.8e}"
        )
    return err, bound
