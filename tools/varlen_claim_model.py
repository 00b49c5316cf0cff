"""How a varlen forward's persistent grid spends its time claiming: an event model of the
CTAs' claims on the tile counter, with the latency of each claim and of reading a sequence's
offsets, for the padded order the kernel runs (FwdTileOrder sized for the longest sequence, the
dead-run skip) and for two orders without that cost.

    python tools/varlen_claim_model.py --mix skewed --hdim 128 --causal

Costs are in KV blocks of one CTA (a Q tile of m+1 visible blocks costs m+1 plus a per-tile
overhead). Each CTA's producer claims its next item when the current tile has `lead` blocks
left (it issues a tile's last loads that far ahead of its end): a claim returns after `claim`
blocks, a varlen item's sequence offsets after `read` more. A dead item (past its sequence's
end) in a section of one sequence raises the counter past its run (an atomicMax issued once the
offsets are read, reaching the counter claim/2 later, as the kernel's next_seq_tile does); every
CTA that claims an item of the run before that lands walks it too. Orders:

* padded: the kernel's until the per-sequence sections (tools/fwd_tile_order_model.tile_order,
  sections sized for the longest sequence's K/V, so a short sequence's dead items open each of
  its many narrow sections), dead items included;
* per_sequence: the kernel's now (tools/fwd_tile_order_model.varlen_tile_order,
  FwdTileOrder::tile_in_sequence): the same items, each sequence's sections sized for its own
  length (a short sequence: all its heads in one section, one run of dead items);
* live_only: the per-sequence order without dead items (what a device-side prefix over the
  sequences' Q-tile counts, as FA3's prepare kernel computes, would give).

Prints each order's makespan over the ideal (live work / CTAs) and against the padded one, and
the padded mix against its longest sequence and the rest run alone. The default latencies (a
claim 0.2 blocks, the offsets 0.15: about 0.3 and 0.2 us at hdim 128) are fitted to that last
ratio as tools/varlen_split_timing.py measured it on an H100 (kernel notes, thirty-first pass):
skewed hdim 128 causal 1.130 (the model: 1.19), full 1.011 (0.996).
"""

from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fwd_tile_order_model import section_heads, section_keys, sequence_section_heads, tile_order  # noqa: E402

from dash.config import fwd_tile_config  # noqa: E402

DEAD, LIVE = 0, 1


def items_of(lengths: list[int], heads: int, head_dim: int, causal: bool, order: str,
             overhead: float = 0.5) -> list[tuple]:
    """Items in claim order: (LIVE, cost) or (DEAD, run_end) where run_end is the item index the
    kernel's skip raises the counter to (the item itself + 1 where its section spans sequences)."""
    cfg = fwd_tile_config(head_dim, causal)
    bm, bn = cfg.block_m, cfg.block_n
    nmb = -(-max(lengths) // bm)

    def cost(n: int, m: int) -> float:
        kend = min(n, (m + 1) * bm) if causal else n
        return -(-kend // bn) + overhead

    out: list[tuple] = []
    if order == "padded":
        w = section_heads(cfg.l2_section_bytes, max(lengths), head_dim, len(lengths) * heads)
        order_items = tile_order(len(lengths) * heads, nmb, w)
        for t, (bh, m) in enumerate(order_items):
            b = bh // heads
            n = lengths[b]
            if m < -(-n // bm):
                out.append((LIVE, cost(n, m)))
                continue
            first = bh - bh % w
            one_seq = first // heads == (min(first + w, len(lengths) * heads) - 1) // heads
            if not one_seq:
                out.append((DEAD, t + 1))
                continue
            section_start = (first // w) * w * nmb
            heads_here = min(w, len(lengths) * heads - first)
            out.append((DEAD, section_start + (nmb - -(-n // bm)) * heads_here))
        return out
    keys = section_keys(cfg.l2_section_bytes, head_dim)
    for n in lengths:
        w = sequence_section_heads(n, heads, keys)
        smb = -(-n // bm)
        for first in range(0, heads, w):
            hs = min(w, heads - first)
            start = len(out)
            for m in range(nmb - 1, -1, -1):
                for _ in range(hs):
                    if m < smb:
                        out.append((LIVE, cost(n, m)))
                    elif order == "per_sequence":
                        out.append((DEAD, start + (nmb - smb) * hs))
    return out


# Event kinds, in the order they apply at equal times: an atomicMax reaching the counter goes
# before a claim issued at the same moment by the same CTA (the kernel issues them in that order
# to one address).
_ITEM, _MAX, _ISSUE, _ASSIGN = 0, 1, 2, 3


def makespan(items: list[tuple], ctas: int, claim: float, read: float, lead: float) -> float:
    """Finish time of the last CTA. A claim issued at T takes the counter's value at T + claim/2
    (when it reaches L2) and returns its item, offsets read, at T + claim + read."""
    counter = min(ctas, len(items))
    events: list[tuple] = []
    busy_until = [0.0] * ctas
    end = 0.0
    for c in range(counter):  # item c is CTA c's first, taken without a claim
        heapq.heappush(events, (read, _ITEM, c, c))
    while events:
        now, kind, c, val = heapq.heappop(events)
        if kind == _MAX:
            counter = max(counter, val)
        elif kind == _ISSUE:
            heapq.heappush(events, (now + claim / 2, _ASSIGN, c, now))
        elif kind == _ASSIGN:
            if counter >= len(items):
                end = max(end, busy_until[c])
                continue
            heapq.heappush(events, (val + claim + read, _ITEM, c, counter))
            counter += 1
        elif items[val][0] == DEAD:
            if items[val][1] > val + 1:
                heapq.heappush(events, (now + claim / 2, _MAX, c, items[val][1]))
            heapq.heappush(events, (now, _ISSUE, c, 0))
        else:
            busy_until[c] = max(now, busy_until[c]) + items[val][1]
            heapq.heappush(events, (max(now, busy_until[c] - lead), _ISSUE, c, 0))
    return end


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mix", choices=("uniform", "skewed"), default="skewed")
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--ctas", type=int, default=132)
    p.add_argument("--claim", type=float, default=0.2, help="claim round trip, KV blocks")
    p.add_argument("--read", type=float, default=0.15, help="reading a sequence's offsets, KV blocks")
    p.add_argument("--lead", type=float, default=2.0, help="blocks before a tile's end at which the next claim starts")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_varlen import HIDDEN, lengths_of

    lengths = lengths_of(args.mix)
    heads = HIDDEN // args.hdim
    others = [n for i, n in enumerate(lengths) if i != lengths.index(max(lengths))]
    results = {}
    for order in ("padded", "per_sequence", "live_only"):
        items = items_of(lengths, heads, args.hdim, args.causal, order)
        live = sum(x[1] for x in items if x[0] == LIVE)
        results[order] = (makespan(items, args.ctas, args.claim, args.read, args.lead), live / args.ctas,
                          sum(1 for x in items if x[0] == DEAD))
    parts = sum(makespan(items_of(ls, heads, args.hdim, args.causal, "padded"), args.ctas, args.claim, args.read,
                         args.lead) for ls in ([max(lengths)], others))
    print(f"{args.mix} hdim {args.hdim} {'causal' if args.causal else 'full'}: {len(lengths)} sequences, "
          f"claim {args.claim}, read {args.read}, lead {args.lead} blocks")
    for order, (span, ideal, dead) in results.items():
        print(f"  {order:<13} makespan {span:8.1f} blocks  / ideal {span / ideal:.3f}  / padded "
              f"{span / results['padded'][0]:.3f}  dead items {dead}")
    print(f"  padded mix / (longest alone + the rest alone): {results['padded'][0] / parts:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
