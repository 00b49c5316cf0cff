"""The scheduling model with claims handed out in simulated time, beside the model ``auto`` uses.

    python tools/model_dynamic_claims.py --hdim 128 --seqlen 256 512 768 1024 2048 4096 8192 16384
    python tools/model_dynamic_claims.py --hdim 128 --causal --seqlen 2048 4096 8192 16384

An experiment, not used by ``schedule="auto"``. The model's plans (``dash.schedules.orders``)
give every claimed column its CTA at plan time, by list scheduling on step counts: under a full
mask every column has the same length, so CTA ``k`` runs items ``k, k + ctas, ...`` and the
columns of one head start together in every wave, whatever the claim order. The kernel's CTAs
claim from an atomic counter when they finish a column, so once turn waits have spread their
finishing times, the claim order decides how far apart a head's columns start: ``interleaved``
claims one column of each head of an L2 section before the next column (columns of a head
``section_heads`` claims apart), ``fa3`` the columns of a head back to back. Here the same
plans are replayed with every claim going to the CTA that frees first in simulated time
(dK/dV epilogue end), with the step, reduce-add, turn and staging-buffer rules of
``dash.schedules.simulate``, GQA's dK/dV chains included (``simulate.kv_links``).

Per row it prints, for each schedule, the time ``auto`` ranks by (makespan plus the dQ convert
its tail does not absorb), the static makespan, and the makespan with claims in simulated time,
each as a ratio to the first schedule's. Kernel notes, thirty-seventh pass, compare both with
measured runs.
"""

from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dash.schedules.auto import auto_simulation, end_with_dq_convert, kernel_candidates  # noqa: E402
from dash.schedules.orders import Plan, make_plan  # noqa: E402
from dash.schedules.simulate import Costs, kv_links, simulate  # noqa: E402


def claim_order(plan: Plan) -> list[tuple[int, int, int]]:
    """The columns ``(b, h, n)`` in the order the plan's list scheduling claims them: by the
    load (steps + 1 per column) of the claiming CTA, then CTA index, as ``orders._claim`` pops
    them."""
    items = []
    for x in range(plan.ctas):
        load = 0
        for b, h, n in plan.work_list(x):
            items.append((load, x, (b, h, n)))
            load += len(plan.visit(b, h, n)) + 1
    items.sort()
    return [col for _, _, col in items]


def dynamic_claim_makespan(plan: Plan, costs: Costs, depth: int, chains: int, kv_chains: int = 1) -> float:
    """Makespan of ``plan``'s columns claimed in its claim order by whichever CTA frees first.

    Per CTA: step ``k``'s compute starts when step ``k - 1``'s ended and the reduce-add of step
    ``k - 1 - depth`` (the CTA's steps in order, across columns) ended; its reduce-add starts
    when its compute ended, the CTA's previous reduce-add ended and the add ``chains`` turns
    before it on the same dQ tile ended plus ``latency``; after a column's last compute the
    epilogue runs (``epilogue + r_kv``), under GQA once the dK/dV adds it waits for
    (``kv_links(plan, kv_chains)``) ended plus ``latency``, and its end is when the CTA claims
    again. Raises if a wait points to a column claimed after it (no portable schedule's does)."""
    class_cost = costs.class_costs()
    kv_pred, _ = kv_links(plan, kv_chains)
    col_index = plan.column_index()
    epilogue_end: dict[int, float] = {}
    free = [(0.0, x) for x in range(plan.ctas)]
    heapq.heapify(free)
    reduce_end: dict[tuple[int, int, int, int], float] = {}
    history: list[list[float]] = [[] for _ in range(plan.ctas)]  # reduce-add ends per CTA, in order
    last = 0.0
    for b, h, n in claim_order(plan):
        t_free, x = heapq.heappop(free)
        hist = history[x]
        compute_end = t_free
        writer_end = hist[-1] if hist else 0.0
        for m in plan.visit(b, h, n):
            start = compute_end
            j = len(hist) - 1 - depth
            if j >= 0 and hist[j] > start:
                start = hist[j]
            compute_end = start + class_cost[plan.tiling.tile_class[b, m, n]]
            turn = int(plan.turn[b, h, m, n])
            red_start = max(compute_end, writer_end)
            if turn >= chains:
                prev = reduce_end.get((b, h, m, turn - chains))
                if prev is None:
                    raise RuntimeError(f"column {(b, h, n)}: the add before turn {turn} of Q tile {m} is claimed later")
                red_start = max(red_start, prev + costs.latency)
            writer_end = red_start + costs.r
            reduce_end[(b, h, m, turn)] = writer_end
            hist.append(writer_end)
        col = int(col_index[b, h, n])
        epi_start = compute_end
        for pcol in kv_pred[col]:
            if pcol < 0:
                continue
            prev = epilogue_end.get(int(pcol))
            if prev is None:
                raise RuntimeError(f"column {(b, h, n)}: the dK/dV add it waits for is claimed later")
            epi_start = max(epi_start, prev + costs.latency)
        done = epi_start + costs.epilogue + costs.r_kv
        epilogue_end[col] = done
        last = max(last, done, writer_end)
        heapq.heappush(free, (done, x))
    return last


def compare(seqlen: int, head_dim: int, causal: bool, ctas: int = 132, schedules: tuple[str, ...] | None = None,
            tokens: int = 16384, hidden: int = 2048, heads_kv: int | None = None) -> dict[str, dict[str, float]]:
    """Per schedule: ``auto``'s ranking time, the static makespan and the dynamic-claim makespan
    of the part of the paper-grid problem (``tokens`` per batch, ``hidden`` query channels)
    that ``auto`` simulates (``auto_simulation``: whole KV groups, at most ``AUTO_MAX_WAVES``
    waves)."""
    batch, heads = max(1, tokens // seqlen), hidden // head_dim
    sim = auto_simulation(batch, heads, heads if heads_kv is None else heads_kv, seqlen, seqlen, head_dim, causal,
                          ctas)
    out = {}
    for name in schedules or kernel_candidates(causal):
        plan = make_plan(sim.part, name, ctas, section_heads=sim.section_heads)
        res = simulate(plan, sim.costs, sim.depth, chains=sim.chains, kv_chains=sim.kv_chains)
        out[name] = {"auto_end": end_with_dq_convert(res, sim.convert_us), "static": float(res.makespan),
                     "dynamic": dynamic_claim_makespan(plan, sim.costs, sim.depth, sim.chains, sim.kv_chains)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seqlen", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--schedules", nargs="+", default=None, help="default: auto's candidates for the mask")
    ap.add_argument("--ctas", type=int, default=132)
    ap.add_argument("--heads-kv", type=int, default=None, help="KV heads (GQA; default: as many as query heads)")
    args = ap.parse_args(argv)
    for s in args.seqlen:
        res = compare(s, args.hdim, args.causal, args.ctas, tuple(args.schedules) if args.schedules else None,
                      heads_kv=args.heads_kv)
        names = list(res)
        ref = res[names[0]]
        cells = [f"{n}: auto {r['auto_end'] / ref['auto_end']:.3f} static {r['static'] / ref['static']:.3f} "
                 f"dynamic {r['dynamic'] / ref['dynamic']:.3f}" for n, r in res.items() if n != names[0]]
        gqa = f" {2048 // args.hdim}/{args.heads_kv}" if args.heads_kv else ""
        print(f"hd{args.hdim} {'causal' if args.causal else 'full'} {s}{gqa}: time / {names[0]}'s  " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
