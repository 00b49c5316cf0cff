"""``python -m dash``: info, bench and simulate."""

from __future__ import annotations

import argparse
import sys


def _cmd_info(args: argparse.Namespace) -> int:
    from dash import _info

    return _info.run(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from dash import _bench

    return _bench.run(args)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from dash.schedules import cli as sched_cli

    return sched_cli.run_simulate(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p_info = sub.add_parser("info", help="what was built, and which GPU is present")
    p_info.add_argument("--json", action="store_true", help="print the manifest and GPU as JSON")
    p_info.set_defaults(func=_cmd_info)

    p_bench = sub.add_parser("bench", help="time the backward in every mode on a training shape")
    from dash import _bench

    _bench.add_arguments(p_bench)
    p_bench.set_defaults(func=_cmd_bench)

    p_sim = sub.add_parser("simulate", help="run the scheduling model for a shape")
    from dash.schedules import cli as sched_cli

    sched_cli.add_simulate_arguments(p_sim)
    p_sim.set_defaults(func=_cmd_simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.func(args) or 0)
