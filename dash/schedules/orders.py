"""Schedules: which CTA runs which column, in which Q-tile order, and each tile's add order.

A schedule is a pure function of the tiling and the number of CTAs ``P`` it is planned for
(never of timing). It is built from three choices:

* **items** — the unit a CTA takes: one column (``single``) or the pair of columns
  ``(k, N-1-k)`` of one head, long one first (``pair``; the middle column of an odd ``N``
  is an item alone);
* **dispatch** — ``claim``: items are claimed in increasing ``L`` (``claim_rank``: ``L = k +
  K*(h + H*b)``, or with heads interleaved in L2 sections); CTA ``x``
  starts with item ``x`` and each later item goes to the CTA that frees up first (what the
  kernel's atomic work counter and the hardware's block dispatcher do). The plan resolves
  "frees up first" by list scheduling on the items' step counts, ties to the lower CTA; the
  accumulation order never depends on it. ``roundrobin``: item ``L = k + K*(h + H*b)`` (``K`` items per head, padded to
  the longest sequence for varlen) runs on CTA ``L % P`` as that CTA's ``L // P``-th item
  (its *wave*); ``teams``: items are cut into groups of ``G`` consecutive items of one head,
  group ``g`` of head ``hd = b*H + h`` is number ``Q = hd + B*H*g`` (heads fastest), and team
  ``Q % T`` (``T = P // G`` teams of ``G`` CTAs) runs it as its ``Q // T``-th group, slot ``a``
  on CTA ``team*G + a``;
* **visit order** of a column over its range ``[lo, hi)``: ascending, descending, ``cyclic``
  (``m_t = lo + (a + t) mod (hi - lo)`` for slot ``a``), or ``rect`` (a cyclic shift inside the
  rectangle ``[r0, r1)`` that every long column of the group visits, then the column's own
  tiles below ``r0`` and above ``r1`` ascending);
* **turns** — ``asc_n``: contributors of a tile add in ascending column order;
  ``desc_n``: descending; ``arrival``: in the order (epoch, step within the item, slot), where
  the epoch is the wave (round-robin) or the group (teams). ``arrival`` numbers the
  contributions in the order a lock-step run would deliver them, and is deadlock-free for any
  visit orders: every wait points to a strictly smaller (epoch, step, slot) and each CTA runs
  its work in increasing (epoch, step).

Compact array form (``Plan``): ``cta_ptr`` (P+1), ``cols`` (K, 3) = (b, h, n) grouped by CTA in
execution order, ``visit_ptr`` (K+1) / ``visit_m`` (S) = each column's ordered Q tiles, the
closed-form ``visit_desc`` (K, 6) = (lo, hi, r0, r1, rot, desc) that reproduces ``visit_m``, and
``turn`` (B, H, Mmax, Nmax) int32 (-1 where n does not contribute to m).
"""

from __future__ import annotations

from dataclasses import dataclass
import numpy as np

from dash.schedules.tiling import MASK_CAUSAL, Problem, Tiling, tile_problem

#: Schedules in the order the CLI lists them (and ``rank_schedules`` breaks ties).
SCHEDULE_NAMES: tuple[str, ...] = ("fa3", "interleaved", "descending", "shift", "symmetric_shift", "portable")

#: Reference CTA count from which the portable group size is derived (H100/H200 SXM).
#: It is a constant of the order, not the launch: the order never depends on the real grid.
PORTABLE_REFERENCE_CTAS = 132
#: Largest portable group: a portable order runs on any grid of at least this many CTAs.
PORTABLE_MAX_GROUP = 32

VISIT_ASC, VISIT_DESC, VISIT_CYCLIC, VISIT_RECT = "asc", "desc", "cyclic", "rect"


@dataclass(frozen=True)
class Recipe:
    """How a schedule is assembled (see the module docstring)."""

    items: str  # "single" | "pair"
    reverse: bool  # single items: item k is column N_b - 1 - k (FA3 causal "shortest first")
    dispatch: str  # "roundrobin" | "teams"
    visit: tuple[str, str]  # visit rule of the item's first and second column
    turns: str  # "asc_n" | "desc_n" | "arrival"
    portable: bool  # the turns do not depend on P
    group: int = 0  # teams: group size G
    sections: bool = False  # claim: heads interleaved in L2 sections (see ``claim_rank``)


@dataclass(eq=False)
class Plan:
    """A schedule planned for ``planned_ctas`` CTAs and launched on ``ctas`` CTAs.

    Arrays (see module docstring): ``cta_ptr`` (ctas+1,) int64; ``cols`` (K, 3) int32 with
    ``cols[cta_ptr[x]:cta_ptr[x+1]]`` the ordered (b, h, n) of CTA x; ``col_wave`` (K,) the
    position of the column's item on its CTA; ``visit_desc`` (K, 6); ``visit_ptr`` (K+1,) and
    ``visit_m`` (S,) the ordered Q tiles; ``turn`` (B, H, Mmax, Nmax) int32.
    """

    tiling: Tiling
    schedule: str
    recipe: Recipe
    planned_ctas: int
    ctas: int
    cta_ptr: np.ndarray
    cols: np.ndarray
    col_wave: np.ndarray
    visit_desc: np.ndarray
    visit_ptr: np.ndarray
    visit_m: np.ndarray
    turn: np.ndarray
    section_heads: int = 1  # heads per L2 section of a claimed order (1: column-fastest)

    def __repr__(self) -> str:
        planned = "" if self.planned_ctas == self.ctas else f" (planned for {self.planned_ctas})"
        return (f"Plan({self.schedule!r}, {self.ctas} CTAs{planned}, {len(self.cols)} columns, "
                f"{self.num_steps} steps, portable={self.portable}; {self.tiling.problem.describe()})")

    @property
    def portable(self) -> bool:
        """True when the accumulation order does not depend on the CTA count."""
        return self.recipe.portable

    @property
    def claimed(self) -> bool:
        """True when CTAs claim the columns one by one in claim order (``fa3``, ``interleaved``,
        ``descending``): what ``simulate.replay_claims`` can replay."""
        return self.recipe.dispatch == "claim" and self.recipe.items == "single"

    @property
    def min_ctas(self) -> int:
        """Smallest grid the order can run on (team-dispatched orders need one whole team)."""
        return max(1, self.recipe.group) if self.recipe.dispatch == "teams" else 1

    @property
    def num_steps(self) -> int:
        return int(self.visit_m.shape[0])

    @property
    def step_ptr(self) -> np.ndarray:
        """``(ctas+1,)``: CTA x runs steps ``[step_ptr[x], step_ptr[x+1])`` of ``visit_m``."""
        return self.visit_ptr[self.cta_ptr]

    def work_list(self, x: int) -> list[tuple[int, int, int]]:
        """Ordered (b, h, n) columns of CTA ``x``."""
        return [tuple(int(v) for v in row) for row in self.cols[self.cta_ptr[x]:self.cta_ptr[x + 1]]]

    def column_index(self) -> np.ndarray:
        """``(B, H, Nmax)`` int64: row of each column in ``cols`` (-1 if it does not exist)."""
        t = self.tiling
        idx = np.full((t.batch, t.heads, t.nmax), -1, dtype=np.int64)
        idx[self.cols[:, 0], self.cols[:, 1], self.cols[:, 2]] = np.arange(len(self.cols))
        return idx

    def visit(self, b: int, h: int, n: int) -> np.ndarray:
        """Ordered Q tiles of column (b, h, n)."""
        i = int(self.column_index()[b, h, n])
        if i < 0:
            raise IndexError(f"column (b={b}, h={h}, n={n}) does not exist")
        return self.visit_m[self.visit_ptr[i]:self.visit_ptr[i + 1]]

    def item_sequence(self) -> np.ndarray:
        """``(K, 3)`` (b, h, n) of every column in item order: the order in which a claimed
        schedule's CTAs claim them (``claim_rank``), else the item id ``L`` the static
        dispatch numbers them by. Pairs contribute their first, then their second column."""
        t, rc = self.tiling, self.recipe
        items = _items(t, rc.items, rc.reverse)  # (B, K, 2)
        K = items.shape[1]
        flat = np.arange(t.batch * t.heads * K)
        if rc.dispatch == "claim":
            flat = claim_order(t.batch, t.heads, t.problem.heads_kv, K, self.section_heads)
        head, k = flat // K, flat % K
        b, h = head // t.heads, head % t.heads
        rows = [(int(b[i]), int(h[i]), int(items[b[i], k[i], r])) for i in range(len(flat)) for r in (0, 1)
                if items[b[i], k[i], r] >= 0]
        return np.array(rows, dtype=np.int64).reshape(-1, 3)

    def col_cta(self) -> np.ndarray:
        """``(K,)`` CTA of each row of ``cols``."""
        return np.repeat(np.arange(self.ctas), np.diff(self.cta_ptr))

    def steps(self) -> dict[str, np.ndarray]:
        """Every (column, Q tile) step in execution order, CTA-major; arrays of shape (S,).

        Keys: ``cta``, ``col`` (row of ``cols``), ``b``, ``h``, ``n``, ``m``, ``t`` (position in
        the column's visit), ``turn``.
        """
        lens = np.diff(self.visit_ptr)
        col = np.repeat(np.arange(len(self.cols)), lens)
        t = np.arange(self.num_steps) - np.repeat(self.visit_ptr[:-1], lens)
        b, h, n = (self.cols[col, i].astype(np.int64) for i in range(3))
        m = self.visit_m.astype(np.int64)
        return {"cta": self.col_cta()[col], "col": col, "b": b, "h": h, "n": n, "m": m, "t": t,
                "turn": self.turn[b, h, m, n].astype(np.int64)}

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The arrays a kernel consumes (e.g. ``np.savez(path, **plan.to_arrays())``)."""
        return {"cta_ptr": self.cta_ptr, "cols": self.cols, "visit_ptr": self.visit_ptr,
                "visit_m": self.visit_m, "visit_desc": self.visit_desc, "turn": self.turn}


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------

def _items(tiling: Tiling, kind: str, reverse: bool) -> np.ndarray:
    """``(B, K, 2)`` int64 columns of each item of a head (-1: absent); same for every head."""
    nb = tiling.num_n[:, None]
    if kind == "single":
        k = np.arange(tiling.nmax)[None, :]
        col = np.where(k < nb, nb - 1 - k if reverse else k, -1)
        return np.stack([col, np.full_like(col, -1)], axis=-1)
    if kind != "pair":
        raise ValueError(f"unknown item kind {kind!r}")
    k = np.arange(-(-tiling.nmax // 2))[None, :]
    first = np.where(k < (nb + 1) // 2, k, -1)
    second = np.where(k < nb // 2, nb - 1 - k, -1)
    return np.stack([np.broadcast_to(first, second.shape), second], axis=-1)


#: L2 bytes the heads of one claim section may occupy (32 MiB of the 50 MiB of an H100/H200).
L2_SECTION_BUDGET_BYTES = 32 << 20

#: Under a full mask a section is at most this many claims divided by the Q tiles of a column
#: wide (a power of two): 2 steps of stagger between a head's consecutive columns on the 132
#: CTAs of an H100/H200 SXM (``kSectionStaggerClaims`` in csrc/schedule/schedule.h, which says why).
SECTION_STAGGER_CLAIMS = 2 * 132


def l2_section_heads(seqlen_q: int, head_dim: int, batch_heads: int, full_mask_q_tiles: int = 0) -> int:
    """Heads per L2 section of the interleaved claim order (``l2_section_heads`` in
    csrc/schedule/schedule.h): the largest power of two whose heads' Q, dO (2 bytes each) and
    fp32 dQaccum (8 * seqlen_q * head_dim bytes per head) fit the budget, at most
    ``batch_heads``, at least 1; under a full mask (``full_mask_q_tiles`` = the Q tiles of
    every column, 0 under a causal mask) also at most ``SECTION_STAGGER_CLAIMS //
    full_mask_q_tiles``. A pure function of the shape, never of the grid."""
    per_head = 8 * int(seqlen_q) * int(head_dim)
    cap = max(SECTION_STAGGER_CLAIMS // int(full_mask_q_tiles), 1) if full_mask_q_tiles > 0 else 1 << 30
    w = 1
    while w < batch_heads and 2 * w * per_head <= L2_SECTION_BUDGET_BYTES and 2 * w <= cap:
        w *= 2
    return int(min(w, max(batch_heads, 1)))


def claim_rank(num_heads: int, per_head: int, section_heads: int) -> np.ndarray:
    """Claim position of every item (flat index ``slot * per_head + k``, where ``slot`` is the
    head's place in the claim order, ``head_slots``).

    ``section_heads == 1``: ``L = k + per_head * slot`` (FA3's order, the column fastest).
    Otherwise slots are cut into sections of ``section_heads`` consecutive slots (the last one
    may be narrower); inside a section the slot varies fastest and ``k`` slowest, so
    consecutive items are the same column rank of different heads (FA4's launch order).
    """
    flat = np.arange(num_heads * per_head, dtype=np.int64)
    head, k = flat // per_head, flat % per_head
    sw = max(1, int(section_heads))
    section = head // sw
    width = np.minimum(sw, num_heads - section * sw)
    return section * sw * per_head + k * width + (head - section * sw)


def head_slots(batch: int, heads: int, heads_kv: int) -> np.ndarray:
    """``(batch * heads,)``: the place of head ``b*H + h`` in the claim order.

    Within a batch, query head ``h = kv * G + j`` (``G = heads // heads_kv`` heads per KV
    head) takes slot ``j * heads_kv + kv``: the query heads of one KV group are ``heads_kv``
    slots apart instead of adjacent. They reduce-add into the same dK/dV tiles in a fixed
    order (``j``); adjacent, they would finish a column together and queue on that order.
    With ``G == 1`` (no GQA) slot == head. Twin of ``ClaimedSchedule::column``."""
    g = heads // max(1, heads_kv)
    hd = np.arange(batch * heads, dtype=np.int64)
    b, h = hd // heads, hd % heads
    return b * heads + (h % g) * heads_kv + h // g


def claim_order(batch: int, heads: int, heads_kv: int, per_head: int, section_heads: int) -> np.ndarray:
    """Flat items ``head * per_head + k`` in the order they are claimed."""
    slots = head_slots(batch, heads, heads_kv)
    flat = np.arange(batch * heads * per_head, dtype=np.int64)
    rank = claim_rank(batch * heads, per_head, section_heads)[slots[flat // per_head] * per_head + flat % per_head]
    return np.argsort(rank, kind="stable")


def _claim(lengths: np.ndarray, ctas: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy claiming in item order: CTA and position of each item (list scheduling)."""
    import heapq

    count = len(lengths)
    cta = np.empty(count, dtype=np.int64)
    pos = np.empty(count, dtype=np.int64)
    per_cta = [0] * ctas
    heap = []
    for i in range(count):
        if i < ctas:
            x, load = i, 0
        else:
            load, x = heapq.heappop(heap)
        cta[i], pos[i] = x, per_cta[x]
        per_cta[x] += 1
        # +1: a column costs at least its K/V load even when it has no Q tiles.
        heapq.heappush(heap, (load + int(lengths[i]) + 1, x))
    return cta, pos


def _dispatch(num_heads: int, per_head: int, ctas: int, mode: str, group: int,
              lengths: np.ndarray | None = None, section_heads: int = 1,
              heads_per_batch: int | None = None, heads_kv: int | None = None) -> dict[str, np.ndarray]:
    """CTA, position, epoch and slot of every item, flat index ``head * per_head + k``.
    ``lengths`` (items,): steps per item, used by the ``claim`` dispatch, which claims the
    items in ``claim_order`` (``section_heads``; ``heads_per_batch`` query heads and
    ``heads_kv`` KV heads per batch, default: no GQA)."""
    flat = np.arange(num_heads * per_head, dtype=np.int64)
    head, k = flat // per_head, flat % per_head
    if mode == "claim":
        lens = lengths if lengths is not None else np.ones(len(flat))
        H = heads_per_batch or num_heads
        order = claim_order(num_heads // H, H, heads_kv or H, per_head, section_heads)
        cta, pos = np.empty_like(flat), np.empty_like(flat)
        cta[order], pos[order] = _claim(np.asarray(lens)[order], ctas)
        return {"cta": cta, "pos": pos, "epoch": pos, "slot": np.zeros_like(flat), "head": head}
    if mode == "roundrobin":
        cta, pos = flat % ctas, flat // ctas
        first = np.maximum(0, pos * ctas - head * per_head)  # items of this head in earlier waves
        return {"cta": cta, "pos": pos, "epoch": pos, "slot": k - first, "head": head}
    if mode == "teams":
        if group < 1 or ctas < group:
            raise ValueError(f"this portable order needs at least {group} CTAs (one team), got ctas={ctas}")
        teams = ctas // group
        g, slot = k // group, k % group
        q = head + num_heads * g
        return {"cta": (q % teams) * group + slot, "pos": q // teams, "epoch": g, "slot": slot, "head": head}
    raise ValueError(f"unknown dispatch {mode!r}")


def _visit_desc(lo: np.ndarray, hi: np.ndarray, rule: np.ndarray, rot: np.ndarray,
                r0: np.ndarray, r1: np.ndarray) -> np.ndarray:
    """``(K, 6)`` (lo, hi, r0, r1, rot, desc) per column from its rule code (0 asc .. 3 rect)."""
    out = np.zeros((len(lo), 6), dtype=np.int64)
    out[:, 0], out[:, 1] = lo, hi
    out[:, 2], out[:, 3] = lo, lo
    cyc = rule == 2
    out[cyc, 3] = hi[cyc]
    rect = (rule == 3) & (lo <= r0) & (r0 < r1) & (r1 <= hi)
    out[rect, 2], out[rect, 3] = r0[rect], r1[rect]
    out[cyc | rect, 4] = rot[cyc | rect]
    out[:, 5] = rule == 1
    return out


def expand_visits(desc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ordered Q tiles of every column from its ``(lo, hi, r0, r1, rot, desc)`` descriptor.

    Returns ``visit_ptr`` (K+1,) and ``visit_m`` (S,). Step ``t`` of a column is
    ``hi-1-t`` if ``desc``; else for ``t < R = r1-r0``: ``r0 + (rot + t) mod R``; then the
    tiles ``[lo, r0)`` and ``[r1, hi)`` ascending.
    """
    lo, hi, r0, r1, rot, dsc = (desc[:, i] for i in range(6))
    lens = hi - lo
    ptr = np.zeros(len(desc) + 1, dtype=np.int64)
    np.cumsum(lens, out=ptr[1:])
    col = np.repeat(np.arange(len(desc)), lens)
    t = np.arange(ptr[-1]) - ptr[:-1][col]
    lo, hi, r0, r1, rot, dsc = lo[col], hi[col], r0[col], r1[col], rot[col], dsc[col]
    rs = r1 - r0
    in_rect = t < rs
    m_rect = r0 + (rot + t) % np.maximum(rs, 1)
    t2 = t - rs
    below = r0 - lo
    m_priv = np.where(t2 < below, lo + t2, r1 + t2 - below)
    m = np.where(dsc == 1, hi - 1 - t, np.where(in_rect, m_rect, m_priv))
    return ptr, m.astype(np.int32)


def _fixed_turns(tiling: Tiling, descending: bool) -> np.ndarray:
    """``(B, H, Mmax, Nmax)`` turns ranking the contributors of each tile by column index."""
    contrib = tiling.contributes()
    n = np.arange(tiling.nmax)[None, None, :]
    if descending:
        turn = tiling.row_hi[:, :, None] - 1 - n
    else:
        turn = n - tiling.row_lo[:, :, None]
    turn = np.where(contrib, turn, -1).astype(np.int32)
    return np.broadcast_to(turn[:, None], (tiling.batch, tiling.heads) + turn.shape[1:]).copy()


def rank_within(group: np.ndarray, *keys: np.ndarray) -> np.ndarray:
    """Rank (0, 1, ...) of every element within its ``group``, ordered by ``keys``
    (most significant first); all arrays of shape (S,)."""
    order = np.lexsort(tuple(reversed(keys)) + (group,))
    sg = group[order]
    start = np.ones(len(sg), dtype=bool)
    start[1:] = sg[1:] != sg[:-1]
    first = np.maximum.accumulate(np.where(start, np.arange(len(sg)), 0))
    rank = np.empty(len(sg), dtype=np.int64)
    rank[order] = np.arange(len(sg)) - first
    return rank


def _arrival_turns(tiling: Tiling, b: np.ndarray, h: np.ndarray, m: np.ndarray, n: np.ndarray,
                   keys: tuple[np.ndarray, ...]) -> np.ndarray:
    """Turns ranking the contributions of each tile by ``keys`` (most significant first)."""
    H, M, N = tiling.heads, tiling.mmax, tiling.nmax
    turn = np.full((tiling.batch, H, M, N), -1, dtype=np.int32)
    turn[b, h, m, n] = rank_within((b * H + h) * M + m, *keys)
    return turn


def default_portable_group(tiling: Tiling, items: str) -> int:
    """Group size ``G`` of a portable order: a pure function of the shape, never of the grid.

    Team-dispatched groups of one head should not run concurrently (their group-major turns
    would make the later group wait), so at the reference grid of 132 CTAs the number of
    teams ``132 // G`` should not exceed the number of heads ``B*H``: ``G >= ceil(132 / (B*H))``.
    Among those sizes (at most ``PORTABLE_MAX_GROUP`` and the items per head ``K``), take the one
    needing the fewest rounds ``ceil(B*H*ceil(K/G) / (132 // G))`` on the reference grid,
    the smallest on ties (it runs on more grids: any grid of at least ``G`` CTAs).
    """
    per_head = tiling.nmax if items == "single" else -(-tiling.nmax // 2)
    heads = max(1, tiling.batch * tiling.heads)
    hi = max(1, min(per_head, PORTABLE_MAX_GROUP))
    lo = min(hi, max(1, -(-PORTABLE_REFERENCE_CTAS // heads)))
    best, best_rounds = lo, None
    for g in range(lo, hi + 1):
        teams = max(1, PORTABLE_REFERENCE_CTAS // g)
        rounds = -(-(heads * -(-per_head // g)) // teams)
        if best_rounds is None or rounds < best_rounds:
            best, best_rounds = g, rounds
    return int(best)


# --------------------------------------------------------------------------------------------
# The schedules
# --------------------------------------------------------------------------------------------

def section_heads_for(tiling: Tiling) -> int:
    """``l2_section_heads`` of a tiling (the longest sequence for varlen)."""
    p = tiling.problem
    full_mask_q_tiles = 0 if p.mask == MASK_CAUSAL else tiling.mmax
    return l2_section_heads(max(p.lengths_q, default=0), p.head_dim, p.batch * p.heads_q, full_mask_q_tiles)


def recipe_for(tiling: Tiling, schedule: str, *, portable: bool = False, group: int | None = None) -> Recipe:
    """The ``Recipe`` of a named schedule for this tiling.

    ``fa3``, ``interleaved`` and ``descending`` are claimed and portable (their turns depend on
    (m, n) only). ``portable=True`` turns ``shift`` and ``symmetric_shift`` into their
    team-dispatched, CTA-count-independent variants (``portable`` is ``shift`` for full/local
    masks and ``symmetric_shift`` for causal, with ``portable=True``).
    """
    causal = tiling.problem.mask == MASK_CAUSAL
    if schedule in ("fa3", "interleaved"):
        # FA3's order: causal shortest-first with descending turns, else ascending; claimed
        # column-fastest (fa3) or with heads interleaved in L2 sections (interleaved).
        return Recipe("single", causal, "claim", (VISIT_ASC, VISIT_ASC), "desc_n" if causal else "asc_n", True,
                      sections=schedule == "interleaved")
    if schedule == "descending":
        # The paper's descending Q-tile iteration on the claimed grid: longest column first,
        # Q tiles from the last, ascending turns. Under a causal mask every column starts at
        # the last tile right after its predecessor and, being shorter, absorbs the delay.
        return Recipe("single", False, "claim", (VISIT_DESC, VISIT_DESC), "asc_n", True, sections=True)
    if schedule == "portable":
        schedule, portable = ("symmetric_shift" if causal else "shift"), True
    if schedule == "shift":
        items, visit = "single", (VISIT_CYCLIC, VISIT_CYCLIC)
    elif schedule == "symmetric_shift":
        items, visit = "pair", (VISIT_RECT, VISIT_DESC)
    else:
        raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULE_NAMES)}")
    if not portable:
        return Recipe(items, False, "roundrobin", visit, "arrival", False)
    g = default_portable_group(tiling, items) if group is None else int(group)
    return Recipe(items, False, "teams", visit, "arrival", True, g)


def make_plan(problem: Problem | Tiling, schedule: str, ctas: int, *, portable: bool = False,
              group: int | None = None, launch_ctas: int | None = None,
              section_heads: int | None = None) -> Plan:
    """Plan ``schedule`` for a persistent grid of ``ctas`` CTAs.

    ``launch_ctas`` (default ``ctas``) runs the same order (visits and turns planned for
    ``ctas``) on a grid of a different size, dispatching items by the same rule — what a
    kernel launched with a wrong SM count would do; use it to show why a non-portable order
    must be planned for the grid it runs on. ``section_heads`` overrides the L2 section width
    of the interleaved claim orders (default ``l2_section_heads`` of the shape; ``auto``
    passes the full problem's when it simulates a part of it).
    """
    tiling = problem if isinstance(problem, Tiling) else tile_problem(problem)
    if ctas < 1:
        raise ValueError(f"ctas={ctas} must be >= 1")
    launch = ctas if launch_ctas is None else int(launch_ctas)
    if launch < 1:
        raise ValueError(f"launch_ctas={launch} must be >= 1")
    recipe = recipe_for(tiling, schedule, portable=portable, group=group)
    return _build(tiling, schedule, recipe, ctas, launch, section_heads)


def _build(tiling: Tiling, name: str, rc: Recipe, ctas: int, launch: int, section_heads: int | None = None) -> Plan:
    B, H = tiling.batch, tiling.heads
    items = _items(tiling, rc.items, rc.reverse)  # (B, K, 2)
    K = items.shape[1]
    lengths = None
    if rc.dispatch == "claim":
        bi = np.repeat(np.arange(B), K)
        cols = items.reshape(B * K, 2)
        steps = np.where(cols >= 0, tiling.col_hi[bi[:, None], np.maximum(cols, 0)]
                         - tiling.col_lo[bi[:, None], np.maximum(cols, 0)], 0).sum(axis=1)
        lengths = np.broadcast_to(steps.reshape(B, 1, K), (B, H, K)).reshape(-1)
    sw = (section_heads or section_heads_for(tiling)) if rc.sections else 1
    sw = min(sw, B * H)
    Hk = tiling.problem.heads_kv
    plan_d = _dispatch(B * H, K, ctas, rc.dispatch, rc.group, lengths, sw, H, Hk)
    run_d = plan_d if launch == ctas else _dispatch(B * H, K, launch, rc.dispatch, rc.group, lengths, sw, H, Hk)

    # One row per (item, role) with a column, in execution order: CTA, then position, then role.
    head = plan_d["head"]
    bb, hh = head // H, head % H
    icol = items[bb, np.arange(len(head)) % K] if K else np.zeros((0, 2), np.int64)  # (I, 2)
    item_id = np.repeat(np.arange(len(head)), 2)
    role = np.tile(np.array([0, 1]), len(head))
    n = icol.reshape(-1)
    keep = n >= 0
    item_id, role, n = item_id[keep], role[keep], n[keep]
    order = np.lexsort((role, run_d["pos"][item_id], run_d["cta"][item_id]))
    item_id, role, n = item_id[order], role[order], n[order]
    b, h = bb[item_id], hh[item_id]
    lo, hi = tiling.col_lo[b, n], tiling.col_hi[b, n]
    slot, epoch = plan_d["slot"][item_id], plan_d["epoch"][item_id]

    # Visit descriptors.
    codes = {VISIT_ASC: 0, VISIT_DESC: 1, VISIT_CYCLIC: 2, VISIT_RECT: 3}
    rule = np.where(role == 0, codes[rc.visit[0]], codes[rc.visit[1]])
    r0 = np.zeros(len(n), dtype=np.int64)
    r1 = np.zeros(len(n), dtype=np.int64)
    if VISIT_RECT in rc.visit:
        # The rectangle of a group = the tiles every non-empty long column of the group visits.
        grp = head[item_id] * (int(plan_d["epoch"].max(initial=0)) + 1) + epoch
        uniq, inv = np.unique(grp, return_inverse=True)
        longs = (role == 0) & (hi > lo)
        g_r0 = np.zeros(len(uniq), dtype=np.int64)
        g_r1 = np.full(len(uniq), np.iinfo(np.int64).max, dtype=np.int64)
        np.maximum.at(g_r0, inv[longs], lo[longs])
        np.minimum.at(g_r1, inv[longs], hi[longs])
        r0, r1 = g_r0[inv], g_r1[inv]
    desc = _visit_desc(lo, hi, rule, slot, r0, r1)
    visit_ptr, visit_m = expand_visits(desc)

    # Turns.
    if rc.turns == "arrival":
        lens = hi - lo
        # Step of the item at which the column starts: the second column follows the first.
        tau0 = np.zeros(len(n), dtype=np.int64)
        prev_same_item = np.zeros(len(n), dtype=bool)
        prev_same_item[1:] = item_id[1:] == item_id[:-1]
        tau0[prev_same_item] = lens[np.flatnonzero(prev_same_item) - 1]
        col = np.repeat(np.arange(len(n)), lens)
        tau = np.arange(len(visit_m)) - visit_ptr[:-1][col] + tau0[col]
        turn = _arrival_turns(tiling, b[col], h[col], visit_m.astype(np.int64), n[col],
                              (epoch[col], tau, slot[col]))
    else:
        turn = _fixed_turns(tiling, descending=rc.turns == "desc_n")

    cta = run_d["cta"][item_id]
    cta_ptr = np.zeros(launch + 1, dtype=np.int64)
    np.cumsum(np.bincount(cta, minlength=launch), out=cta_ptr[1:])
    cols = np.stack([b, h, n], axis=1).astype(np.int32)
    return Plan(tiling, name, rc, ctas, launch, cta_ptr, cols, run_d["pos"][item_id].astype(np.int32),
                desc.astype(np.int32), visit_ptr, visit_m, turn, sw)
