"""``python -m dash bench``: the main job.

On an sm_90 GPU: times the backward of a default training shape in every available mode
(DASH non-deterministic, DASH deterministic per schedule, torch cuDNN / flash in the same
run), checks the deterministic modes are bitwise repeatable, prints a table. Without
one: says so and runs the scheduling model for the same shape instead.

Results file: on the GPU, every number of the run (``dash.bench.results_payload``, tag
``dash-bench``) goes to ``--out-dir``: by default benchmarks/results/ of the checkout this dash
is imported from, else ./dash-bench-results/ (an installed package). A name already taken gets
-2, -3, ...: a second run never replaces the first. The scheduling-model fallback writes no
file: it is a prediction, not a measurement (and the CPU tests run it from the checkout).

Also here, for the benchmark scripts and tools that need DASH's kernels (this module imports
no torch): ``refuse_without_gpu``, ``checkout_root``, ``results_path``, ``code_identity``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

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
    p.add_argument("--out-dir", type=Path, default=None, metavar="DIR",
                   help="folder for the results file (default: benchmarks/results/ of the checkout this dash comes "
                        f"from, else ./{INSTALLED_RESULTS_DIR}/); nothing is written without a GPU")


#: Results folder of an installed package (no checkout beside it), relative to the current directory.
INSTALLED_RESULTS_DIR = "dash-bench-results"


def checkout_root() -> Path | None:
    """The repository root when dash is imported from a source checkout (benchmarks/ beside the
    package), else None (an installed package: site-packages has no benchmarks/)."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "benchmarks").is_dir() and (root / "pyproject.toml").is_file() else None


def default_results_dir() -> Path:
    root = checkout_root()
    return root / "benchmarks" / "results" if root else Path(INSTALLED_RESULTS_DIR)


def results_path(directory: Path, device: str, date: str, tag: str) -> Path:
    """``directory/<day>-<device>-<tag>.json``, with -2, -3, ... added rather than replacing a
    file: a second run the same day (a subset of the grid, say) must not wipe the first."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", device).strip("-") or "unknown-device"
    base = f"{date[:10]}-{safe}-{tag}"
    path, n = directory / f"{base}.json", 2
    while path.exists():
        path, n = directory / f"{base}-{n}.json", n + 1
    return path


def _out_dir_problem(directory: Path) -> str | None:
    """Why the results folder cannot be made or written (checked before the timing, not after)."""
    existing = directory
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        return f"argument --out-dir: cannot write under {directory}: {existing} is not a folder; choose another"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"argument --out-dir: cannot write under {directory}: folder {existing} is not writable; choose another"
    return None


#: What ``code_identity`` digests, relative to the folder holding the package.
CODE_FILES = ("dash/**/*.py", "benchmarks/*.py")


def _git(root: Path, *args: str) -> str | None:
    try:
        p = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if p.returncode != 0:
        return None
    return p.stdout.strip() or None


def code_identity(root: Path | None = None) -> dict:
    """What identifies the Python code behind a results file (the kernels' commit is the build's).

    ``checkout_describe``: ``git describe --always --dirty`` of the checkout ``root`` (default:
    the folder holding this package), None when ``root`` is not the top of a git work tree (an
    installed package inside someone else's repository is not "the checkout"). ``code_sha256``:
    the first 16 hex digits of a SHA-256 over the path and bytes of every file of CODE_FILES as
    they are on disk, which also covers untracked files and edits describe only calls -dirty."""
    root = Path(root) if root is not None else Path(__file__).resolve().parent.parent
    top = _git(root, "rev-parse", "--show-toplevel")
    describe = (_git(root, "describe", "--always", "--dirty")
                if top and Path(top).resolve() == root.resolve() else None)
    h, files = hashlib.sha256(), 0
    for path in sorted({f for pattern in CODE_FILES for f in root.glob(pattern) if f.is_file()}):
        rel = path.relative_to(root).as_posix().encode()
        data = path.read_bytes()
        h.update(b"%d:%s:%d:" % (len(rel), rel, len(data)))  # lengths first: no two file sets hash alike
        h.update(data)
        files += 1
    return {"checkout_describe": describe, "code_sha256": h.hexdigest()[:16],
            "code_sha256_of": f"{', '.join(CODE_FILES)} ({files} files)"}


def _gpu_ok() -> tuple[bool, str]:
    from dash._info import gpu_info

    gpu = gpu_info()
    if not gpu["present"]:
        return False, gpu["reason"]
    if not gpu["supported_by_dash"]:
        return False, f"{gpu['name']} has compute capability {gpu['compute_capability']}, DASH needs 9.0"
    from dash._ext import kernels_available, manifest

    if not kernels_available():
        why = manifest().get("reason_not_built") or "dash._C did not load"
        return False, f"DASH's kernels are not available: {why}"
    return True, ""


def refuse_without_gpu(prog: str) -> int:
    """For scripts that run DASH's kernels: 0 when this machine can, else one line on stderr
    (what is missing, where to run it) and 1, the exit status to leave with."""
    ok, why = _gpu_ok()
    if ok:
        return 0
    print(f"{prog}: error: needs an sm_90 GPU (H100/H200) with DASH's kernels built; here: {why}", file=sys.stderr)
    return 1


def run(args: argparse.Namespace) -> int:
    batch = args.batch or max(16384 // args.seqlen, 1)
    heads = args.heads or 2048 // args.hdim
    heads_kv = args.heads_kv or heads
    if heads % heads_kv:
        from dash.cli import usage_error

        return usage_error("bench", f"argument --heads-kv: {heads_kv} does not divide the {heads} query heads")
    if args.out_dir is not None:  # asked for: a typo is an error even where nothing gets written
        why = _out_dir_problem(args.out_dir)
        if why:
            from dash.cli import usage_error

            return usage_error("bench", why)
    ok, why = _gpu_ok()
    if not ok:
        print(f"No usable sm_90 GPU here ({why}); running the scheduling model for the same shape instead "
              "(a prediction, not a measurement: no results file is written).\n")
        from dash.cli import main as cli_main

        argv = ["simulate", "--seqlen", str(args.seqlen), "--hdim", str(args.hdim), "--batch", str(batch),
                "--heads", str(heads), "--heads-kv", str(heads_kv), "--schedule", "all"]
        if args.causal:
            argv.append("--causal")
        return cli_main(argv)
    out_dir = args.out_dir if args.out_dir is not None else default_results_dir()
    why = _out_dir_problem(out_dir)
    if why:  # before the timing: a run's numbers must not be lost for want of a folder
        from dash.cli import usage_error

        return usage_error("bench", why)

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
        ratio = row.ms["dash_nondet"] / row.ms["dash_auto_det"]
        print(f"  DASH deterministic (auto) / non-deterministic = {ratio:.3f}")
    if "dash_fa3_det" in row.ms and "dash_auto_det" in row.ms:
        print(f"  DASH deterministic auto / fa3 order = {row.ms['dash_fa3_det'] / row.ms['dash_auto_det']:.3f}")
    meta = {"kind": "bwd", "command": "python -m dash bench", "iters": args.iters, "burst": args.burst,
            "warmup": args.warmup, "repeats": args.repeats, "schedule_auto_pick": picked,
            "options": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))}}
    payload = bench.results_payload(rows, modes, meta)
    payload["ratios"] = bench.paired_ratios(rows)
    # Written whatever the verdict: a failed check's numbers are the evidence.
    print(f"wrote {bench.write_results(payload, out_dir, 'dash-bench')}")
    dash_failed = any(m.startswith(("dash", "user_dash")) for m in row.errors)
    return 0 if all(row.bitwise.values()) and not dash_failed else 1
