"""``python -m dash simulate``: run the scheduling model for one shape.

Prints a table (schedule, makespan, makespan / lower bound, mean CTA idle %, worst per-tile
turn wait, deadlock-free, portable) or, with ``--json``, only
``{"schedules": {name: {"makespan", "lower_bound", "idle_fraction", "max_wait",
"deadlock_free", "portable"}}, "problem": ..., "ctas": ..., "costs": ..., "dq_chains": ...,
"pipeline_depth": ...}`` (and ``"auto"``, the schedule deterministic auto picks, with
``--kernel``) on stdout.
``--gantt out.png`` writes a Gantt chart of the simulated schedules.

Sizes, costs and the ``--gantt`` path (and matplotlib) are checked while parsing; what needs the
whole shape (head dim vs tile config, GQA head counts, the costs file) is checked before the model
runs. Either way bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from dash.cli import (chart_file, input_file, int_at_least, nonnegative_float, nonnegative_int, positive_int,
                      usage_error)
from dash.config import SUPPORTED_HEAD_DIMS, bwd_tile_config
from dash.schedules.calibrate import load_costs
from dash.schedules.orders import SCHEDULE_NAMES, make_plan
from dash.schedules.simulate import Costs, SimResult, replay_claims, simulate
from dash.schedules.tiling import Problem, paper_problem


def _int_list(text: str) -> tuple[int, ...]:
    """Comma-separated sequence lengths (0 is allowed: an empty sequence in a varlen batch)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a comma-separated list of lengths >= 0")
    return values


#: ``--window`` sides: -1 is unbounded, smaller values mean nothing.
_window_side = int_at_least(-1, " (-1 = unbounded)")


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``simulate`` options to ``parser``."""
    g = parser.add_argument_group("shape")
    g.add_argument("--seqlen", type=positive_int, required=True,
                   help="query length (and key length unless --seqlen-k)")
    g.add_argument("--seqlen-k", type=positive_int, default=None, help="key length (default: --seqlen)")
    g.add_argument("--hdim", type=positive_int, required=True,
                   help=f"head dim: {', '.join(map(str, SUPPORTED_HEAD_DIMS))} (picks the tile sizes from "
                        "dash.config), or any with --block-m and --block-n")
    g.add_argument("--causal", action="store_true", help="causal mask (bottom-right aligned)")
    g.add_argument("--window", type=_window_side, nargs=2, metavar=("LEFT", "RIGHT"), default=None,
                   help="sliding window (-1 = unbounded side)")
    g.add_argument("--batch", type=positive_int, default=None, help="batch (default: max(1, 16384 // seqlen))")
    g.add_argument("--heads", type=positive_int, default=None, help="query heads (default: 2048 // hdim)")
    g.add_argument("--heads-kv", type=positive_int, default=None, help="KV heads for GQA (default: --heads)")
    g.add_argument("--varlen-q", type=_int_list, default=None, metavar="L0,L1,..",
                   help="per-sequence query lengths (varlen; sets the batch)")
    g.add_argument("--varlen-k", type=_int_list, default=None, metavar="L0,L1,..",
                   help="per-sequence key lengths (varlen; default: the query lengths)")
    g.add_argument("--block-m", type=positive_int, default=None, help="override kBlockM")
    g.add_argument("--block-n", type=positive_int, default=None, help="override kBlockN")
    s = parser.add_argument_group("schedule and costs")
    s.add_argument("--ctas", type=positive_int, default=132,
                   help="persistent grid size the schedules are planned for")
    s.add_argument("--schedule", default="all",
                   help=f"one of {', '.join(SCHEDULE_NAMES)}, a comma-separated list, or 'all'")
    s.add_argument("--portable", action="store_true",
                   help="plan shift / symmetric_shift as their portable (team-dispatched) variants")
    s.add_argument("--kernel", action="store_true",
                   help="model DASH's kernel as deterministic auto does: its calibrated costs, dQ chains and "
                        "pipeline depth for --hdim and the mask (instead of --c/--r/--latency/--c-partial/--costs/"
                        "--pipeline-depth/--dq-chains), and print the schedule auto picks for this shape")
    s.add_argument("--c", type=nonnegative_float, default=1.0, help="compute cost of one step on a full tile")
    s.add_argument("--r", type=nonnegative_float, default=0.3, help="cost of one serialized dQ reduce-add")
    s.add_argument("--latency", type=nonnegative_float, default=0.0, help="semaphore hand-off latency")
    s.add_argument("--c-partial", type=nonnegative_float, default=None,
                   help="compute cost on a diagonal tile (default --c)")
    s.add_argument("--costs", type=input_file, default=None, metavar="JSON",
                   help="costs file from dash.schedules.calibrate.save_costs (overrides --c/--r/...)")
    s.add_argument("--pipeline-depth", type=nonnegative_int, default=1,
                   help="steps compute may run ahead of the dQ writer (0 = no overlap)")
    s.add_argument("--dq-chains", type=positive_int, default=1,
                   help="independent accumulation chains per dQ tile: turn t waits for turn t - N "
                        "(1: the paper's model; DASH's kernel uses dq_chains of dash.config, 2 under a causal mask)")
    s.add_argument("--kv-chains", type=positive_int, default=1,
                   help="GQA: dK/dV accumulation chains of a KV group: query head j waits for head j - N, the "
                        "group's last head for every chain (1: ascending head order; DASH's kernel uses "
                        "dkv_chains of dash.config, at most heads per KV head - 1)")
    o = parser.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print JSON only")
    o.add_argument("--gantt", type=chart_file, default=None, metavar="PNG",
                   help="write a Gantt chart (.png, .pdf, .svg; needs matplotlib)")
    o.add_argument("--gantt-ctas", type=positive_int, default=None,
                   help="show only the first N CTAs in the Gantt chart")


def problem_from_args(args: argparse.Namespace) -> Problem:
    """The ``Problem`` an argument namespace describes (paper batch/heads convention)."""
    window = tuple(args.window) if args.window else (-1, -1)
    causal = bool(args.causal)
    kw = dict(heads_kv=args.heads_kv, window=window, block_m=args.block_m, block_n=args.block_n)
    if args.varlen_q or args.varlen_k:
        lq = args.varlen_q or args.varlen_k
        lk = args.varlen_k or lq
        if len(lq) != len(lk):
            raise ValueError(f"argument --varlen-k: {len(lk)} lengths for the {len(lq)} of --varlen-q; "
                             "give one per sequence")
        heads = _query_heads(args)
        return Problem(len(lq), heads, max(lq), max(lk), args.hdim, causal=causal,
                       seqlens_q=lq, seqlens_k=lk, **kw)
    return paper_problem(args.seqlen, args.hdim, causal, seqlen_k=args.seqlen_k, batch=args.batch,
                         heads=args.heads, **kw)


def bound_ratio(res: SimResult) -> float:
    """Makespan / lower bound; 1 for an empty problem or zero costs (both are 0)."""
    if res.lower_bound > 0:
        return res.makespan / res.lower_bound
    return 1.0 if res.makespan == 0 else math.inf


def _query_heads(args: argparse.Namespace) -> int:
    """``--heads``, or the paper convention (hidden 2048)."""
    return args.heads if args.heads is not None else max(1, 2048 // args.hdim)


def _check_combinations(args: argparse.Namespace) -> None:
    """What the parser cannot check option by option; raise ValueError naming the options."""
    if args.block_m is None or args.block_n is None:
        # Without both tile sizes the model takes them from the kernel's config table.
        try:
            bwd_tile_config(args.hdim, bool(args.causal))
        except NotImplementedError as e:
            raise ValueError(f"argument --hdim: {e} (other head dims: give --block-m and --block-n)") from None
    heads = _query_heads(args)
    if args.heads_kv is not None and heads % args.heads_kv:
        raise ValueError(f"argument --heads-kv: {args.heads_kv} does not divide the {heads} query heads (--heads)")
    if args.causal and args.window and args.window[1] not in (-1, 0):
        raise ValueError(f"argument --window: right side {args.window[1]} with --causal, which means a right "
                         "window of 0; leave out --causal or use RIGHT 0")
    if args.ctas < 1:  # also for namespaces built without the parser
        raise ValueError(f"argument --ctas: {args.ctas} is not a positive integer")
    if args.pipeline_depth < 0:
        raise ValueError(f"argument --pipeline-depth: {args.pipeline_depth} is not a non-negative integer")
    if getattr(args, "kernel", False) and args.costs:
        raise ValueError("argument --kernel: uses the kernel's calibrated costs; leave out --costs")


def _schedules(text: str) -> list[str]:
    if text == "all":
        return list(SCHEDULE_NAMES)
    names = [s.strip() for s in text.split(",") if s.strip()]
    for n in names:
        if n not in SCHEDULE_NAMES:
            raise ValueError(f"argument --schedule: {n!r} is unknown; known: {', '.join(SCHEDULE_NAMES)}, all")
    if not names:
        raise ValueError(f"argument --schedule: {text!r} names no schedule; known: {', '.join(SCHEDULE_NAMES)}, all")
    return names


def _costs(args: argparse.Namespace) -> Costs:
    """``--costs FILE`` if given, else the cost options."""
    if not args.costs:
        return Costs(c=args.c, r=args.r, latency=args.latency, c_partial=args.c_partial)
    try:
        return load_costs(args.costs)
    except (OSError, ValueError, TypeError) as e:  # unreadable, not JSON, unknown keys, negative costs
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        raise ValueError(f"argument --costs: {args.costs} is not a costs file from "
                         f"dash.schedules.calibrate.save_costs ({why})") from None


def _kernel_model(args: argparse.Namespace, problem: Problem) -> tuple[Costs, int, int, int, str | None]:
    """``--kernel``: costs, pipeline depth, dQ and dK/dV chains of DASH's kernel for the shape's
    head dim, mask and KV groups, and what deterministic ``auto`` picks (None for varlen or a
    window: auto sees neither)."""
    from dash.schedules.auto import (choose_kernel_schedule, kernel_costs, kernel_dkv_chains, kernel_dq_chains,
                                     kernel_pipeline_depth)

    causal = problem.mask == "causal"
    pick = None
    if not (args.varlen_q or args.varlen_k or args.window):
        pick = choose_kernel_schedule(problem.batch, problem.heads_q, problem.heads_kv, problem.seqlen_q,
                                      problem.seqlen_k, args.hdim, causal, args.ctas)
    return (kernel_costs(args.hdim, causal), kernel_pipeline_depth(args.hdim, causal),
            kernel_dq_chains(args.hdim, causal),
            kernel_dkv_chains(args.hdim, causal, problem.heads_q // problem.heads_kv), pick)


def run_simulate(args: argparse.Namespace) -> int:
    """Run the model; return 0 if every schedule is deadlock-free, 1 otherwise, 2 on bad input."""
    try:
        _check_combinations(args)
        problem = problem_from_args(args)
        names = _schedules(args.schedule)
        costs = _costs(args)
    except (ValueError, NotImplementedError) as e:
        return usage_error("simulate", str(e))
    auto_pick = None
    if getattr(args, "kernel", False):
        costs, args.pipeline_depth, args.dq_chains, args.kv_chains, auto_pick = _kernel_model(args, problem)
    results: dict[str, SimResult] = {}
    errors: dict[str, str] = {}
    for name in names:
        try:
            plan = make_plan(problem, name, args.ctas, portable=args.portable)
        except ValueError as e:
            errors[name] = str(e)
            continue
        results[name] = simulate(plan, costs, args.pipeline_depth, chains=args.dq_chains, kv_chains=args.kv_chains)
    # --kernel: what auto ranks by, the claimed schedules' claims replayed in simulated time
    # (the table above hands them out at plan time).
    replayed: dict[str, float] = {}
    if getattr(args, "kernel", False):
        for name, res in results.items():
            if res.deadlock_free and res.plan.claimed:
                replayed[name] = replay_claims(res.plan, costs, args.pipeline_depth, chains=args.dq_chains,
                                               kv_chains=args.kv_chains).makespan

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
        out["dq_chains"] = args.dq_chains
        out["kv_chains"] = args.kv_chains
        out["pipeline_depth"] = args.pipeline_depth
        if getattr(args, "kernel", False):
            out["auto"] = auto_pick
            out["replayed_makespan"] = replayed
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(f"DASH scheduling model: {problem.describe()}; {args.ctas} CTAs; "
              f"costs c={costs.c:g} r={costs.r:g} latency={costs.latency:g}; pipeline depth {args.pipeline_depth}; "
              f"dQ chains {args.dq_chains}" + (f"; dK/dV chains {args.kv_chains}"
                                                 if problem.heads_q > problem.heads_kv else ""))
        print(f"{'schedule':<16} {'makespan':>10} {'/ bound':>8} {'idle %':>7} {'worst wait':>11} "
              f"{'deadlock-free':>14} {'portable':>9}")
        for name in names:
            if name not in results:
                print(f"{name:<16} {'n/a':>10}  ({errors[name]})")
                continue
            r = results[name]
            port = "yes" if r.plan.portable else "no"
            if r.deadlock_free:
                print(f"{name:<16} {r.makespan:>10.1f} {bound_ratio(r):>8.3f} {100 * r.mean_idle:>7.1f} "
                      f"{r.max_wait:>11.1f} {'yes':>14} {port:>9}")
            else:
                print(f"{name:<16} {'-':>10} {'-':>8} {'-':>7} {'-':>11} {'NO':>14} {port:>9}")
        if replayed:
            print("makespan with the claims replayed in simulated time (auto ranks that, on its part of the "
                  "problem and grid, plus the dQ convert): " + ", ".join(f"{n} {m:.1f}" for n, m in replayed.items()))
        if auto_pick is not None:
            from dash.schedules.auto import AUTO_MAX_WAVES, AUTO_REFERENCE_CTAS, SHORT_CAUSAL_FA3_MAX_SEQLEN

            print(f"deterministic auto picks {auto_pick} (it ranks fa3, interleaved and descending, under a causal "
                  f"mask fa3 and descending, on at most {AUTO_MAX_WAVES} waves of a {AUTO_REFERENCE_CTAS}-CTA grid, "
                  "claims replayed, plus the dQ convert its tail does not absorb: its ranking can differ from "
                  "the whole problem's above; causal rows of at most "
                  f"{SHORT_CAUSAL_FA3_MAX_SEQLEN} tokens take fa3 without the model, as measured)")
    rc = 0 if all(r.deadlock_free for r in results.values()) else 1
    if args.gantt:
        rc = max(rc, _write_gantt(args, problem, costs, results))
    return rc


def _write_gantt(args: argparse.Namespace, problem: Problem, costs: Costs, results: dict[str, SimResult]) -> int:
    """Draw ``--gantt`` (its path and matplotlib were checked while parsing); 0 if written, else 1."""
    from dash.schedules.gantt import plot_gantt

    if not any(r.deadlock_free for r in results.values()):
        print(f"python -m dash simulate: --gantt {args.gantt} not written: no schedule was simulated deadlock-free",
              file=sys.stderr)
        return 1
    try:
        plot_gantt(results, args.gantt, title=f"{problem.describe()}; {args.ctas} CTAs; c={costs.c:g}, r={costs.r:g}",
                   max_ctas=args.gantt_ctas)
    except OSError as e:  # checked before the run, but the disk may still fill or the folder go away
        print(f"python -m dash simulate: --gantt {args.gantt} not written: {e.strerror or e}", file=sys.stderr)
        return 1
    if not args.json:
        print(f"Gantt chart written to {args.gantt}")
    return 0
