"""The brain of ``schedule="auto"``: rank schedules for a shape with the model.

``rank_schedules`` plans and simulates every candidate for the grid the kernel will launch,
drops the ones that cannot run there (deadlock, or a portable order needing more CTAs) and
sorts the rest by makespan; ties go to the earlier name in ``SCHEDULE_NAMES`` so the choice is
deterministic. Results are cached per (problem, ctas, costs, candidates, depth, portable).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable, NamedTuple

from dash.config import PORTABLE_KERNEL_SCHEDULES, shift_lanes
from dash.schedules.orders import PORTABLE_REFERENCE_CTAS, SCHEDULE_NAMES, make_plan
from dash.schedules.simulate import Costs, replay_claims, simulate
from dash.schedules.tiling import Problem


def rank_schedules(problem: Problem, ctas: int, costs: Costs | None = None,
                   candidates: Iterable[str] | None = None, *, depth: int = 1,
                   require_portable: bool = False) -> list[tuple[str, float]]:
    """``[(name, makespan), ...]`` fastest first, for the schedules that can run on ``ctas``.

    ``require_portable`` keeps only orders whose bits do not depend on the CTA count.
    """
    cands = tuple(SCHEDULE_NAMES if candidates is None else candidates)
    for name in cands:
        if name not in SCHEDULE_NAMES:
            raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULE_NAMES)}")
    return list(_rank(problem, int(ctas), costs or Costs(), cands, int(depth), bool(require_portable)))


@lru_cache(maxsize=256)
def _rank(problem: Problem, ctas: int, costs: Costs, cands: tuple[str, ...], depth: int,
          require_portable: bool) -> tuple[tuple[str, float], ...]:
    rows = []
    for name in cands:
        try:
            plan = make_plan(problem, name, ctas)
        except ValueError:
            continue  # e.g. a portable order whose team does not fit on this grid
        if require_portable and not plan.portable:
            continue
        res = simulate(plan, costs, depth)
        if res.deadlock_free:
            rows.append((name, float(res.makespan)))
    order = {n: i for i, n in enumerate(SCHEDULE_NAMES)}
    rows.sort(key=lambda r: (r[1], order[r[0]]))
    return tuple(rows)


def choose_schedule(problem: Problem, ctas: int, costs: Costs | None = None,
                    candidates: Iterable[str] | None = None, **kw) -> str:
    """The fastest schedule by the model (see ``rank_schedules``); ``fa3`` if none qualifies."""
    ranked = rank_schedules(problem, ctas, costs, candidates, **kw)
    return ranked[0][0] if ranked else "fa3"


def portability_cost(problem: Problem, ctas: int, costs: Costs | None = None, *, depth: int = 1) -> dict:
    """What bit-identical results across GPUs cost on this shape and grid.

    Returns ``{"best", "best_makespan", "best_portable", "portable_makespan", "slowdown"}``,
    ``slowdown = portable_makespan / best_makespan`` (1.0: portability is free).
    """
    allr = rank_schedules(problem, ctas, costs, depth=depth)
    port = rank_schedules(problem, ctas, costs, depth=depth, require_portable=True)
    best, bm = allr[0]
    pb, pm = port[0]
    return {"best": best, "best_makespan": bm, "best_portable": pb, "portable_makespan": pm,
            "slowdown": pm / bm if bm > 0 else 1.0}


# --------------------------------------------------------------------------------------------
# schedule="auto" at call time
# --------------------------------------------------------------------------------------------

# auto picks among dash.config.PORTABLE_KERNEL_SCHEDULES, whose bits do not depend on the CTA
# count, so that auto gives the same bits on every Hopper part and with any sm_margin.

#: Model costs per (head dim, causal), in microseconds, fitted to traces of the kernel
#: (``python -m dash trace``, ``TraceResult.fit_costs``) on an H200, 2026-11-30, at the kernel
#: with two dQ writers: hdim 64 from full 2k (b8 h32, interleaved), hdim 128 from full 4k
#: (b4 h16, fa3) and causal 8k (b2 h16, descending), which fitted the same costs. With them
#: the model's makespan was within 1 % (hdim 64) and 6 % (hdim 128) of the measured one
#: (benchmarks/results/traces/). hdim 128 full re-fitted for its 80-row Q tiles (2026-12-01,
#: full 4k, b4 h16, fa3 order, deterministic:
#: benchmarks/results/traces/2026-12-01-NVIDIA-H200-hd128-full-4k-fa3-m80.json; the model's
#: makespan 2732 µs against 2422 measured). Shapes not listed use DEFAULT_KERNEL_COSTS.
KERNEL_COSTS: dict[tuple[int, bool], Costs] = {
    (64, False): Costs(c=2.304, r=1.28, latency=1.28, epilogue=2.048),
    (64, True): Costs(c=2.304, r=1.28, latency=1.28, epilogue=2.048),
    (128, False): Costs(c=2.56, r=1.28, latency=1.28, epilogue=2.56),
    (128, True): Costs(c=2.048, r=1.152, latency=1.152, epilogue=3.328),
}
DEFAULT_KERNEL_COSTS = KERNEL_COSTS[(128, True)]

#: Deterministic ``auto``'s candidates under a causal mask: the portable schedules less
#: ``interleaved``. Since the kernel's causal dQ chains (4dbe825) the interleaved claim order
#: (shortest columns first, heads interleaved in L2 sections) was the slowest of the three
#: portable schedules on every causal row measured on the H200: 4 paper grids and 6 GQA/MQA rows
#: (54 rows: b042933, c5e0c94 twice, 3bce661; 0.84-0.98 of the fastest, hdim 128 causal 2k
#: 0.84-0.86), while the model ranks it level with or ahead of ``fa3``'s order, which differs
#: from it only in the claim order. The model has no term for what makes that claim order
#: slow (an LRU model of the L2 did not reproduce it: docs/scheduling-model.md, Calibration),
#: so ``auto`` does not offer it there; it stays available as ``schedule="interleaved"``.
#: Full masks keep all three. ``tools/model_agreement.py`` checks the choice against every
#: stored run.
CAUSAL_KERNEL_CANDIDATES: tuple[str, ...] = tuple(s for s in PORTABLE_KERNEL_SCHEDULES if s != "interleaved")


def kernel_candidates(causal: bool) -> tuple[str, ...]:
    """The schedules deterministic ``auto`` ranks for a mask (``CAUSAL_KERNEL_CANDIDATES``)."""
    return CAUSAL_KERNEL_CANDIDATES if causal else PORTABLE_KERNEL_SCHEDULES


#: ``auto`` simulates at most this many waves of columns of the grid, keeping the full
#: problem's L2 sections. 3 waves (the first choice) over-weighted the start-up, where
#: ``descending`` shines, against the tail: on the H200 grid plus 6 GQA/MQA rows (30 rows,
#: benchmarks/results/2026-11-30-NVIDIA-H200-bwd-fa3.json and the GQA log), auto named the
#: measured-best schedule on 6 rows and was > 3 % slower than it on 4 (GQA 32/8 causal 4k-16k,
#: MQA 8/1); with 10 waves, 12 rows and 2 (hdim 128 causal 512: 0.954, MQA 8/1 causal 8k:
#: 0.949). A choice then costs up to about 0.6 s of host time (hdim 128 full 16k), once per shape (cached).
AUTO_MAX_WAVES = 10


def kernel_costs(head_dim: int, causal: bool) -> Costs:
    """The calibrated model costs of the kernel for a head dim and mask."""
    return KERNEL_COSTS.get((int(head_dim), bool(causal)), DEFAULT_KERNEL_COSTS)


def _kernel_table_value(head_dim: int, causal: bool, field: str) -> int:
    """A field of the backward's config table for a head dim and mask; 1 for an unlisted one."""
    from dash.config import bwd_tile_config

    try:
        return int(getattr(bwd_tile_config(int(head_dim), bool(causal)), field))
    except NotImplementedError:
        return 1


def kernel_dq_chains(head_dim: int, causal: bool) -> int:
    """Accumulation chains per dQ tile of the kernel's deterministic mode (``dq_chains`` of the
    config table; ``simulate(..., chains=)``)."""
    return _kernel_table_value(head_dim, causal, "dq_chains")


def kernel_dkv_ordered(head_dim: int, causal: bool, group: int, deterministic: bool = True) -> bool:
    """Whether the kernel sums a GQA group's dK/dV in ordered chains: always when deterministic,
    otherwise for groups of at most ``nondet_dkv_chains_max_group`` query heads (config table);
    False without GQA (twin of ``dkv_ordered_for`` in csrc/kernels/bwd_params.h)."""
    if group < 2:
        return False
    return deterministic or group <= _kernel_table_value(head_dim, causal, "nondet_dkv_chains_max_group")


def kernel_dkv_chains(head_dim: int, causal: bool, group: int, deterministic: bool = True) -> int:
    """GQA dK/dV accumulation chains of the kernel for ``group`` query heads per KV head:
    ``dkv_chains`` of the config table, at most ``group - 1``, where the sum is ordered
    (``kernel_dkv_ordered``); 1 otherwise (``simulate(..., kv_chains=)``; twin of
    ``dkv_chains_for`` in csrc/kernels/bwd_params.h)."""
    if not kernel_dkv_ordered(head_dim, causal, group, deterministic):
        return 1
    return max(1, min(_kernel_table_value(head_dim, causal, "dkv_chains"), group - 1))


def kernel_pipeline_depth(head_dim: int, causal: bool) -> int:
    """How many steps the kernel's MMA warpgroups may run ahead of the dQ reduce-adds: its
    dQ staging buffers (``dq_stages`` of the config table; the model's ``depth``)."""
    return _kernel_table_value(head_dim, causal, "dq_stages")


#: Bytes per µs at which the dQ convert kernel reads the fp32 dQ chains and writes dQ: it runs at
#: HBM bandwidth, 3.8-3.9 TB/s on the H200 (ninth pass of docs/kernel-notes.md: 50-54 µs with one
#: chain, ~84 µs with two at 16k tokens x 2048 channels). A constant, not this GPU's: ``auto``'s
#: choice must be a function of the shape alone.
DQ_CONVERT_BYTES_PER_US = 3.8e6


def dq_convert_us(batch: int, heads: int, seqlen_q: int, head_dim: int, chains: int) -> float:
    """Time of the dQ convert kernel alone on the whole GPU: it reads ``chains`` fp32 copies of
    dQ and writes dQ in 16 bits."""
    return batch * heads * seqlen_q * head_dim * (4 * chains + 2) / DQ_CONVERT_BYTES_PER_US


def end_with_dq_convert(makespan: float, cta_last, convert_us: float) -> float:
    """When the backward ends: the main kernel's ``makespan`` plus the part of the dQ convert
    that its tail cannot absorb. Since 5e5dae1 the convert is launched under the main kernel
    (programmatic dependent launch) and its CTAs take each SM the main kernel's CTAs leave;
    by the tail nearly every dQ tile is complete, so the tail's idle CTA time (sum over CTAs
    of makespan - the CTA's last activity ``cta_last``, per CTA of the grid) converts tiles,
    and only the remainder of ``convert_us`` runs after the makespan. That favours orders with
    ragged tails (``fa3``'s shortest-columns-first claims end on the longest columns) over
    balanced ones (``descending``'s longest-first): measured on the H200 in two grids of
    5e5dae1, fa3 / descending time at hdim 64 causal 2k / 4k / 8k 0.958 / 0.972 / 0.985, where
    the makespan alone ranks descending first by 3-7 %
    (benchmarks/results/2026-12-03-NVIDIA-H200-bwd-schedules-5e5dae1.json)."""
    import numpy as np

    last = np.asarray(cta_last, dtype=np.float64)
    idle_tail = float(np.clip(makespan - last, 0.0, None).sum()) / max(len(last), 1)
    return float(makespan) + max(0.0, convert_us - idle_tail)


#: Who wins an exact tie of the model's ends. Under a full mask ``interleaved`` and
#: ``descending`` are mirror images and always tie; where the grid divides a full-mask problem
#: evenly (hdim 128 full 16k: 2048 columns on 128 CTAs) ``fa3`` ties them too. Measured on the
#: H200 over the 18 stored grids of that row, interleaved was fastest or within ~1 % of the
#: fastest most often (fa3 / best 0.966-1.0, interleaved 0.97-1.0, descending 0.91-1.0);
#: ``interleaved`` starts the CTAs of one wave on different dQ tiles, so their reduce-adds
#: do not queue on one semaphore. The paper grid's one causal tie (hdim 64 causal 512,
#: ``descending`` and ``fa3``) is a short causal row: ``SHORT_CAUSAL_FA3_MAX_SEQLEN`` decides it.
#: Across all 444 stored rows this order, against ``PORTABLE_KERNEL_SCHEDULES``', takes auto
#: within 1 % of the measured best on 343 rows instead of 339 (``tools/model_agreement.py``).
AUTO_TIE_ORDER: tuple[str, ...] = ("interleaved", "descending", "fa3")

# Claims in simulated time (``replay_claims``), not the plans' static dispatch. The plans
# hand claimed columns their CTAs as if every CTA finished its column at the same instant, so
# under a full mask the columns of a head start together in every wave whatever the claim
# order, and ``fa3``'s and ``interleaved``'s orders (same visits, same turns; only the claim
# order differs) priced within 1 % of each other on short hdim-128 full rows, where measured
# runs put ``interleaved`` ahead: at 512 (b32 h16) by 2.0-3.1 % in the four H100 runs since the
# full-mask section cap (60a6cd0), 3.7-3.9 % on the H200 before it; at 768 (b21 h16) by 10.5 %
# (...-bwd-short-full-near-tie.json). In the kernel a CTA claims when its column ends: once
# turn waits spread the finishing times, ``fa3``'s back-to-back claims start a head's columns
# a fraction of a step apart and they queue on each dQ tile, while ``interleaved``'s start
# them ``section_heads`` claims apart. Replayed, ``interleaved`` / ``fa3`` comes out at 0.917 /
# 0.893 / 0.868 / 0.858 / 0.868 / 0.943 / 1.000 for full 512 … 16k (measured on the H100 0.974,
# 0.905, 0.876, 0.867, 0.879, 0.929, 0.991: within 1.5 % from 768 on); under a causal mask the
# length-ordered claims are spread already and the replay moves nothing. Until 2026-12-06 a
# 1 % near-tie margin under full masks stood in for it (``AUTO_FULL_MASK_NEAR_TIE``); over
# the 722 stored rows (``tools/model_agreement.py``) the replay picks what the margin picked
# on every row (auto within 1 % of the measured best on 578 rows, within 3 % on 648) and ranks
# the measured best first on 570 rows instead of 553. Its one known miss: full 256 (b64 h16),
# replay ``interleaved`` ahead by 2.9 %, measured ``fa3`` ahead by 4.7 % (two columns per head:
# the waits the replay prices are hidden there in the kernel).


#: Deterministic causal rows with at most this many queries and keys run ``fa3``'s order
#: (shortest columns first, column-fastest claims) without asking the model. There the model
#: ranks ``descending`` first (by 5-7 % at hdim 64 512 / 1k) but every H200 grid measured
#: ``fa3`` fastest at hdim 64 causal 512 and 1k: by 1.1-2.1 % on the kernels of c4e1886 and
#: 5a6888e, by 6.0-6.4 % since the column-overhead change 790b8cf
#: (benchmarks/results/2026-12-01-NVIDIA-H200-bwd-fa3-fa4-790b8cf.json); at hdim 128 causal
#: 512 / 1k ``fa3`` was the fastest or within 0.8 % of it. Traces of 790b8cf at hdim 64 causal
#: 1k (benchmarks/results/traces/*-790b8cf.json) show where: the same kernel's steps cost
#: 2.56 µs in ``descending``'s order and 2.30 µs in ``fa3``'s (fitted per trace), while the
#: model prices a step the same under every order; what makes the steps of short columns
#: visited from the last tile dearer (the L2-section claims? every column's first add landing
#: on the same dQ tile?) is not modelled. A function of the shape only: the bits stay the
#: same on every grid.
SHORT_CAUSAL_FA3_MAX_SEQLEN = 1024

#: The grid deterministic ``auto`` ranks for, whatever grid the kernel is launched on: the
#: choice must be a function of the shape alone. Each portable schedule's bits are the same
#: on any grid, but two schedules' bits differ (other Q-tile and add orders), so a choice
#: ranked for the real grid would change the bits with the GPU's SM count or ``sm_margin``
#: (at hdim 64 causal 1152, b2, 16 query and 4 KV heads, the model picks ``descending`` on 132
#: CTAs and ``fa3`` on 131). 132 is the H100/H200 SXM grid (``PORTABLE_REFERENCE_CTAS``).
AUTO_REFERENCE_CTAS = PORTABLE_REFERENCE_CTAS


@lru_cache(maxsize=1024)
def choose_kernel_schedule(batch: int, heads: int, heads_kv: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                           causal: bool, ctas: int, deterministic: bool = True) -> str:
    """``schedule="auto"``: the portable kernel schedule the calibrated model finds fastest.

    Deterministic: short causal rows (``SHORT_CAUSAL_FA3_MAX_SEQLEN``) take ``fa3``'s order;
    otherwise ranks ``kernel_candidates(causal)`` (ties: ``AUTO_TIE_ORDER``) for a grid of
    ``AUTO_REFERENCE_CTAS`` CTAs whatever ``ctas`` is, so that the choice, and with it the
    bits, are the same on every Hopper part and with any ``sm_margin``; on at most
    ``AUTO_MAX_WAVES`` waves of the grid's columns, with the full problem's L2 sections, the
    kernel's dQ accumulation chains and pipeline depth (``kernel_dq_chains``), the claims
    replayed in simulated time (``replay_claims``). Cached per shape, so training loops pay it
    once per shape (up to about 0.6 s at 16k tokens).

    Without determinism the turns are unused and the model, which prices turn waits, has
    nothing to rank; the order only has to balance the grid and keep concurrent reduce-adds
    apart. The rule (``nondeterministic_kernel_schedule``) is measured, not modelled:
    causal masks get the longest columns of all heads of an L2 section first (the tail is
    short columns), ``descending``'s order (Q tiles from the last) from 2048 queries on, below
    that ``interleaved``'s (Q tiles from the diagonal) at hdim 128 and the fa3 order at hdim 64;
    full masks get the fa3 order, except hdim 128 from 16384 queries, where ``shift`` (staggered
    start tiles, so that no two running columns of a head reduce-add into one dQ tile at once)
    runs where it can. Shift's bits depend on the grid, which does not matter without
    determinism. Measured, see the comment above ``NONDET_CAUSAL_DESCENDING_MIN_SEQLEN``.
    """
    if not deterministic:
        return nondeterministic_kernel_schedule(seqlen_q, seqlen_k, head_dim, causal, ctas)
    if causal and max(seqlen_q, seqlen_k) <= SHORT_CAUSAL_FA3_MAX_SEQLEN:
        return "fa3"
    ranked = rank_kernel_schedules(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, causal, AUTO_REFERENCE_CTAS)
    if not ranked:
        return "fa3"
    return ranked[0][0]


#: Where non-deterministic ``auto``'s rule comes from (benchmarks/bench_bwd.py with the opt-in
#: ``dash_nondet_<schedule>`` modes, rotated rounds in one process; throughput ratios).
#: 2026-12-06, kernels of 74b8ae5, H100 SXM two runs
#: (benchmarks/results/logs/2026-12-06-NVIDIA-H100-80GB-HBM3-nondet-order-{full,causal}.log) and
#: the H200 grid of that day (benchmarks/results/2026-12-06-NVIDIA-H200-bwd.json, its dash_nondet
#: = shift and dash_nondet_fa3 columns): fa3 order / shift, full masks:
#: hdim 64 512-16k 1.014-1.037 (no row below), hdim 128 512 1.090-1.094, 1k-8k 1.006-1.041, but
#: 16k 0.964 / 0.982 / 0.994 / 1.012 (shift ahead in three of four runs: a coin flip within the
#: 16k rows' noise; kept where it was). Causal, fa3 order / interleaved:
#: hdim 64 512 1.030, 1k 1.058 (both runs); hdim 128 512 / 1k 0.986-0.992. Descending /
#: interleaved from 2k: 0.991-1.024 (below 1 only at 2k: 0.991-0.995). Before: 2026-11-30 on
#: the H200 (kernels of a0464c6), shift / fa3 order 1.003-1.058 on every full row 1k-16k; the
#: backward has changed since (80-row hdim-128 full tile, per-warpgroup dQ release, LSE loads),
#: and so did the ranking. All of these were timed with the cyclic round order (before d1b90e7,
#: bench.round_orders), which keeps each mode behind one neighbour; the lists of modes differed
#: between the H100 runs and the H200 grid (other neighbours) and gave the same ranking, except
#: at hdim 128 full 16k. The 2048 threshold is the earlier runs'; at 2k interleaved's order was
#: 0.5-0.9 % ahead of descending's in these runs (4k-16k: descending 0.7-2.4 % ahead).
#: Non-deterministic ``auto`` under a causal mask: ``descending`` from this many queries on.
NONDET_CAUSAL_DESCENDING_MIN_SEQLEN = 2048
#: Non-deterministic ``auto`` under a full mask at hdim 128: ``shift`` (where it runs) from
#: this many queries on, the fa3 order below (and at hdim 64 always).
NONDET_FULL_SHIFT_MIN_SEQLEN_HDIM128 = 16384


def nondeterministic_kernel_schedule(seqlen_q, seqlen_k, head_dim: int, causal: bool, ctas: int) -> str:
    """Non-deterministic ``auto`` (the measured rule of ``choose_kernel_schedule``). Only size
    comparisons: traced by torch.compile on symbolic sizes it adds guards on size ranges
    instead of one graph per shape. ``head_dim > 64`` stands for hdim 128, the only other head dim
    built (SUPPORTED_HEAD_DIMS); a new head dim needs its own measurements here."""
    if causal:
        if seqlen_q >= NONDET_CAUSAL_DESCENDING_MIN_SEQLEN:
            return "descending"
        return "interleaved" if head_dim > 64 else "fa3"
    if head_dim > 64 and seqlen_q >= NONDET_FULL_SHIFT_MIN_SEQLEN_HDIM128:
        lanes, q_tiles = shift_lanes(seqlen_q, seqlen_k, head_dim, ctas)
        if lanes <= q_tiles:
            return "shift"
    return "fa3"


class AutoSimulation(NamedTuple):
    """What deterministic ``auto`` simulates for a shape (``auto_simulation``)."""

    part: Problem  # whole KV groups, at most AUTO_MAX_WAVES waves of the grid's columns
    section_heads: int  # the full problem's L2 section width
    costs: Costs
    depth: int  # dQ staging buffers (kernel_pipeline_depth)
    chains: int  # dQ accumulation chains (kernel_dq_chains)
    kv_chains: int  # GQA dK/dV chains (kernel_dkv_chains)
    convert_us: float  # the whole problem's dQ convert (dq_convert_us)


def auto_simulation(batch: int, heads: int, heads_kv: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    causal: bool, ctas: int) -> AutoSimulation:
    """The part of a problem ``rank_kernel_schedules`` simulates for a grid of ``ctas`` CTAs and
    the kernel's parameters it simulates it with."""
    from dash.schedules.orders import l2_section_heads

    full = Problem(batch, heads, seqlen_q, seqlen_k, head_dim=head_dim, heads_kv=heads_kv, causal=causal)
    bm, bn = full.tile_shape
    cols_per_head = -(-seqlen_k // bn)
    group = heads // heads_kv
    # Keep whole KV groups; enough heads for AUTO_MAX_WAVES waves of the grid.
    want_heads = max(1, -(-AUTO_MAX_WAVES * ctas // max(cols_per_head, 1)))
    want_heads = -(-want_heads // group) * group
    part_heads = min(heads, want_heads)
    part_batch = min(batch, max(1, -(-want_heads // heads)))
    part = Problem(part_batch, part_heads, seqlen_q, seqlen_k, head_dim=head_dim,
                   heads_kv=part_heads // group, causal=causal)
    chains = kernel_dq_chains(head_dim, causal)
    return AutoSimulation(
        part=part,
        section_heads=l2_section_heads(seqlen_q, head_dim, batch * heads, 0 if causal else -(-seqlen_q // bm)),
        costs=kernel_costs(head_dim, causal), depth=kernel_pipeline_depth(head_dim, causal), chains=chains,
        kv_chains=kernel_dkv_chains(head_dim, causal, group),
        convert_us=dq_convert_us(batch, heads, seqlen_q, head_dim, chains))  # the whole problem's


@lru_cache(maxsize=256)
def rank_kernel_schedules(batch: int, heads: int, heads_kv: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                          causal: bool, ctas: int) -> tuple[tuple[str, float], ...]:
    """What deterministic ``auto`` ranks: ``((name, end), ...)`` fastest first (ties: the
    earlier name in ``AUTO_TIE_ORDER``) over ``kernel_candidates(causal)``, each replayed for
    a grid of ``ctas`` CTAs with claims in simulated time (``replay_claims``) on at most
    ``AUTO_MAX_WAVES`` waves of the grid's columns (whole KV groups, the full problem's L2
    sections) with the kernel's calibrated costs, dQ and dK/dV chains and pipeline depth
    (``auto_simulation``); ``end`` is the makespan plus what of the whole problem's dQ convert
    the replayed tail does not absorb (``end_with_dq_convert``). ``auto`` calls it with
    ``AUTO_REFERENCE_CTAS``; other grids show what it would pick were it free to depend on the
    grid."""
    sim = auto_simulation(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, causal, ctas)
    order = {n: i for i, n in enumerate(AUTO_TIE_ORDER)}
    rows = []
    for name in kernel_candidates(causal):
        plan = make_plan(sim.part, name, ctas, section_heads=sim.section_heads)
        try:
            rep = replay_claims(plan, sim.costs, sim.depth, chains=sim.chains, kv_chains=sim.kv_chains)
        except RuntimeError:  # a wait on a later claim: cannot happen for these orders (tested); never rank it
            continue
        rows.append((name, round(end_with_dq_convert(rep.makespan, rep.cta_last, sim.convert_us), 9)))
    rows.sort(key=lambda r: (r[1], order[r[0]]))
    return tuple(rows)
