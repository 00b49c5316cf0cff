"""``python -m dash``: info, bench, simulate, plot, trace and profile.

Bad input gets one line on stderr that names the argument, the value and what is supported
(exit code 2, as argparse uses for usage errors), never a traceback. Sizes, paths and optional
dependencies are checked while the arguments are parsed, before any work starts; the argument
types below are shared by the subcommands' parsers.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable, NoReturn

#: What to install for ``--gantt`` and ``plot`` (matplotlib is in the ``plot`` extra only).
MATPLOTLIB_HINT = "pip install matplotlib (or pip install 'dash-attention[plot]')"


# ---------------------------------------------------------------------------------------
# Argument types: each raises ArgumentTypeError, which argparse turns into
# "argument --seqlen: 0 is not a positive integer".
# ---------------------------------------------------------------------------------------
def int_at_least(lo: int, why: str = "") -> Callable[[str], int]:
    """An argparse ``type=`` accepting integers ``>= lo`` (``why`` is appended to the error)."""
    wanted = {0: "a non-negative integer", 1: "a positive integer"}.get(lo, f"an integer >= {lo}")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lo:
            raise argparse.ArgumentTypeError(f"{text} is not {wanted}{why}")
        return value

    parse.__name__ = f"int_at_least_{lo}"
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def nonnegative_float(text: str) -> float:
    """An argparse ``type=`` for costs and latencies: a finite number ``>= 0``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a finite number >= 0")
    return value


def head_dim(text: str) -> int:
    """An argparse ``type=`` for a head dim DASH's backward kernel has a configuration for."""
    from dash.config import bwd_tile_config

    value = positive_int(text)
    try:
        bwd_tile_config(value, causal=False)  # the same message as the API's
    except NotImplementedError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def attention_dtype(text: str) -> str:
    """An argparse ``type=`` for the element type of q, k, v: ``bf16`` or ``fp16`` (torch's
    names ``bfloat16`` and ``float16`` are accepted and mapped to them)."""
    value = {"bfloat16": "bf16", "float16": "fp16"}.get(text, text)
    if value not in ("bf16", "fp16"):
        raise argparse.ArgumentTypeError(f"{text!r} is not supported; choose bf16 or fp16")
    return value


def kernel_schedule(text: str) -> str:
    """An argparse ``type=`` for a schedule the backward kernel runs: ``auto`` or one of
    ``dash.config.KERNEL_SCHEDULES`` (schedules the model alone has are refused with that said)."""
    from dash.config import KERNEL_SCHEDULES

    if text == "auto" or text in KERNEL_SCHEDULES:
        return text
    implemented = f"choose auto, {', '.join(KERNEL_SCHEDULES)}"
    from dash.schedules.orders import SCHEDULE_NAMES

    if text in SCHEDULE_NAMES:
        raise argparse.ArgumentTypeError(f"{text!r} is modelled (python -m dash simulate) but not implemented by "
                                         f"the kernel yet; {implemented}")
    raise argparse.ArgumentTypeError(f"{text!r} is not a kernel schedule; {implemented}")


def input_file(text: str) -> str:
    """An argparse ``type=`` for a file that must exist and be readable."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"file {text} does not exist")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"file {text} is not readable")
    return text


def output_path_problem(path: str) -> str | None:
    """Why ``path`` cannot be written, or None if it can (checked before the work, not after)."""
    folder = os.path.dirname(path) or "."
    if os.path.isdir(path):
        return f"cannot write {path}: it is a folder"
    if not os.path.exists(folder):
        return f"cannot write {path}: folder {folder} does not exist"
    if not os.path.isdir(folder):
        return f"cannot write {path}: {folder} is not a folder"
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            return f"cannot write {path}: the file is not writable"
    elif not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot write {path}: folder {folder} is not writable"
    return None


def matplotlib_problem() -> str | None:
    """Why matplotlib cannot be used, or None if it imports."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        if e.name == "matplotlib":
            return f"needs matplotlib, which is not installed: {MATPLOTLIB_HINT}"
        return f"needs matplotlib, which failed to import ({e}): pip install --force-reinstall matplotlib"
    return None


def chart_path_problem(path: str) -> str | None:
    """Why a chart cannot be written to ``path`` (matplotlib, file type, folder), or None."""
    why = matplotlib_problem()
    if why:
        return why
    if os.path.isdir(path):
        return output_path_problem(path)
    from matplotlib.backend_bases import FigureCanvasBase

    ext = os.path.splitext(path)[1].lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    # Without an extension matplotlib would silently write PATH.png instead of PATH.
    if not ext:
        return f"{path} has no file extension; use .png (or .pdf, .svg)"
    if ext not in formats:
        return f"matplotlib cannot write .{ext} files ({path}); use .png, .pdf or .svg (any of: {', '.join(formats)})"
    return output_path_problem(path)


def chart_file(text: str) -> str:
    """An argparse ``type=`` for a chart output path: matplotlib importable, known image type, writable."""
    why = chart_path_problem(text)
    if why:
        raise argparse.ArgumentTypeError(why)
    return text


def usage_error(command: str, message: str) -> int:
    """Print a usage error found after parsing, in argparse's one-line form; return 2."""
    print(f"python -m dash {command}: error: {message}", file=sys.stderr)
    return 2


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr, not the usage text and the error.

    Subparsers inherit the class. A short usage (the top-level command list) stays in the line.
    """

    def error(self, message: str) -> NoReturn:
        usage = " ".join(self.format_usage().split())
        hint = f" ({usage})" if len(usage) <= 80 else f"; see {self.prog} --help"
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


# ---------------------------------------------------------------------------------------
# Subcommands (imported when used: simulate and plot must not import torch)
# ---------------------------------------------------------------------------------------
def _cmd_info(args: argparse.Namespace) -> int:
    from dash import _info

    return _info.run(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from dash import _bench

    return _bench.run(args)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from dash.schedules import cli as sched_cli

    return sched_cli.run_simulate(args)


def _cmd_plot(args: argparse.Namespace) -> int:
    from dash import plot

    return plot.run(args)


def _cmd_trace(args: argparse.Namespace) -> int:
    from dash import trace

    return trace.run(args)


def _cmd_profile(args: argparse.Namespace) -> int:
    from dash import profile

    return profile.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m dash", description=__doc__.split("\n")[0])
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

    p_plot = sub.add_parser("plot", help="draw TFLOP/s and ratio charts of benchmark results (needs matplotlib)",
                            description="Per (head dim, mask): TFLOP/s against seqlen, one line per mode, and "
                                        "each mode's ratio to an anchor measured in the same run.")
    from dash import plot

    plot.add_arguments(p_plot)
    p_plot.set_defaults(func=_cmd_plot)

    p_trace = sub.add_parser("trace", help="run the backward with the kernel's trace flag: measured Gantt chart "
                                           "beside the model's, wait fractions, fitted costs (needs an sm_90 GPU)")
    from dash import trace

    trace.add_arguments(p_trace)
    p_trace.set_defaults(func=_cmd_trace)

    p_profile = sub.add_parser("profile", help="forward + backward iterations marked for nsys / ncu (profiler "
                                               "start/stop, NVTX ranges), and the command lines to profile them "
                                               "(needs an sm_90 GPU)")
    from dash import profile

    profile.add_arguments(p_profile)
    p_profile.set_defaults(func=_cmd_profile)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; return the exit status (also for usage errors and ``--help``, which argparse exits on)."""
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # so that in-process callers (tests, bench's fallback) get the status too
        return 0 if e.code is None else int(e.code)
    return int(args.func(args) or 0)
