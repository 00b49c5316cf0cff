"""Tiling of an attention-backward problem into columns and Q tiles.

A *column* is one KV tile ``n`` (``block_n`` keys) of one (batch ``b``, query head ``h``);
a *Q tile* ``m`` is ``block_m`` query rows. Column ``n`` visits the contiguous Q-tile range
``[col_lo[b, n], col_hi[b, n])`` given by FA3's formulas (anatomy notes §8), and Q tile ``m``
receives dQ partials from the contiguous column range ``[row_lo[b, m], row_hi[b, m])`` (its
*contributors*). Every head of a batch has the same ranges, so the arrays are per batch.

Masks use FA3's bottom-right alignment: query row ``i`` sees key ``j`` iff
``i + sk - sq - wl <= j <= i + sk - sq + wr`` (a negative ``wl`` / ``wr`` is unbounded);
causal is ``(wl, wr) = (-1, 0)``, full is ``(-1, -1)``. Varlen problems give per-sequence
lengths; arrays are padded to the longest sequence (``Nmax`` columns, ``Mmax`` tiles) and
columns ``n >= N_b`` / tiles ``m >= M_b`` of a shorter sequence do not exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from dash.config import bwd_tile_config

MASK_FULL = "full"
MASK_CAUSAL = "causal"
MASK_LOCAL = "local"

#: Tile classes (``Tiling.tile_class``): every valid (query, key) pair of the tile is visible,
#: some are, or none is (a tile FA3's range formulas visit although it is fully masked).
TILE_FULL, TILE_PARTIAL, TILE_EMPTY = 0, 1, 2
TILE_CLASS_NAMES = ("full", "partial", "empty")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Problem:
    """Shape of one attention backward call.

    ``seqlens_q`` / ``seqlens_k`` (length ``batch``) make the problem varlen; where given they
    replace ``seqlen_q`` / ``seqlen_k`` for that side (which are then only defaults).
    ``block_m`` / ``block_n`` default to the tile config table (``dash.config``), resolved at
    construction (an unsupported head dim raises ``NotImplementedError``); local masks use the
    causal tiles, as FA3 does.
    """

    batch: int
    heads_q: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int = 128
    heads_kv: int | None = None
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    block_m: int | None = None
    block_n: int | None = None
    seqlens_q: tuple[int, ...] | None = None
    seqlens_k: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        heads_kv = self.heads_q if self.heads_kv is None else self.heads_kv
        object.__setattr__(self, "heads_kv", int(heads_kv))
        object.__setattr__(self, "window", (int(self.window[0]), int(self.window[1])))
        for name in ("seqlens_q", "seqlens_k"):
            val = getattr(self, name)
            if val is not None:
                val = tuple(int(v) for v in val)
                object.__setattr__(self, name, val)
                if len(val) != self.batch:
                    raise ValueError(f"{name} has {len(val)} entries, expected batch={self.batch}")
                if min(val, default=0) < 0:
                    raise ValueError(f"{name} has a negative length: {val}")
        if self.batch < 1 or self.heads_q < 1:
            raise ValueError(f"batch={self.batch} and heads_q={self.heads_q} must be >= 1")
        if self.heads_kv < 1 or self.heads_q % self.heads_kv:
            raise ValueError(f"heads_kv={self.heads_kv} must divide heads_q={self.heads_q}")
        if self.seqlen_q < 0 or self.seqlen_k < 0:
            raise ValueError(f"seqlen_q={self.seqlen_q}, seqlen_k={self.seqlen_k} must be >= 0")
        if self.causal and self.window[1] not in (-1, 0):
            raise ValueError(f"causal=True with window right {self.window[1]}: causal means right window 0")
        for name in ("block_m", "block_n"):
            val = getattr(self, name)
            if val is not None and val < 1:
                raise ValueError(f"{name}={val} must be >= 1")
        if self.block_m is None or self.block_n is None:
            # Resolve the tile sizes now, so an unsupported head dim fails at construction.
            cfg = bwd_tile_config(self.head_dim, self.mask != MASK_FULL)
            object.__setattr__(self, "block_m", cfg.block_m if self.block_m is None else int(self.block_m))
            object.__setattr__(self, "block_n", cfg.block_n if self.block_n is None else int(self.block_n))

    # --- mask -------------------------------------------------------------------------------
    @property
    def window_left(self) -> int:
        """Left window ``wl`` (-1 unbounded)."""
        return self.window[0]

    @property
    def window_right(self) -> int:
        """Right window ``wr`` (-1 unbounded); 0 for causal."""
        return 0 if self.causal else self.window[1]

    @property
    def mask(self) -> str:
        """``"full"``, ``"causal"`` (wl < 0, wr == 0) or ``"local"`` (any other window)."""
        wl, wr = self.window_left, self.window_right
        if wl < 0 and wr < 0:
            return MASK_FULL
        if wl < 0 and wr == 0:
            return MASK_CAUSAL
        return MASK_LOCAL

    # --- tiles ------------------------------------------------------------------------------
    @property
    def tile_shape(self) -> tuple[int, int]:
        """``(kBlockM, kBlockN)``: explicit values, else the config table's."""
        return int(self.block_m), int(self.block_n)

    @property
    def lengths_q(self) -> tuple[int, ...]:
        return self.seqlens_q if self.seqlens_q is not None else (self.seqlen_q,) * self.batch

    @property
    def lengths_k(self) -> tuple[int, ...]:
        return self.seqlens_k if self.seqlens_k is not None else (self.seqlen_k,) * self.batch

    @property
    def varlen(self) -> bool:
        return self.seqlens_q is not None or self.seqlens_k is not None

    def describe(self) -> str:
        """One-line human description."""
        bm, bn = self.tile_shape
        sq = "varlen" if self.seqlens_q is not None else str(self.seqlen_q)
        sk = "varlen" if self.seqlens_k is not None else str(self.seqlen_k)
        mask = self.mask if self.mask != MASK_LOCAL else f"local{self.window}"
        kv = f"/{self.heads_kv}kv" if self.heads_kv != self.heads_q else ""
        return (f"batch {self.batch} x heads {self.heads_q}{kv}, seqlen q {sq} k {sk}, hdim {self.head_dim}, "
                f"{mask}, tiles {bm}x{bn}")


def paper_problem(seqlen: int, head_dim: int, causal: bool = False, *, seqlen_k: int | None = None,
                  batch: int | None = None, heads: int | None = None, **kw) -> Problem:
    """The DASH/FA3 papers' benchmark convention: 16k tokens, hidden 2048.

    ``batch = max(1, 16384 // seqlen)``, ``heads = 2048 // head_dim`` unless given.
    """
    if batch is None:
        batch = max(1, 16384 // max(seqlen, 1))
    if heads is None:
        heads = max(1, 2048 // head_dim)
    sk = seqlen if seqlen_k is None else seqlen_k
    return Problem(batch=batch, heads_q=heads, seqlen_q=seqlen, seqlen_k=sk, head_dim=head_dim,
                   causal=causal, **kw)


def _column_ranges(sq: int, sk: int, bm: int, bn: int, wl: int, wr: int, n_pad: int) -> tuple[np.ndarray, np.ndarray]:
    """FA3's Q-tile range of every column of one sequence; shape ``(n_pad,)`` each."""
    num_m, num_n = _cdiv(sq, bm), _cdiv(sk, bn)
    n = np.arange(n_pad, dtype=np.int64)
    if wr >= 0:
        # floor division then clamp: identical to C truncation after clamping at 0.
        lo = np.maximum(0, (n * bn + sq - sk - wr) // bm)
    else:
        lo = np.zeros(n_pad, dtype=np.int64)
    if wl >= 0:
        hi = np.minimum(num_m, -((-((n + 1) * bn + sq - sk + wl)) // bm))
    else:
        hi = np.full(n_pad, num_m, dtype=np.int64)
    lo = np.minimum(lo, num_m)
    hi = np.maximum(hi, lo)
    lo[n >= num_n] = 0
    hi[n >= num_n] = 0
    return lo, hi


@dataclass(frozen=True, eq=False)
class Tiling:
    """Columns and Q tiles of a ``Problem`` (build with ``tile_problem``).

    Arrays (all int64): ``num_m``/``num_n`` ``(B,)``; ``col_lo``/``col_hi`` ``(B, Nmax)``;
    ``row_lo``/``row_hi`` ``(B, Mmax)``. A column with ``col_lo == col_hi`` is empty (it still
    exists when ``n < num_n[b]``: its dK/dV are zero); a tile with ``row_lo == row_hi`` has no
    contributors (its dQ is zero).
    """

    problem: Problem
    block_m: int
    block_n: int
    num_m: np.ndarray
    num_n: np.ndarray
    col_lo: np.ndarray
    col_hi: np.ndarray
    row_lo: np.ndarray
    row_hi: np.ndarray

    @property
    def batch(self) -> int:
        return self.problem.batch

    @property
    def heads(self) -> int:
        return self.problem.heads_q

    @property
    def mmax(self) -> int:
        return int(self.num_m.max(initial=0))

    @property
    def nmax(self) -> int:
        return int(self.num_n.max(initial=0))

    @property
    def col_len(self) -> np.ndarray:
        """``(B, Nmax)`` number of Q tiles each column visits."""
        return self.col_hi - self.col_lo

    @property
    def total_steps(self) -> int:
        """Number of (column, Q tile) steps over all heads."""
        return int(self.col_len.sum()) * self.heads

    def contributes(self) -> np.ndarray:
        """``(B, Mmax, Nmax)`` bool: column ``n`` visits (contributes to) Q tile ``m``."""
        m = np.arange(self.mmax)[None, :, None]
        return (self.col_lo[:, None, :] <= m) & (m < self.col_hi[:, None, :])

    @cached_property
    def tile_class(self) -> np.ndarray:
        """``(B, Mmax, Nmax)`` int8: TILE_FULL / TILE_PARTIAL / TILE_EMPTY of every (m, n).

        Only meaningful where ``contributes()``; judged on the tile's valid rows (i < sq) and
        keys (j < sk): the offsets d = j - i - (sk - sq) of the tile span an integer interval
        that is compared with the visible band [-wl, wr].
        """
        p = self.problem
        wl, wr = p.window_left, p.window_right
        sq = np.asarray(p.lengths_q, dtype=np.int64)[:, None, None]
        sk = np.asarray(p.lengths_k, dtype=np.int64)[:, None, None]
        m = np.arange(self.mmax, dtype=np.int64)[None, :, None]
        n = np.arange(self.nmax, dtype=np.int64)[None, None, :]
        i0, i1 = m * self.block_m, np.minimum((m + 1) * self.block_m, sq) - 1
        j0, j1 = n * self.block_n, np.minimum((n + 1) * self.block_n, sk) - 1
        off = sk - sq
        d_min, d_max = j0 - i1 - off, j1 - i0 - off
        lo_ok = np.ones(d_min.shape, bool) if wl < 0 else d_min >= -wl
        hi_ok = np.ones(d_min.shape, bool) if wr < 0 else d_max <= wr
        none = (i1 < i0) | (j1 < j0)
        if wr >= 0:
            none = none | (d_min > wr)
        if wl >= 0:
            none = none | (d_max < -wl)
        cls = np.where(lo_ok & hi_ok, TILE_FULL, TILE_PARTIAL).astype(np.int8)
        cls[np.broadcast_to(none, cls.shape)] = TILE_EMPTY
        return cls


def tile_problem(problem: Problem) -> Tiling:
    """Tile ``problem`` with its block sizes: columns, their Q-tile ranges, contributors."""
    bm, bn = problem.tile_shape
    lq, lk = problem.lengths_q, problem.lengths_k
    num_m = np.array([_cdiv(s, bm) for s in lq], dtype=np.int64)
    num_n = np.array([_cdiv(s, bn) for s in lk], dtype=np.int64)
    nmax, mmax = int(num_n.max(initial=0)), int(num_m.max(initial=0))
    B = problem.batch
    col_lo = np.zeros((B, nmax), dtype=np.int64)
    col_hi = np.zeros((B, nmax), dtype=np.int64)
    row_lo = np.zeros((B, mmax), dtype=np.int64)
    row_hi = np.zeros((B, mmax), dtype=np.int64)
    wl, wr = problem.window_left, problem.window_right
    for b in range(B):
        lo, hi = _column_ranges(lq[b], lk[b], bm, bn, wl, wr, nmax)
        col_lo[b], col_hi[b] = lo, hi
        nb = int(num_n[b])
        m = np.arange(mmax)
        # lo and hi are non-decreasing in n, so the contributors of m form a contiguous range:
        # {n : hi(n) > m} = [first, nb) and {n : lo(n) <= m} = [0, last).
        first = np.searchsorted(hi[:nb], m, side="right")
        last = np.searchsorted(lo[:nb], m, side="right")
        last = np.maximum(last, first)
        valid = m < num_m[b]
        row_lo[b] = np.where(valid, first, 0)
        row_hi[b] = np.where(valid, last, 0)
        # A column with an empty range has lo == hi and never counts (hi > m >= lo fails).
    return Tiling(problem, bm, bn, num_m, num_n, col_lo, col_hi, row_lo, row_hi)


def causal_n_max(m: np.ndarray | int, sq: int, sk: int, bm: int, bn: int) -> np.ndarray:
    """FA3's closed form for the contributors of a causal Q tile: ``[0, n_max(m))``.

    ``n_max(m) = clamp(ceil(((m+1)*kBlockM + sk - sq) / kBlockN), 0, N)``.
    """
    num_n = _cdiv(sk, bn)
    m = np.asarray(m, dtype=np.int64)
    return np.clip(-((-((m + 1) * bm + sk - sq)) // bn), 0, num_n)
