"""The model ``auto`` ranks by (claims in simulated time) beside the plans' static dispatch.

    python tools/model_dynamic_claims.py --hdim 128 --seqlen 256 512 768 1024 2048 4096 8192 16384
    python tools/model_dynamic_claims.py --hdim 128 --causal --seqlen 2048 4096 8192 16384

The plans (``dash.schedules.orders``) give every claimed column its CTA at plan time, by list
scheduling on step counts: under a full mask every column has the same length, so CTA ``k``
runs items ``k, k + ctas, ...`` and the columns of one head start together in every wave,
whatever the claim order. The kernel's CTAs claim from an atomic counter when they finish a
column, so once turn waits have spread their finishing times, the claim order decides how far
apart a head's columns start: ``interleaved`` claims one column of each head of an L2 section
before the next column (columns of a head ``section_heads`` claims apart), ``fa3`` the columns
of a head back to back. ``dash.schedules.simulate.replay_claims`` replays the plans that way,
and since 2026-12-06 ``auto`` ranks by it (``rank_kernel_schedules``); ``simulate`` keeps the
static dispatch (the deadlock proofs, the Gantt charts of ``python -m dash schedules``).

Per row it prints, for each schedule, as a ratio to the first schedule's: the time ``auto``
ranks by (replayed makespan plus the dQ convert its tail does not absorb), the same on the
static dispatch (``auto`` before), and the two makespans alone. Kernel notes, thirty-seventh
and thirty-eighth passes, compare them with measured runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dash.schedules.auto import auto_simulation, end_with_dq_convert, kernel_candidates  # noqa: E402
from dash.schedules.orders import make_plan  # noqa: E402
from dash.schedules.simulate import replay_claims, simulate  # noqa: E402


def compare(seqlen: int, head_dim: int, causal: bool, ctas: int = 132, schedules: tuple[str, ...] | None = None,
            tokens: int = 16384, hidden: int = 2048, heads_kv: int | None = None) -> dict[str, dict[str, float]]:
    """Per schedule, for the part of the paper-grid problem (``tokens`` per batch, ``hidden``
    query channels) that ``auto`` simulates (``auto_simulation``: whole KV groups, at most
    ``AUTO_MAX_WAVES`` waves): ``auto_end`` (replayed claims + convert, what ``auto`` ranks by),
    ``static_end`` (static dispatch + convert), ``static`` and ``dynamic`` (the two makespans)."""
    batch, heads = max(1, tokens // seqlen), hidden // head_dim
    sim = auto_simulation(batch, heads, heads if heads_kv is None else heads_kv, seqlen, seqlen, head_dim, causal,
                          ctas)
    out = {}
    for name in schedules or kernel_candidates(causal):
        plan = make_plan(sim.part, name, ctas, section_heads=sim.section_heads)
        res = simulate(plan, sim.costs, sim.depth, chains=sim.chains, kv_chains=sim.kv_chains)
        rep = replay_claims(plan, sim.costs, sim.depth, chains=sim.chains, kv_chains=sim.kv_chains)
        out[name] = {"auto_end": end_with_dq_convert(rep.makespan, rep.cta_last, sim.convert_us),
                     "static_end": end_with_dq_convert(float(res.makespan), res.cta_last, sim.convert_us),
                     "static": float(res.makespan), "dynamic": rep.makespan}
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
        cells = [f"{n}: auto {r['auto_end'] / ref['auto_end']:.3f} (static dispatch "
                 f"{r['static_end'] / ref['static_end']:.3f}) makespan replayed {r['dynamic'] / ref['dynamic']:.3f} "
                 f"static {r['static'] / ref['static']:.3f}" for n, r in res.items() if n != names[0]]
        gqa = f" {2048 // args.hdim}/{args.heads_kv}" if args.heads_kv else ""
        print(f"hd{args.hdim} {'causal' if args.causal else 'full'} {s}{gqa}: time / {names[0]}'s  " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
