"""``python -m dash simulate``: run the scheduling model for one shape.

Prints a table (schedule, makespan, makespan / lower bound, mean CTA idle %, worst per-tile
turn wait, deadlock-free, portable) or, with ``--json``, only
``{"schedules": {name: {"makespan", "lower_bound", "idle_fraction", "max_wait",
"deadlock_free", "portable"}}, "problem": ..., "ctas": ..., "costs": ...}`` on stdout.
``--gantt out.png`` writes a Gantt chart of the simulated schedules.
"""

from __future__ import annotations

import argparse
import json
import sys

from dash.schedules.calibrate import load_costs
from dash.schedules.orders import SCHEDULE_NAMES, make_plan
from dash.schedules.simulate import Costs, SimResult, simulate
from dash.schedules.tiling import Problem, paper_problem


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``simulate`` options to ``parser``."""
    g = parser.add_argument_group("shape")
    g.add_argument("--seqlen", type=int, required=True, help="query length (and key length unless --seqlen-k)")
    g.add_argument("--seqlen-k", type=int, default=None, help="key length (default: --seqlen)")
    g.add_argument("--hdim", type=int, required=True, help="head dim (picks the tile sizes from dash.config)")
    g.add_argument("--causal", action="store_true", help="causal mask (bottom-right aligned)")
    g.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"), default=None,
                   help="sliding window (-1 = unbounded side)")
    g.add_argument("--batch", type=int, default=None, help="batch (default: max(1, 16384 // seqlen))")
    g.add_argument("--heads", type=int, default=None, help="query heads (default: 2048 // hdim)")
    g.add_argument("--heads-kv", type=int, default=None, help="KV heads for GQA (default: --heads)")
    g.add_argument("--varlen-q", type=_int_list, default=None, metavar="L0,L1,..",
                   help="per-sequence query lengths (varlen; sets the batch)")
    g.add_argument("--varlen-k", type=_int_list, default=None, metavar="L0,L1,..",
                   help="per-sequence key lengths (varlen; default: the query lengths)")
    g.add_argument("--block-m", type=int, default=None, help="override kBlockM")
    g.add_argument("--block-n", type=int, default=None, help="override kBlockN")
    s = parser.add_argument_group("schedule and costs")
    s.add_argument("--ctas", type=int, default=132, help="persistent grid size the schedules are planned for")
    s.add_argument("--schedule", default="all",
                   help=f"one of {', '.join(SCHEDULE_NAMES)}, a comma-separated list, or 'all'")
    s.add_argument("--portable", action="store_true",
                   help="plan shift / symmetric_shift / causal descending as their portable variants")
    s.add_argument("--c", type=float, default=1.0, help="compute cost of one step on a full tile")
    s.add_argument("--r", type=float, default=0.3, help="cost of one serialized dQ reduce-add")
    s.add_argument("--latency", type=float, default=0.0, help="semaphore hand-off latency")
    s.add_argument("--c-partial", type=float, default=None, help="compute cost on a diagonal tile (default --c)")
    s.add_argument("--costs", default=None, metavar="JSON",
                   help="costs file from dash.schedules.calibrate.save_costs (overrides --c/--r/...)")
    s.add_argument("--pipeline-depth", type=int, default=1,
                   help="steps compute may run ahead of the dQ writer (0 = no overlap)")
    o = parser.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print JSON only")
    o.add_argument("--gantt", default=None, metavar="PNG", help="write a Gantt chart (needs matplotlib)")
    o.add_argument("--gantt-ctas", type=int, default=None, help="show only the first N CTAs in the Gantt chart")


def problem_from_args(args: argparse.Namespace) -> Problem:
    """The ``Problem`` an argument namespace describes (paper batch/heads convention)."""
    window = tuple(args.window) if args.window else (-1, -1)
    causal = bool(args.causal)
    kw = dict(heads_kv=args.heads_kv, window=window, block_m=args.block_m, block_n=args.block_n)
    if args.varlen_q or args.varlen_k:
        lq = args.varlen_q or args.varlen_k
        lk = args.varlen_k or lq
        if len(lq) != len(lk):
            raise ValueError(f"--varlen-q has {len(lq)} lengths, --varlen-k {len(lk)}")
        heads = args.heads if args.heads is not None else max(1, 2048 // args.hdim)
        return Problem(len(lq), heads, max(lq), max(lk), args.hdim, causal=causal,
                       seqlens_q=lq, seqlens_k=lk, **kw)
    return paper_problem(args.seqlen, args.hdim, causal, seqlen_k=args.seqlen_k, batch=args.batch,
                         heads=args.heads, **kw)


def _schedules(text: str) -> list[str]:
    if text == "all":
        return list(SCHEDULE_NAMES)
    names = [s.strip() for s in text.split(",") if s.strip()]
    for n in names:
        if n not in SCHEDULE_NAMES:
            raise ValueError(f"--schedule {n!r} is unknown; known: {', '.join(SCHEDULE_NAMES)}, all")
    return names


def run_simulate(args: argparse.Namespace) -> int:
    """Run the model; return 0 if every schedule is deadlock-free, 1 otherwise, 2 on bad input."""
    try:
        problem = problem_from_args(args)
        names = _schedules(args.schedule)
        costs = load_costs(args.costs) if args.costs else Costs(c=args.c, r=args.r, latency=args.latency,
                                                               c_partial=args.c_partial)
        if args.ctas < 1:
            raise ValueError(f"--ctas={args.ctas} must be >= 1")
        if args.pipeline_depth < 0:
            raise ValueError(f"--pipeline-depth={args.pipeline_depth} must be >= 0")
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results: dict[str, SimResult] = {}
    errors: dict[str, str] = {}
    for name in names:
        try:
            plan = make_plan(problem, name, args.ctas, portable=args.portable)
        except ValueError as e:
            errors[name] = str(e)
            continue
        results[name] = simulate(plan, costs, args.pipeline_depth)

    if args.json:
        out = {"schedules": {}}
        for name in names:
            if name in results:
                out["schedules"][name] = results[name].summary()
            else:
                out["schedules"][name] = {"makespan": None, "lower_bound": None, "idle_fraction": None,
                                          "max_wait": None, "deadlock_free": None, "portable": None,
                                          "error": errors[name]}
        out["problem"] = problem.describe()
        out["ctas"] = args.ctas
        out["costs"] = costs.as_dict()
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(f"DASH scheduling model: {problem.describe()}; {args.ctas} CTAs; "
              f"costs c={costs.c:g} r={costs.r:g} latency={costs.latency:g}; pipeline depth {args.pipeline_depth}")
        print(f"{'schedule':<16} {'makespan':>10} {'/ bound':>8} {'idle %':>7} {'worst wait':>11} "
              f"{'deadlock-free':>14} {'portable':>9}")
        for name in names:
            if name not in results:
                print(f"{name:<16} {'n/a':>10}  ({errors[name]})")
                continue
            r = results[name]
            port = "yes" if r.plan.portable else "no"
            if r.deadlock_free:
                print(f"{name:<16} {r.makespan:>10.1f} {r.makespan / r.lower_bound:>8.3f} {100 * r.mean_idle:>7.1f} "
                      f"{r.max_wait:>11.1f} {'yes':>14} {port:>9}")
            else:
                print(f"{name:<16} {'-':>10} {'-':>8} {'-':>7} {'-':>11} {'NO':>14} {port:>9}")
    if args.gantt:
        from dash.schedules.gantt import plot_gantt

        plot_gantt(results, args.gantt, title=f"{problem.describe()}; {args.ctas} CTAs; c={costs.c:g}, r={costs.r:g}",
                   max_ctas=args.gantt_ctas)
        if not args.json:
            print(f"Gantt chart written to {args.gantt}")
    return 0 if all(r.deadlock_free for r in results.values()) else 1
