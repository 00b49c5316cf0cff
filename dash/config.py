"""The one tile-configuration table of DASH's attention kernels (forward and backward).

This module is the single source of truth for tile shapes and pipeline depths.
It drives three consumers:

* the kernels, through a C++ header rendered from this table at build time
  (``render_cpp_header``; ``setup.py`` and ``tools/check_kernels.py`` write it to
  ``csrc/generated/tile_config.h``, which is never edited or committed);
* the host launch layer (workspace sizes, grid sizes) through that same header;
* Python: the scheduling model tiles problems with exactly these block sizes.

Tuning history (what was tried, what it measured) lives in ``docs/kernel-notes.md``,
not as commented-out alternatives here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Iterable

#: Head dims the backward kernel has a configuration for. Other head dims are
#: rejected by the API with a "not supported yet" error.
SUPPORTED_HEAD_DIMS: tuple[int, ...] = (64, 128)
#: Element types of q, k, v, o, do, and of dq, dk, dv.
SUPPORTED_DTYPES: tuple[str, ...] = ("bfloat16", "float16")
#: Schedules the backward kernel implements, in the order of BwdScheduleKind in
#: csrc/schedule/schedule.h (tests/test_kernel_schedule_matches_model.py numbers them so).
KERNEL_SCHEDULES: tuple[str, ...] = ("fa3", "interleaved", "descending", "shift")
#: The kernel schedules whose bits do not depend on the number of CTAs; schedule="auto"
#: picks among these.
PORTABLE_KERNEL_SCHEDULES: tuple[str, ...] = ("fa3", "interleaved", "descending")


@dataclass(frozen=True)
class BwdTileConfig:
    """Tiling of the backward main kernel for one (head dim, mask) pair.

    A *column* is one KV tile of ``block_n`` keys of one (batch, head); a *Q tile*
    is ``block_m`` query rows. Each MMA warpgroup owns 64 of the column's keys
    (S^T, dP^T, dK, dV are computed keys-major), so ``block_n == 64 * mma_warpgroups``.
    """

    head_dim: int
    causal: bool
    block_m: int  # kBlockM: query rows per Q tile
    block_n: int  # kBlockN: key rows per column
    mma_warpgroups: int  # consumer warpgroups (each 128 threads); +1 producer warpgroup
    q_stages: int  # smem buffers of Q (+ its LSE) in flight
    do_stages: int  # smem buffers of dO (+ its D = rowsum(dO*O)) in flight
    ds_stages: int  # smem buffers of dS (A operand of the dQ GEMM)
    dq_stages: int = 1  # fp32 dQ partial staging buffers (1, or 2: one per dQ writer; see docs/kernel-notes.md)
    # Deterministic mode: independent accumulation chains per dQ tile. The contribution with
    # turn t is add t // dq_chains of chain t % dq_chains (its own fp32 copy of the tile and
    # its own semaphore); the convert kernel sums the chains in index order. Turns depend on
    # (m, n) only, so the bits stay independent of the CTA count; a contribution waits for
    # turn t - dq_chains instead of t - 1. Costs (dq_chains - 1) more fp32 dQ workspaces.
    dq_chains: int = 1
    # Every exp2_fma_every-th exponential of a step's P = exp2(S * scale - LSE) (by register
    # index, a fixed pattern) is computed on the FMA pipe (a polynomial, detail::exp2_fma)
    # instead of MUFU; 0: all on MUFU. MUFU issues a warp's exponential in 8 cycles, so a
    # step's 64 (hdim 64) exponentials per thread queue behind the S^T GEMM while the FMA pipe
    # idles. Measured on the H200 (docs/kernel-notes.md, eleventh pass): every 4th, backward
    # +2.1 % non-det, +1.9 % det (hdim 64 full det 8k +6.3 %); every 2nd -1.4 %. Thirteenth pass,
    # against every 4th: every 3rd -1.5 % non-det, -0.6 % det; every 6th at hdim 64 +0.0 to +1.6 %
    # non-det, +1.2 to +3.2 % det, at hdim 128 full -2.7 to -4.5 % non-det (so hdim 128 keeps 4).
    exp2_fma_every: int = 0
    # Non-deterministic launches run a mainloop that loads a step's LSE into registers before
    # its S^T GEMM is issued (BwdMainKernel's kLseEarly), instead of reading it from shared
    # memory after the S^T wait. Measured on the H200 at hdim 128 causal (docs/kernel-notes.md,
    # sixteenth and seventeenth passes): non-det +0.6 to +1.9 % in A/Bs, +1.3 to +1.8 % in the
    # grid. Needs 64-row Q tiles: block_m / 4 LSE values per thread, and 20 or 32 of them spill
    # (ninth pass).
    lse_early_nondet: bool = False
    # The same for deterministic launches. With one dQ staging buffer the early loads cost the
    # deterministic mode 1.6 to 4.6 % (its MMA warps then wait longer for the dQ writer to free
    # the buffer, ncu, seventeenth pass); with two (dq_stages = 2) the pair measured +0.3 to
    # +2.5 % deterministic and -0.4 to +2.8 % non-deterministic at hdim 128 causal 2k-16k
    # against one buffer and the late loads (eighteenth pass).
    lse_early_det: bool = False
    # Deterministic GQA: accumulation chains of a KV group's dK / dV (csrc/kernels/bwd_epilogue.h,
    # store_dkv). Query heads j = 0 ... G - 2 of the group add into chain j % C (C = min(dkv_chains,
    # G - 1) fp32 copies of dK / dV, the first add of each a store), and head G - 1 adds the chains
    # to its own in index order and writes dK / dV. A head waits for head j - C instead of j - 1.
    # Measured at hdim 128 on the H100 (docs/kernel-notes.md, thirty-fifth pass), det(auto)
    # against the one ordered accumulator before: 2 chains +1.9 to +9.2 % on the GQA/MQA rows
    # (32/8 causal 8k +3.4 %); 1 chain +1.5 to +9.4 % (better at 6/1, worse at 8/1); 4 chains
    # -6 % at 6/1 (the last head reads every chain).
    dkv_chains: int = 2
    # Non-deterministic GQA with at most this many query heads per KV head sums dK / dV in the
    # same ordered chains (no zero-filled accumulator, no casts after the kernel; dQ stays
    # unordered); larger groups add into one zeroed fp32 accumulator that the binding casts.
    # Measured on the H100 (docs/kernel-notes.md, thirty-sixth pass), chains / adds + casts,
    # non-deterministic kernel alone: G = 2 +4.9 to +13.1 %, G = 4 -1.9 to +5.3 % (causal 4k
    # +5 %, 8k-16k -2 to +1 %), G = 6 and 8 -4 to -24 % (the group's heads queue on the chains).
    nondet_dkv_chains_max_group: int = 4
    note: str = ""

    def __post_init__(self) -> None:
        for field in ("lse_early_nondet", "lse_early_det"):
            if getattr(self, field) and self.block_m != 64:
                raise ValueError(f"{field} needs block_m=64 (block_m / 4 LSE values per thread in "
                                 f"registers), not block_m={self.block_m}")
        if self.block_n != 64 * self.mma_warpgroups:
            raise ValueError(f"block_n={self.block_n} must be 64 * mma_warpgroups={self.mma_warpgroups}")
        if self.block_m % 16 != 0:
            raise ValueError(f"block_m={self.block_m} must be a multiple of 16 (the K step of the dK/dV WGMMAs)")
        if self.block_m % 64 != 0 and self.mma_warpgroups * 64 != self.head_dim:
            raise ValueError(f"block_m={self.block_m} is not a multiple of 64, so dQ is computed transposed "
                             f"(dQ^T = K^T dS^T), which splits head_dim={self.head_dim} over the "
                             f"mma_warpgroups={self.mma_warpgroups}: needs head_dim == 64 * mma_warpgroups")
        if self.head_dim % 64 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be a multiple of 64 (128-byte swizzle rows)")
        if self.dq_stages not in (1, 2):
            raise ValueError(f"dq_stages={self.dq_stages} must be 1 or 2 (the dQ writers alternate by step parity)")
        if self.dq_chains not in (1, 2, 4):
            raise ValueError(f"dq_chains={self.dq_chains} must be 1, 2 or 4")
        if not 1 <= self.dkv_chains <= 8:
            raise ValueError(f"dkv_chains={self.dkv_chains} must be 1 ... 8")
        if self.nondet_dkv_chains_max_group < 1:
            raise ValueError(f"nondet_dkv_chains_max_group={self.nondet_dkv_chains_max_group} must be >= 1 "
                             "(1: never, no GQA group is that small)")
        if self.exp2_fma_every == 1 or self.exp2_fma_every < 0:
            raise ValueError(f"exp2_fma_every={self.exp2_fma_every} must be 0 (all on MUFU) or >= 2")

    @property
    def dq_split_rows(self) -> bool:
        """How the dQ = dS K GEMM is split over the MMA warpgroups.

        True: each warpgroup computes 64 query rows times the whole head dim
        (needs block_m == 64 * mma_warpgroups). False: each warpgroup computes all
        block_m rows times head_dim / mma_warpgroups columns.
        """
        return self.block_m == 64 * self.mma_warpgroups

    @property
    def dq_transposed(self) -> bool:
        """Whether dQ is computed transposed, dQ^T = K^T dS^T (FA3's dQ_swapAB).

        A WGMMA's M side is 64 rows per warpgroup, so a Q tile of a block_m that is not a
        multiple of 64 (80 at hdim 128, as FA3's full-mask tile) cannot be the M side of the
        dQ GEMM; the head dim takes it instead (64 per warpgroup) and the query rows become
        the N side, any multiple of 8.
        """
        return self.block_m % 64 != 0

    @property
    def num_threads(self) -> int:
        return 128 * (self.mma_warpgroups + 1)

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        """Main-kernel shared memory of the mainloop buffers (excluding barriers)."""
        d, m, n = self.head_dim, self.block_m, self.block_n
        kv = 2 * n * d * elem_bytes
        q = self.q_stages * m * d * elem_bytes
        do = self.do_stages * m * d * elem_bytes
        ds = self.ds_stages * m * n * elem_bytes
        dq = self.dq_stages * m * d * 4
        lse_d = (self.q_stages + self.do_stages) * m * 4
        return kv + q + do + ds + dq + lse_d


#: The table. Keyed by (head_dim, causal).
BWD_TILE_CONFIGS: tuple[BwdTileConfig, ...] = (
    # Causal masks use two dQ chains (measured: +3-4 % deterministic at 4k-16k); full masks
    # one (two cost 2-3 %: the second fp32 copy doubles the adds' L2 footprint and the convert's
    # reads, and full-mask orders barely wait). docs/kernel-notes.md, fourth pass.
    BwdTileConfig(64, False, 128, 128, 2, 2, 2, 2, 1, 1, 6, note="FA3's hdim-64 tile; ~193 KB smem"),
    BwdTileConfig(64, True, 128, 128, 2, 2, 2, 2, 1, 2, 6, note="FA3's hdim-64 tile; ~193 KB smem"),
    BwdTileConfig(128, False, 80, 128, 2, 2, 2, 2, 1, 1, 4, note="FA3's full-mask hdim-128 tile, dQ transposed; ~225 KB smem"),
    # hdim 128 causal: two dQ staging buffers with the LSE loaded early in both modes (eighteenth
    # pass); with the late loads a second buffer had measured det +0-1 %, non-det -1-1.5 % (fourth).
    BwdTileConfig(128, True, 64, 128, 2, 2, 2, 2, 2, 2, 4, lse_early_nondet=True, lse_early_det=True,
                  note="FA3's causal hdim-128 tile, two dQ staging buffers; ~225 KB smem"),
)

@dataclass(frozen=True)
class FwdTileConfig:
    """Tiling of the forward kernel for one (head dim, mask) pair.

    A *Q tile* is ``block_m`` query rows (one CTA work item); the mainloop walks its KV
    blocks of ``block_n`` keys from the last to the first, so that the masked diagonal
    blocks of a causal tile come first. Each MMA warpgroup owns 64 rows of the Q tile
    (``block_m == 64 * mma_warpgroups``) and keeps its O rows in registers.
    """

    head_dim: int
    causal: bool
    block_m: int  # query rows per Q tile
    block_n: int  # keys per KV block
    mma_warpgroups: int  # consumer warpgroups; +1 producer warpgroup
    kv_stages: int  # smem buffers of K and of V in flight
    mma_registers: int  # setmaxnreg of the MMA warpgroups (the producer keeps 24)
    pingpong: bool  # MMA warpgroups take turns issuing GEMMs (one's softmax hides under the other's GEMMs)
    # A tile's last P V GEMM is issued out of turn and its row sums are reduced (quad sums, 1/sum,
    # LSE) while it runs, instead of in turn and after it. Measured on the H200 (docs/kernel-notes.md,
    # thirteenth pass): hdim 64 causal +1.3 to +1.8 %, full -0.4 to +0.5 %; hdim 128 full -1.6 to
    # -4.6 %, causal -0.1 to -1.9 % (ptxas compiles the hdim-128 unmasked loop differently with it).
    overlap_tile_end: bool = False
    # Shared-memory buffers of the Q tile. With 2 the producer loads the next tile's Q as soon as
    # it claims the tile, under the current tile's last blocks; with 1 it waits for the current
    # tile's last S GEMM, and the load's latency can fall between the epilogue and the next
    # tile's first GEMM. Measured on the H200 (docs/kernel-notes.md, seventeenth pass): hdim 64
    # full +0.9 to +2.0 % (1k-16k, two builds); hdim 64 causal -0.5 to -1.4 %; hdim 128 -2 to
    # -9 % (not the larger shared memory: 32 KB of padding alone measured -0.9 to +0.2 %, one
    # 16k row -1.8 %). Same bits.
    q_stages: int = 1
    # Where a middle block waits for the V it multiplies by P. True: inside its ping-pong turn,
    # after issuing S = Q K^T (FA3's place), so a V that is still loading delays only the P V
    # issue, not the S GEMM, and the warpgroup enters its turn waiting on K alone. False: before
    # taking the turn, K's and V's barriers back to back. Measured on the H200 (docs/kernel-notes.md,
    # nineteenth pass): hdim 128 +0.5 to +3.2 % (2k-16k, full and causal); hdim 64 -0.2 to -2.5 %.
    # Same bits.
    v_wait_in_turn: bool = False
    # Full masks: clusters of two CTAs on adjacent Q tiles of one head, each loading half of every
    # K and V block and multicasting it to both (FA3's cluster at hdim 128 full), so that L2 serves
    # each block once per pair of tiles instead of once per tile. Used when the head's Q tiles pair
    # up (an even number) and sm_margin leaves two SMs; otherwise one CTA per tile. Same bits.
    # Off in the table: measured on the H200 with the fence-free release (kernels/ptx.h,
    # mbar_arrive_cluster_if; docs/kernel-notes.md, twenty-second pass), bursts 0.95-0.99x the
    # one-CTA speed at hdim 128 full 2k-16k and 0.97 at hdim 64 full 4k / 16k; sustained 0.995-1.005.
    # L2 bytes halve (ncu), but the pair walks its blocks in lockstep and needs 5.7 % more cycles.
    kv_multicast: bool = False
    # Online softmax with a conditional rescale. A number: the max subtracted before the
    # exponentials is raised only when a block's row max exceeds it by more than 2**this (exp2
    # units of the scaled scores), so P may reach 2**this instead of 1 (bf16/fp16 P and the fp32
    # sums hold that as well as 1), and a warp multiplies its O rows by the rescale factors only
    # when one of its rows raised its max: on the blocks where none did (after the first few, on
    # typical rows) the O rescale is skipped. None: the exact running max, O rescaled on every
    # block (FA3's). Measured on the H200 with 8 (docs/kernel-notes.md, twenty-third pass): hdim
    # 128 full 2k / 8k / 16k +3.2 / +5.3 / +4.7 %, causal +2.2 / +3.4 / +2.6 % (bursts), +2.8 to
    # +4.2 % sustained at the power cap; 0.988-1.008 when every row raises its max on every block
    # (its worst case); hdim 64 causal +0.3 to +1.2 %, full -0.8 to -1.6 % (so None there). With 0
    # (the exact max, rescale skipped only where no row of the warp grew): no gain. Other bits
    # than None's (another max is subtracted).
    rescale_max_growth_log2: float | None = None
    # Lazy block max (needs rescale_max_growth_log2). A number: a middle block takes its
    # exponentials straight away under the max subtracted so far, without its row max first
    # (one FMNMX per score, quad shuffles, the rescale factors: ~110 of an unmasked hdim-64
    # block's ~450 issued instructions per warp, and the place ptxas kept the P V wait). P >= 0,
    # so a thread whose partial row sums of the block stay within 2**this computed no P above
    # it. Where one does not (a score ~this many exp2 units above the max, or +inf), or where a
    # row of the warpgroup meets its first visible key, the warpgroup (a bar.red.or vote, so the
    # choice is uniform as a WGMMA needs) computes S again and raises the max by the rule of
    # rescale_max_growth_log2, and also where a row's sum passed the bound. Masked blocks keep
    # the conditional rule. Other bits than None's (another max is subtracted), the same bits on
    # every run and grid; None compiles to the same SASS as before the option existed.
    # Off in the table: measured with 12 on every row (and growth 8 at hdim 64) against the
    # shipped kernels on an H100, two rounds (docs/kernel-notes.md, twenty-ninth pass): random
    # scores 0.969-1.009 (geometric mean 0.999; the low one hdim 64 causal 2k) although the hdim-64
    # forward executes 25 % fewer instructions (ncu) and all 64 exponentials precede the P V
    # wait (its MUFU and tensor pipes, ~61 % busy each, are the limit, not issue); an attention sink 0.914-0.995 (mean 0.958); scores that outgrow every block (the
    # slow path every time) 0.53-0.65.
    lazy_max_sum_log2: int | None = None
    # The persistent tile order (FwdTileOrder) walks the (batch, head) pairs in L2 sections: the
    # most heads (a power of two) whose K and V take at most this many MiB, Q tiles longest first
    # inside a section. Smaller sections keep the K/V the grid reads at once resident in L2 beside
    # the Q tiles and outputs streaming past; larger ones balance a causal grid's tail better,
    # since the last section's longest tile is then a smaller share of what is left to share out
    # (tools/fwd_tile_order_model.py). Same bits for any value (the order changes which CTA runs
    # a tile, not what it computes). Measured on the H200, 32 against 12 (docs/kernel-notes.md,
    # twenty-fourth pass): hdim 64 causal 2k / 4k / 8k / 16k +0.4 / +1.1 / +1.5 / +1.6 % (the
    # model's idle share 1.2-1.8 % -> 0.3-0.7 %), hdim 128 causal 8k / 16k -2.6 / -3.1 % (4 and
    # 8 MiB of K/V per head there: sections of 2 and 1 heads become 8 and 4); the sixth pass
    # measured 32 at hdim 128 full 4k -2 to -3 %.
    l2_section_mib: int = 12
    # The tile's end. True: each MMA warpgroup stages its 64 output rows in shared memory
    # (stmatrix) and one thread stores them with a TMA store (rows past seqlen_q clipped by the
    # TMA unit), and the producer hands the MMA warpgroups the Q tile decoded once (item, (batch,
    # head), Q block) instead of each warp decoding the item; False: 16-byte row stores from
    # registers (a 4x4 transpose per quad: ~490 instructions per warp and tile at hdim 128) and
    # the item index alone. Not for varlen (a tile's rows past its sequence belong to the next
    # one, which a TMA store would overwrite): those kernels keep the row stores. Measured on the
    # H200 together with row_limit_mask (docs/kernel-notes.md, twenty-sixth pass), the shipped
    # build against the previous one: hdim 128 full 1k / 2k / 8k / 16k +4.1 / +1.9 / +3.2 / +0.5 %,
    # causal +6.4 / +3.8 / +1.0 / +1.0 %; the same changes at hdim 64 (a variant build): full
    # 2k / 16k +0.4 / -0.9 %, causal +0.3 / -2.2 % (so False there). Same bits. 32 KB more
    # shared memory (one CTA per SM either way).
    tma_store_out: bool = False
    # Masked blocks compare each key against one visible-key limit per row (min(seqlen_k, the
    # diagonal + 1), computed once per row half) instead of recomputing the key and query of
    # every element (~200 instructions per masked block at hdim 128). Measured alone on the H200
    # (twenty-sixth pass): hdim 128 +0.1 to +0.7 %, hdim 64 causal 2k / 16k -2.0 / -2.4 %. Same bits.
    row_limit_mask: bool = False
    # Where a middle block waits for its P V GEMM (issued before its S was waited for). None:
    # after the softmax, as the source reads; but ptxas moves a plain wgmma.wait_group up to
    # where it first reuses the registers the GEMM reads, and at hdim 64 (160 registers) that is
    # P's, above the first exponential, so a warpgroup's exponentials never ran under its own
    # P V GEMM (kernel notes, eighth and twenty-fourth passes). A number n: the wait follows the
    # thread's first n exponentials of the block (a wait predicated on their partial row sum,
    # which ptxas cannot move above it; ptx.h, wgmma_wait_all_after), and the rest interleave
    # with the P conversions behind it, FA4's shape. tools/check_kernels.py --sass checks that
    # at least n exponentials precede the loop's wait. Same bits (only the order of issue moves).
    # Off in the table: measured slower. On an H100 (2026-12-07, hdim 64, 4k and 16k, both masks,
    # same bits) the wait after 16 exponentials ran 0.941-0.975 of main's speed (geomean 0.956),
    # after 8 (FA4's shape) 0.938-0.967 (0.950), worst at 16k, the rows it was meant to help
    # (docs/kernel-notes.md, forty-fifth and forty-sixth passes).
    pv_wait_after_exp2: int | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if self.q_stages not in (1, 2):
            raise ValueError(f"q_stages={self.q_stages} is not supported (1 or 2)")
        if self.rescale_max_growth_log2 is not None and not 0.0 <= self.rescale_max_growth_log2 <= 12.0:
            # P reaches 2**growth: 12 keeps it 16x below fp16's largest finite value (65504).
            raise ValueError(f"rescale_max_growth_log2={self.rescale_max_growth_log2} is not supported (0 to 12)")
        if self.lazy_max_sum_log2 is not None:
            if not isinstance(self.lazy_max_sum_log2, int) or not 0 <= self.lazy_max_sum_log2 <= 12:
                # P reaches 2**this: 12 keeps it 16x below fp16's largest finite value (65504).
                raise ValueError(f"lazy_max_sum_log2={self.lazy_max_sum_log2!r} is not supported (an int, 0 to 12)")
            if self.rescale_max_growth_log2 is None:
                raise ValueError("lazy_max_sum_log2 raises the max by the rule of rescale_max_growth_log2: set both")
        if not 1 <= self.l2_section_mib <= 1024:
            raise ValueError(f"l2_section_mib={self.l2_section_mib} is not supported (1 to 1024 MiB)")
        if self.pv_wait_after_exp2 is not None:
            per_thread = self.block_n // 2  # a thread's scores of a 64-row x block_n block
            if not isinstance(self.pv_wait_after_exp2, int) or not 1 <= self.pv_wait_after_exp2 < per_thread:
                raise ValueError(f"pv_wait_after_exp2={self.pv_wait_after_exp2!r} is not supported "
                                 f"(an int, 1 to {per_thread - 1}: a thread takes {per_thread} exponentials per block)")
            if self.lazy_max_sum_log2 is not None:
                raise ValueError("pv_wait_after_exp2 places the exact softmax's wait: not with lazy_max_sum_log2")
        if self.kv_multicast and self.causal:
            raise ValueError("kv_multicast pairs Q tiles that walk the same KV blocks: full masks only")
        if self.block_m != 64 * self.mma_warpgroups:
            raise ValueError(f"block_m={self.block_m} must be 64 * mma_warpgroups={self.mma_warpgroups}")
        if self.block_n % 64 != 0 or self.head_dim % 64 != 0:
            raise ValueError(f"block_n={self.block_n} and head_dim={self.head_dim} must be multiples of 64")
        threads = self.num_threads
        if 128 * (24 + self.mma_warpgroups * self.mma_registers) > 65536 or self.mma_registers % 8:
            raise ValueError(f"mma_registers={self.mma_registers} with {threads} threads exceeds the register file")

    @property
    def num_threads(self) -> int:
        return 128 * (self.mma_warpgroups + 1)

    @property
    def l2_section_bytes(self) -> int:
        return self.l2_section_mib << 20

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        d = self.head_dim
        out_slabs = self.block_m * d if self.tma_store_out else 0
        return (self.q_stages * self.block_m * d + 2 * self.kv_stages * self.block_n * d + out_slabs) * elem_bytes


#: The forward table. Keyed by (head_dim, causal).
FWD_TILE_CONFIGS: tuple[FwdTileConfig, ...] = (
    FwdTileConfig(64, False, 192, 128, 3, 2, 160, True, overlap_tile_end=True, q_stages=2,
                  note="3 MMA warpgroups of 64 rows; ~112 KB smem"),
    FwdTileConfig(64, True, 192, 128, 3, 2, 160, True, overlap_tile_end=True, l2_section_mib=32,
                  note="3 MMA warpgroups of 64 rows; ~88 KB smem"),
    FwdTileConfig(128, False, 128, 128, 2, 2, 240, True, v_wait_in_turn=True, rescale_max_growth_log2=8.0,
                  tma_store_out=True, row_limit_mask=True, note="~192 KB smem (32 KB output slabs)"),
    FwdTileConfig(128, True, 128, 128, 2, 2, 240, True, v_wait_in_turn=True, rescale_max_growth_log2=8.0,
                  tma_store_out=True, row_limit_mask=True, note="~192 KB smem (32 KB output slabs)"),
)


#: Semaphore / workspace constants shared by host and kernels.
PREPROCESS_THREADS = 256
H100_SMEM_LIMIT_BYTES = 227 * 1024


def _table_row(configs, head_dim: int, causal: bool, kernel: str):
    """The row of ``configs`` for ``head_dim`` and mask; a clear error naming ``kernel`` otherwise."""
    for cfg in configs:
        if cfg.head_dim == head_dim and cfg.causal == bool(causal):
            return cfg
    supported = ", ".join(str(d) for d in SUPPORTED_HEAD_DIMS)
    raise NotImplementedError(
        f"head_dim={head_dim} is not supported yet by DASH's {kernel}; supported head dims: {supported}"
    )


def bwd_tile_config(head_dim: int, causal: bool) -> BwdTileConfig:
    """Return the configuration for ``head_dim`` and mask; raise a clear error otherwise."""
    return _table_row(BWD_TILE_CONFIGS, head_dim, causal, "backward")


def fwd_tile_config(head_dim: int, causal: bool) -> FwdTileConfig:
    """The forward table's row for ``head_dim`` and mask; raise a clear error otherwise."""
    return _table_row(FWD_TILE_CONFIGS, head_dim, causal, "forward")


def shift_lanes(seqlen_q: int, seqlen_k: int, head_dim: int, ctas: int) -> tuple[int, int]:
    """The shift schedule's precondition, as (running columns of a head, Q tiles): at most
    ``min(key columns, ctas)`` columns of one head run at once, each starting at its own Q
    tile, so shift runs when the first is at most the second. The kernel checks the same in
    csrc/kernels/bwd_launch.h; validation refuses ``schedule="shift"`` and non-deterministic
    ``auto`` avoids it where it fails."""
    cfg = bwd_tile_config(head_dim, False)
    return min(-(-int(seqlen_k) // cfg.block_n), int(ctas)), -(-int(seqlen_q) // cfg.block_m)


def _check_table(configs: Iterable[BwdTileConfig | FwdTileConfig]) -> None:
    seen = set()
    for cfg in configs:
        key = (cfg.head_dim, cfg.causal)
        if key in seen:
            raise ValueError(f"duplicate config for {key}")
        seen.add(key)
        if cfg.smem_bytes() > H100_SMEM_LIMIT_BYTES - 1024:
            raise ValueError(f"config {key} needs {cfg.smem_bytes()} B of shared memory")
    for d in SUPPORTED_HEAD_DIMS:
        for causal in (False, True):
            if (d, causal) not in seen:
                raise ValueError(f"no config for head_dim={d} causal={causal}")


_check_table(BWD_TILE_CONFIGS)
_check_table(FWD_TILE_CONFIGS)


def render_cpp_header() -> str:
    """Render the table as C++ for the kernels and the host launch layer."""
    lines = [
        "// Generated from dash/config.py by render_cpp_header(). Do not edit; do not commit.",
        "#pragma once",
        "",
        "namespace dash {",
        "",
        "// Primary template left undefined: an unlisted (head dim, mask) is a compile error.",
        "template <int kHeadDim_, bool Is_causal_> struct BwdTileConfig;",
        "",
    ]
    for cfg in BWD_TILE_CONFIGS:
        lines += [
            f"// {cfg.note}" if cfg.note else "//",
            f"template <> struct BwdTileConfig<{cfg.head_dim}, {'true' if cfg.causal else 'false'}> {{",
            f"  static constexpr int kHeadDim = {cfg.head_dim};",
            f"  static constexpr bool Is_causal = {'true' if cfg.causal else 'false'};",
            f"  static constexpr int kBlockM = {cfg.block_m};",
            f"  static constexpr int kBlockN = {cfg.block_n};",
            f"  static constexpr int NumMmaWarpGroups = {cfg.mma_warpgroups};",
            f"  static constexpr int kStagesQ = {cfg.q_stages};",
            f"  static constexpr int kStagesdO = {cfg.do_stages};",
            f"  static constexpr int kStagesdS = {cfg.ds_stages};",
            f"  static constexpr int kStagesdQ = {cfg.dq_stages};",
            f"  static constexpr int kdQChains = {cfg.dq_chains};",
            f"  static constexpr int kdKVChains = {cfg.dkv_chains};",
            f"  static constexpr int kNondetdKVChainsMaxGroup = {cfg.nondet_dkv_chains_max_group};",
            f"  static constexpr int kExp2FmaEvery = {cfg.exp2_fma_every};",
            f"  static constexpr bool kLseEarlyNondet = {'true' if cfg.lse_early_nondet else 'false'};",
            f"  static constexpr bool kLseEarlyDet = {'true' if cfg.lse_early_det else 'false'};",
            f"  static constexpr bool dQ_split_rows = {'true' if cfg.dq_split_rows else 'false'};",
            f"  static constexpr bool dQ_transposed = {'true' if cfg.dq_transposed else 'false'};",
            "};",
            "",
        ]
    lines += [
        "template <int kHeadDim_, bool Is_causal_> struct FwdTileConfig;",
        "",
    ]
    for cfg in FWD_TILE_CONFIGS:
        lines += [
            f"// {cfg.note}" if cfg.note else "//",
            f"template <> struct FwdTileConfig<{cfg.head_dim}, {'true' if cfg.causal else 'false'}> {{",
            f"  static constexpr int kHeadDim = {cfg.head_dim};",
            f"  static constexpr bool Is_causal = {'true' if cfg.causal else 'false'};",
            f"  static constexpr int kBlockM = {cfg.block_m};",
            f"  static constexpr int kBlockN = {cfg.block_n};",
            f"  static constexpr int NumMmaWarpGroups = {cfg.mma_warpgroups};",
            f"  static constexpr int kStagesKV = {cfg.kv_stages};",
            f"  static constexpr int kMmaRegisters = {cfg.mma_registers};",
            f"  static constexpr bool kPingPong = {'true' if cfg.pingpong else 'false'};",
            f"  static constexpr bool kOverlapTileEnd = {'true' if cfg.overlap_tile_end else 'false'};",
            f"  static constexpr int kStagesQ = {cfg.q_stages};",
            f"  static constexpr bool kWaitVInTurn = {'true' if cfg.v_wait_in_turn else 'false'};",
            f"  static constexpr bool kKVMulticast = {'true' if cfg.kv_multicast else 'false'};",
            f"  static constexpr bool kConditionalRescale = {'false' if cfg.rescale_max_growth_log2 is None else 'true'};",
            f"  static constexpr float kRescaleMaxGrowthLog2 = {float(cfg.rescale_max_growth_log2 or 0.0)!r}f;",
            f"  static constexpr bool kLazyMax = {'false' if cfg.lazy_max_sum_log2 is None else 'true'};",
            f"  static constexpr float kLazyMaxSumBound = {float(2 ** (cfg.lazy_max_sum_log2 or 0))!r}f;",
            f"  static constexpr long long kL2SectionBytes = {cfg.l2_section_bytes};",
            f"  static constexpr bool kTmaStoreOut = {'true' if cfg.tma_store_out else 'false'};",
            f"  static constexpr bool kRowLimitMask = {'true' if cfg.row_limit_mask else 'false'};",
            f"  static constexpr int kPvWaitAfterExp2 = {cfg.pv_wait_after_exp2 or 0};",
            "};",
            "",
        ]
    dims = ", ".join(str(d) for d in SUPPORTED_HEAD_DIMS)
    lines += [
        f"inline constexpr int kSupportedHeadDims[] = {{{dims}}};",
        "// X(head_dim) for every head dim of the table (host code that switches on the head dim).",
        "#define DASH_FOR_EACH_HEAD_DIM(X) " + " ".join(f"X({d})" for d in SUPPORTED_HEAD_DIMS),
        f"inline constexpr int kPreprocessThreads = {PREPROCESS_THREADS};",
        "",
        "}  // namespace dash",
        "",
    ]
    return "\n".join(lines)


#: The kernel passes, each compiled once per (head dim, dtype) translation unit.
KERNEL_PASSES: tuple[str, ...] = ("fwd", "bwd")
#: dtype name -> (file suffix, CUTLASS element type, dash::DType enumerator).
DTYPE_CPP: dict[str, tuple[str, str, str]] = {
    "bfloat16": ("bf16", "cutlass::bfloat16_t", "kBFloat16"),
    "float16": ("fp16", "cutlass::half_t", "kFloat16"),
}


def render_instantiations(head_dims: Iterable[int], dtypes: Iterable[str]) -> dict[str, str]:
    """One translation unit per (pass, head dim, dtype): file name -> text. One unit each
    bounds compile time and memory; the mask is a compile-time switch inside."""
    units = {}
    for kind in KERNEL_PASSES:
        for d in head_dims:
            for dt in dtypes:
                suffix, element, _ = DTYPE_CPP[dt]
                units[f"{kind}_hdim{d}_{suffix}.cu"] = "\n".join([
                    "// Generated from dash/config.py by render_instantiations(). Do not edit; do not commit.",
                    "// WGMMA widths beyond CuTe's default set (80: the hdim-128 full-mask Q tile); defined",
                    "// before any CuTe header, and kOneWgmmaWide (mma_utils.h) fails the build without it.",
                    "#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",
                    f'#include "kernels/{kind}_launch.h"',
                    "",
                    "namespace dash {",
                    f"template void run_{kind}_hdim<{d}, {element}>({kind.capitalize()}Params const&, cudaStream_t);",
                    "}  // namespace dash",
                    "",
                ])
    return units


def render_dispatch_header(head_dims: Iterable[int], dtypes: Iterable[str]) -> str:
    """The (head dim, dtype) pairs a build compiles, as an X-macro the dispatch files expand
    (csrc/{fwd,bwd}_dispatch.cpp), so that dispatch and instantiations come from one list."""
    pairs = [(d, dt) for d in head_dims for dt in dtypes]
    lines = [
        "// Generated from dash/config.py by render_dispatch_header(). Do not edit; do not commit.",
        "#pragma once",
        "",
        "// X(head_dim, CUTLASS element type, dash::DType enumerator) for every compiled unit.",
        "#define DASH_FOR_EACH_BUILT_UNIT(X) \\",
    ]
    lines += [f"  X({d}, {DTYPE_CPP[dt][1]}, {DTYPE_CPP[dt][2]}) \\" for d, dt in pairs]
    lines += ["  /* end */", ""]
    return "\n".join(lines)


def write_generated(directory: str, head_dims: Iterable[int] = SUPPORTED_HEAD_DIMS,
                    dtypes: Iterable[str] = SUPPORTED_DTYPES) -> list[str]:
    """Write tile_config.h, dispatch.h and instantiations/*.cu for the chosen head dims and
    dtypes into ``directory`` (csrc/generated); remove units of other choices. Returns the
    translation units' paths."""
    import os

    head_dims, dtypes = tuple(head_dims), tuple(dtypes)
    for d in head_dims:
        if d not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim {d} has no tile configuration; supported: {SUPPORTED_HEAD_DIMS}")
    for dt in dtypes:
        if dt not in DTYPE_CPP:
            raise ValueError(f"dtype {dt!r} is not one of {tuple(DTYPE_CPP)}")
    write_if_changed(os.path.join(directory, "tile_config.h"), render_cpp_header())
    write_if_changed(os.path.join(directory, "dispatch.h"), render_dispatch_header(head_dims, dtypes))
    units_dir = os.path.join(directory, "instantiations")
    units = render_instantiations(head_dims, dtypes)
    paths = []
    for name, text in units.items():
        path = os.path.join(units_dir, name)
        write_if_changed(path, text)
        paths.append(path)
    for name in os.listdir(units_dir):
        if name.endswith(".cu") and name not in units:
            os.remove(os.path.join(units_dir, name))
    return sorted(paths)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="DASH tile configuration table")
    parser.add_argument("--header", metavar="PATH", help="write the C++ header to PATH ('-' for stdout)")
    parser.add_argument("--generate", metavar="DIR",
                        help="write tile_config.h, dispatch.h and instantiations/*.cu (all head dims and dtypes) to DIR")
    args = parser.parse_args(argv)
    if args.generate:
        for path in write_generated(args.generate):
            print(path)
        return 0
    if args.header:
        text = render_cpp_header()
        if args.header == "-":
            print(text, end="")
        else:
            write_if_changed(args.header, text)
    else:
        for cfg in (*BWD_TILE_CONFIGS, *FWD_TILE_CONFIGS):
            print(cfg)
    return 0


def write_if_changed(path: str, text: str) -> bool:
    """Write ``text`` to ``path`` unless identical (keeps ninja from rebuilding)."""
    import os

    try:
        with open(path) as f:
            if f.read() == text:
                return False
    except FileNotFoundError:
        pass
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return True


if __name__ == "__main__":
    raise SystemExit(main())
