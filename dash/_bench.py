"""``python -m dash bench``: the main job.

On an sm_90 GPU: times the backward of a default training shape in every available mode
(DASH non-deterministic, DASH deterministic per schedule, torch cuDNN / flash in the same
run), checks the deterministic modes are bitwise repeatable, prints a table. Without
one: says so and runs the scheduling model for the same shape instead.
"""

from __future__ import annotations

import argparse

from dash.cli import head_dim, int_at_least, nonnegative_int, positive_int
from dash.config import SUPPORTED_HEAD_DIMS


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``bench`` options to ``p`` (sizes are checked while parsing: one-line errors)."""
    p.add_argument("--seqlen", type=positive_int, default=4096)
    p.add_argument("--hdim", type=head_dim, default=128, help=f"head dim: {', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--batch", type=positive_int, default=None, help="default: 16384 // seqlen (16k tokens)")
    p.add_argument("--heads", type=positive_int, default=None, help="default: 2048 // hdim (hidden 2048)")
    p.add_argument("--heads-kv", type=positive_int, default=None,
                   help="key/value heads for GQA/MQA (default: --heads); must divide --heads")
    p.add_argument("--iters", type=positive_int, default=12,
                   help="timed rounds per mode, each a burst of back-to-back calls (the median is shown)")
    p.add_argument("--burst", type=positive_int, default=3,
                   help="back-to-back calls per round (default 3); 1 = one synced call per sample, which adds "
                        "the host's issue latency to every call")
    p.add_argument("--warmup", type=nonnegative_int, default=5, help="untimed calls per mode first")
    # One call compares nothing: a repeatability check needs two calls at least.
    p.add_argument("--repeats", type=int_at_least(2, " (the check compares repeated calls)"), default=10,
                   help="calls compared bitwise per deterministic mode")


def _gpu_ok() -> tuple[bool, str]:
    from dash._info import gpu_info

    gpu = gpu_info()
    if not gpu["present"]:
        return False, gpu["reason"]
    if not gpu["supported_by_dash"]:
        return False, f"{gpu['name']} has compute capability {gpu['compute_capability']}, DASH needs 9.0"
    from dash._ext import kernels_available, manifest

    if not kernels_available():
        return False, f"DASH's kernels are not available: {manifest().get('reason_not_built') or 'dash._C did not load'}"
    return True, ""


def run(args: argparse.Namespace) -> int:
    batch = args.batch or max(16384 // args.seqlen, 1)
    heads = args.heads or 2048 // args.hdim
    heads_kv = args.heads_kv or heads
    if heads % heads_kv:
        from dash.cli import usage_error

        return usage_error("bench", f"argument --heads-kv: {heads_kv} does not divide the {heads} query heads")
    ok, why = _gpu_ok()
    if not ok:
        print(f"No usable sm_90 GPU here ({why}); running the scheduling model for the same shape instead.\n")
        from dash.cli import main as cli_main

        argv = ["simulate", "--seqlen", str(args.seqlen), "--hdim", str(args.hdim), "--batch", str(batch),
                "--heads", str(heads), "--heads-kv", str(heads_kv), "--schedule", "all"]
        if args.causal:
            argv.append("--causal")
        return cli_main(argv)

    import torch

    from dash import bench

    shape = bench.Shape(batch, args.seqlen, heads, args.hdim, args.causal, heads_kv if heads_kv != heads else None)
    main_modes = ("dash_nondet", "dash_auto_det", "dash_fa3_det", "user_dash_auto_det", "torch_cudnn", "torch_flash",
                  "fa3_nondet", "fa3_det", "fa4_nondet", "fa4_det")
    available = bench.available_modes()
    modes = [m for m in main_modes if m in available]
    from dash.schedules.auto import choose_kernel_schedule

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    picked = choose_kernel_schedule(batch, heads, heads_kv, args.seqlen, args.seqlen, args.hdim, args.causal, sms)
    print(f"{torch.cuda.get_device_name(0)}: attention backward, {shape.label()}, bf16; "
          f"median of {args.iters} rounds of {args.burst} back-to-back calls after {args.warmup} warm-ups; "
          f"schedule auto -> {picked}")
    print(bench.format_header(modes))
    rows = bench.run_rows([shape], modes, warmup=args.warmup, iters=args.iters, bitwise_repeats=args.repeats,
                          burst=args.burst)
    row = rows[0]
    for m, err in row.errors.items():
        print(f"  {m}: {err}")
    for m in modes:
        if m in row.bitwise:
            print(f"  {m}: {args.repeats} repeated backward calls bitwise identical: {row.bitwise[m]}")
    if "dash_nondet" in row.ms and "dash_auto_det" in row.ms:
        print(f"  DASH deterministic (auto) / non-deterministic = {row.ms['dash_nondet'] / row.ms['dash_auto_det']:.3f}")
    if "dash_fa3_det" in row.ms and "dash_auto_det" in row.ms:
        print(f"  DASH deterministic auto / fa3 order = {row.ms['dash_fa3_det'] / row.ms['dash_auto_det']:.3f}")
    dash_failed = any(m.startswith(("dash", "user_dash")) for m in row.errors)
    return 0 if all(row.bitwise.values()) and not dash_failed else 1
