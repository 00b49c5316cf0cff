"""How well the forward's persistent tile order balances the grid: a list-scheduling model of
FwdTileOrder (csrc/schedule/fwd_tile_order.h) on a persistent grid, with a Q tile's cost taken as
its KV blocks plus a fixed per-tile overhead.

    python tools/fwd_tile_order_model.py                      # the paper grid's hdim 128 rows
    python tools/fwd_tile_order_model.py --seqlen 8192 --causal --section-heads 2 8

Two claim policies: "at start" (the producer claims a CTA's next tile when it starts loading
the current one, so each CTA holds a reservation one tile ahead: the kernel until 47af05a)
and "at end" (claimed when a tile ends; the kernel since a0464c6 claims when the tile's last
loads are issued, a few KV blocks before its end). Prints the model's makespan over the ideal
(total work / CTAs) and the share of the kernel an average SM would sit idle. ncu measured
8.6 % idle at hdim 128 causal 8k with the claim at start (docs/kernel-notes.md, fifth pass);
the model gives 7.3 % there, and 0.2 % with the claim at the end. Moving the claim took the
forward +5-8 % at hdim 128 causal 2k-16k (sixth pass).
"""

from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dash.config import FWD_TILE_CONFIGS  # noqa: E402


def tile_order(num_bh: int, num_m_blocks: int, section_heads: int) -> list[tuple[int, int]]:
    """(bh, m) in claim order (FwdTileOrder::tile in csrc/schedule/fwd_tile_order.h): sections
    of ``section_heads`` heads, descending m inside a section, heads innermost."""
    out = []
    for first in range(0, num_bh, section_heads):
        heads = range(first, min(num_bh, first + section_heads))
        for m in range(num_m_blocks - 1, -1, -1):
            out.extend((h, m) for h in heads)
    return out


def section_keys(l2_budget_bytes: int, head_dim: int, elem_bytes: int = 2, heads_per_kv_head: int = 1) -> int:
    """Keys of one query head's K and V that fit an L2 section (fwd_section_keys in
    csrc/schedule/fwd_tile_order.h), at most 2**31 - 1."""
    return min(l2_budget_bytes * heads_per_kv_head // (2 * head_dim * elem_bytes), 2**31 - 1)


def sequence_section_heads(seqlen_k: int, num_heads: int, keys: int) -> int:
    """Varlen: a sequence's heads per L2 section (FwdTileOrder::sequence_section_heads): the
    largest power of two w <= num_heads with w * seqlen_k <= keys."""
    w = 1
    while 2 * w <= num_heads and 2 * w * seqlen_k <= keys:
        w *= 2
    return w


def varlen_tile_order(num_heads: int, num_m_blocks: int, seqlens_k: list[int], keys: int) -> list[tuple[int, int]]:
    """(bh, m) in the varlen claim order (FwdTileOrder::tile_in_sequence): sequence by sequence,
    num_heads * num_m_blocks items each (the grid is sized for the longest), its heads in L2
    sections sized for its own seqlen_k, descending m inside a section, heads innermost."""
    out = []
    for b, sk in enumerate(seqlens_k):
        w = sequence_section_heads(sk, num_heads, keys)
        for first in range(0, num_heads, w):
            heads = range(b * num_heads + first, b * num_heads + min(num_heads, first + w))
            for m in range(num_m_blocks - 1, -1, -1):
                out.extend((h, m) for h in heads)
    return out


def section_heads(l2_budget_bytes: int, seqlen_k: int, head_dim: int, num_bh: int, elem_bytes: int = 2,
                  heads_per_kv_head: int = 1) -> int:
    """Heads per L2 section, the kernel's rule (fwd_section_heads in csrc/schedule/fwd_tile_order.h):
    the largest power of two, at most num_bh, whose K and V (shared by GQA siblings) fit the budget."""
    kv_bytes_per_q_head = -(-2 * seqlen_k * head_dim * elem_bytes // heads_per_kv_head)
    w = 1
    while 2 * w <= num_bh and 2 * w * kv_bytes_per_q_head <= l2_budget_bytes:
        w *= 2
    return w


def makespan(costs: list[float], ctas: int, claim_at_start: bool) -> float:
    """Finish time of the last CTA when ``ctas`` CTAs take the items of ``costs`` in order."""
    nxt, finish, reserved = 0, [], {}
    for c in range(min(ctas, len(costs))):
        heapq.heappush(finish, (costs[nxt], c))
        nxt += 1
        if claim_at_start and nxt < len(costs):
            reserved[c] = costs[nxt]
            nxt += 1
    end = 0.0
    while finish:
        t, c = heapq.heappop(finish)
        end = max(end, t)
        if claim_at_start:
            if c in reserved:
                heapq.heappush(finish, (t + reserved.pop(c), c))
                if nxt < len(costs):
                    reserved[c] = costs[nxt]
                    nxt += 1
        elif nxt < len(costs):
            heapq.heappush(finish, (t + costs[nxt], c))
            nxt += 1
    return end


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, nargs="*", default=[2048, 4096, 8192, 16384])
    p.add_argument("--hdim", type=int, default=128, help="head dim (tiles from dash.config.FWD_TILE_CONFIGS)")
    p.add_argument("--causal", action="store_true", help="only causal rows (default: both masks)")
    p.add_argument("--section-heads", type=int, nargs="*", default=None,
                   help="heads per L2 section (default: the kernel's rule, FwdTileConfig.l2_section_mib of the row's tile)")
    p.add_argument("--ctas", type=int, default=132)
    p.add_argument("--tile-overhead", type=float, default=0.5, help="per-tile cost in KV blocks (prologue, epilogue)")
    args = p.parse_args()
    tiles = {(c.head_dim, c.causal): c for c in FWD_TILE_CONFIGS}
    if (args.hdim, False) not in tiles:
        p.error(f"--hdim {args.hdim}: the forward has tiles for head dims {sorted({d for d, _ in tiles})}")
    for seqlen in args.seqlen:
        num_bh = (16384 // seqlen) * (2048 // args.hdim)
        for causal in ([True] if args.causal else [False, True]):
            cfg = tiles[(args.hdim, causal)]
            block_m, block_n = cfg.block_m, cfg.block_n
            rule = section_heads(cfg.l2_section_bytes, seqlen, args.hdim, num_bh)
            num_m = -(-seqlen // block_m)
            for sw in args.section_heads or [rule]:
                order = tile_order(num_bh, num_m, sw)
                num_n = -(-seqlen // block_n)
                costs = [(min(-(-((m + 1) * block_m) // block_n), num_n) if causal else num_n) + args.tile_overhead
                         for _, m in order]
                ideal = sum(costs) / args.ctas
                for at_start in (True, False):
                    span = makespan(costs, args.ctas, at_start)
                    mask = "causal" if causal else "full  "
                    print(f"hd{args.hdim} {mask} {seqlen:6d} section {sw:3d} heads, claim at "
                          f"{'start' if at_start else 'end  '}: makespan / ideal {span / ideal:.3f}, "
                          f"idle {1 - ideal / span:.3f}")


if __name__ == "__main__":
    main()
