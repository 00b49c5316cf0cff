"""Is multi-GPU training with DASH bitwise reproducible? Runs tools/train_multigpu.py under
torchrun twice per configuration and compares the two runs' rank0.json.

    python tools/multigpu_determinism.py --out /tmp/mg            # 2 GPUs: DDP and FSDP2 with DASH, SDPA for contrast
    python tools/multigpu_determinism.py --out /tmp/mg --nproc 4 --sdpa off
    python tools/multigpu_determinism.py --out /tmp/mg --device cpu --attn sdpa --sdpa off   # the plumbing, on CPUs

Runs (each a fresh torchrun, same seed):
  * DASH (attn_implementation="dash", deterministic=True) with each of --modes (ddp, fsdp2),
    twice: every rank's loss at every step and every parameter after the last step must be
    bit-identical between the two runs, the ranks' parameters must agree, and DASH must have
    been called for every layer and step. Any difference fails (exit status 1).
  * torch SDPA (transformers' attn_implementation="sdpa") with DDP, twice, for contrast, with
    torch.use_deterministic_algorithms off (what a user gets by default: FlashAttention-2's
    backward with atomic adds) and/or on (then torch runs FA2's deterministic backward and
    leaves cuDNN out). Reported as it comes out, identical or not; never fails the run.
Each run's output goes to OUT/<run>.log and its results to OUT/<run>/rank0.json; everything,
with the comparisons, to OUT/summary.json (one file to bring back from a GPU machine).
Exit status: 0 when every DASH (--attn) pair is identical, 1 when one differs or a check
fails, 2 when a DASH run could not be made (bad arguments, a run crashed or timed out). An
SDPA contrast run that could not be made is reported, and changes nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRAIN = HERE / "train_multigpu.py"


def _load_train_module():
    """tools/train_multigpu.py as a module (its import has no side effects), without putting
    tools/ on sys.path."""
    import importlib.util

    if "train_multigpu" in sys.modules:
        return sys.modules["train_multigpu"]
    spec = importlib.util.spec_from_file_location("train_multigpu", TRAIN)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_multigpu"] = mod
    spec.loader.exec_module(mod)
    return mod


tm = _load_train_module()


def machine() -> dict:
    """What the runs ran on and with: the GPUs' names (not just the device kind) and DASH's
    build and code (``dash._bench.code_identity``), for the summary file."""
    out: dict = {"gpus": None, "commit": None}
    try:
        import torch

        if torch.cuda.is_available():
            out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as e:  # the summary must still be written
        out["gpus_error"] = f"{type(e).__name__}: {e}"
    try:
        from dash._bench import code_identity
        from dash._ext import manifest

        out["commit"] = manifest().get("git_commit")
        out.update(code_identity())
    except Exception as e:
        out["code_error"] = f"{type(e).__name__}: {e}"
    return out


@dataclass(frozen=True)
class Run:
    """One torchrun of train_multigpu.py."""

    name: str
    mode: str
    attn: str
    torch_deterministic: str


@dataclass
class Pair:
    """Two runs of one configuration and what comparing them found."""

    label: str
    runs: tuple[Run, Run]
    required: bool  # a difference fails the driver
    differences: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # within a run (replicas, DASH calls)
    error: Optional[str] = None  # a run failed

    @property
    def identical(self) -> bool:
        return self.error is None and not self.differences


def plan(modes: Sequence[str], attn: str, sdpa: str) -> list[Pair]:
    """The pairs to run: ``attn`` with each mode (required), then SDPA with DDP for contrast
    (``sdpa``: off, default, deterministic or both)."""
    pairs = []
    for mode in modes:
        runs = tuple(Run(f"{mode}-{attn}-run{i}", mode, attn, "on") for i in (1, 2))
        pairs.append(Pair(f"{mode} + {attn}" + (" (deterministic=True)" if attn == "dash" else ""), runs, True))
    settings = {"off": [], "default": ["off"], "deterministic": ["on"], "both": ["off", "on"]}[sdpa]
    for det in settings:
        tag = "torchdet" if det == "on" else "default"
        runs = tuple(Run(f"ddp-sdpa-{tag}-run{i}", "ddp", "sdpa", det) for i in (1, 2))
        words = ("torch.use_deterministic_algorithms(True)" if det == "on"
                 else "torch defaults (deterministic algorithms off)")
        pairs.append(Pair(f"ddp + torch SDPA, {words}", runs, False))
    return pairs


def torchrun_command(run: Run, args: argparse.Namespace, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(TRAIN), "--mode", run.mode, "--attn", run.attn, "--torch-deterministic", run.torch_deterministic,
           "--out", str(out / run.name), "--steps", str(args.steps), "--seed", str(args.seed),
           "--device", args.device]
    return cmd + list(args.train_args)


def run_env(base: Optional[dict] = None) -> dict:
    """The runs' environment: the caller's, the checkout first on PYTHONPATH (its dash/, with
    the kernels pip placed beside the sources, as tools/gpu_check.sh uses), and DETERMINISM_ENV
    where not set."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYTHONUNBUFFERED", "1")
    tm.apply_determinism_env(env)
    return env


def execute(run: Run, args: argparse.Namespace, out: Path, env: dict) -> tuple[Optional[dict], Optional[str]]:
    """(rank0 results, None), or (None, why the run failed)."""
    log = out / f"{run.name}.log"
    result_file = out / run.name / "rank0.json"
    result_file.unlink(missing_ok=True)  # an earlier invocation's file must not stand in for this run's
    cmd = torchrun_command(run, args, out)
    t0 = time.time()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n\n")
        f.flush()
        # A session of its own, so that a timeout ends torchrun and the workers it started.
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            p.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            _end_group(p)
            return None, f"timed out after {args.timeout} s (log: {log})"
    if p.returncode != 0 or not result_file.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        return None, f"exit status {p.returncode} after {time.time() - t0:.0f} s; log {log} ends:\n      " + \
            "\n      ".join(tail)
    return json.loads(result_file.read_text()), None


def _end_group(p: subprocess.Popen) -> None:
    """SIGTERM to the run's process group (torchrun and its workers), SIGKILL if it lingers."""
    import signal

    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def evaluate(pair: Pair, results: tuple[dict, dict]) -> None:
    pair.differences = tm.compare_results(*results)
    for r, run in zip(results, pair.runs):
        pair.problems += [f"{run.name}: {p}" for p in tm.check_result(r)]


def summary_lines(pairs: list[Pair], results: dict[str, dict]) -> list[str]:
    lines = ["", "Summary (two fresh runs from the same seed; bitwise: every rank's loss at every step, "
                 "every parameter after the last step):"]
    for pair in pairs:
        if pair.error:
            verdict = f"RUN FAILED: {pair.error}"
        elif pair.identical:
            verdict = "bit-identical"
        else:
            verdict = "NOT identical: " + "; ".join(pair.differences)
        need = "required" if pair.required else "for contrast"
        lines.append(f"  {pair.label:<66} [{need}] {verdict}")
        for p in pair.problems:
            lines.append(f"      problem: {p}")
        r = results.get(pair.runs[0].name)
        if r:
            lines.append(f"      loss {r['losses'][0][0]:.4f} -> {r['losses'][0][-1]:.4f} (rank 0), parameters sha256 "
                         f"{r['param_sha256'][:16]}, {r['world_size']} ranks, {r['wall_s']:.0f} s")
    required = [p for p in pairs if p.required]
    firsts = [results.get(p.runs[0].name) for p in required]
    if len(required) > 1 and all(firsts):
        same = len({r["param_sha256"] for r in firsts}) == 1
        lines.append(f"  (for information: the {' and '.join(p.runs[0].mode for p in required)} runs "
                     f"{'end with the same' if same else 'end with different'} parameters; they reduce gradients "
                     "in different groupings, so they need not)")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="multigpu_determinism.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder for the logs, results and summary.json")
    p.add_argument("--nproc", type=tm._positive, default=2, help="processes (GPUs) per run (default 2)")
    p.add_argument("--modes", nargs="+", choices=tm.MODES, default=list(tm.MODES),
                   help="data-parallel modes checked with --attn (default: ddp fsdp2)")
    p.add_argument("--attn", choices=tm.ATTNS, default="dash",
                   help="the attention whose runs must be identical (default dash; sdpa/eager for CPU plumbing)")
    p.add_argument("--sdpa", choices=("off", "default", "deterministic", "both"), default="both",
                   help="SDPA contrast runs: none, with torch's defaults, with deterministic algorithms, or both "
                        "(default both)")
    p.add_argument("--steps", type=tm._positive, default=6, help="AdamW steps per run (default 6)")
    p.add_argument("--seed", type=tm._nonnegative, default=0, help="seed (default 0)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (NCCL) or cpu (gloo) (default cuda)")
    p.add_argument("--timeout", type=tm._positive, default=600, help="seconds per run before it counts as failed")
    p.add_argument("--summary", type=Path, default=None, help="where summary.json goes (default OUT/summary.json)")
    p.add_argument("train_args", nargs=argparse.REMAINDER,
                   help="after --: more arguments for train_multigpu.py (e.g. -- --layers 2 --seqlen 256)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.train_args and args.train_args[0] == "--":
        args.train_args = args.train_args[1:]
    args.modes = list(dict.fromkeys(args.modes))
    owned = {"--mode", "--attn", "--torch-deterministic", "--out", "--steps", "--seed", "--device"}
    clash = [a for a in args.train_args if a.split("=")[0] in owned]
    if clash:
        parser.error(f"{clash[0]} is set by this driver; use its own option (--modes, --attn, --steps, --seed, "
                     "--device, --out)")
    if args.device == "cpu" and (args.attn == "dash" or args.sdpa != "off"):
        what = "--attn dash" if args.attn == "dash" else f"--sdpa {args.sdpa}"
        parser.error(f"{what} needs --device cuda; on CPUs use --attn sdpa (or eager) --sdpa off")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"argument --out: {args.out} exists and is not a folder")
    # Check the training arguments now, not in the first torchrun.
    try:
        tm.parse_args(["--mode", "ddp", "--out", str(args.out), "--attn", args.attn, "--device", args.device]
                      + args.train_args)
    except SystemExit:
        parser.error(f"train_multigpu.py rejects the arguments after --: {' '.join(args.train_args)} (see above)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        problem = gpu_problem(args.nproc)
        if problem:
            print(f"multigpu_determinism.py: error: {problem}", file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    env = run_env()
    pairs = plan(args.modes, args.attn, args.sdpa)
    results: dict[str, dict] = {}
    print(f"{len(pairs) * 2} runs of {args.nproc} processes; settings: "
          + ", ".join(f"{k}={env.get(k)}" for k in tm.DETERMINISM_ENV), flush=True)
    for pair in pairs:
        for run in pair.runs:
            print(f"  {run.name} ...", end="", flush=True)
            t0 = time.time()
            r, err = execute(run, args, args.out, env)
            print(f" {time.time() - t0:.0f} s" + (f"  FAILED: {err.splitlines()[0]}" if err else ""), flush=True)
            if err:
                pair.error = pair.error or f"{run.name}: {err}"
                break
            results[run.name] = r
        if pair.error is None:
            evaluate(pair, (results[pair.runs[0].name], results[pair.runs[1].name]))
    lines = summary_lines(pairs, results)
    print("\n".join(lines))
    # Only the required pairs decide the exit status: a contrast (SDPA) pair that could not be
    # run is reported in the summary and in a note below, as its differences are.
    failed_runs = [p for p in pairs if p.required and p.error]
    failed_contrast = [p for p in pairs if not p.required and p.error]
    bad = [p for p in pairs if p.required and p.error is None and (p.differences or p.problems)]
    status = 2 if failed_runs else 1 if bad else 0
    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:] if argv is None else list(argv), "nproc": args.nproc, "device": args.device,
        "machine": machine(),
        "env": {k: env.get(k) for k in tm.RECORDED_ENV}, "status": status,
        "pairs": [{"label": p.label, "required": p.required, "runs": [r.name for r in p.runs],
                   "identical": p.identical, "differences": p.differences, "problems": p.problems, "error": p.error}
                  for p in pairs],
        "results": results,
    }
    path = args.summary or args.out / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\nwrote {path}")
    if failed_contrast:
        print(f"note: {len(failed_contrast)} contrast configuration(s) could not be run (they never fail this "
              f"driver): {', '.join(p.label for p in failed_contrast)}")
    if status == 0:
        print(f"OK: every {args.attn} run pair is bit-identical")
    elif status == 1:
        print(f"FAILED: {len(bad)} {args.attn} configuration(s) not bit-identical or with a failed check",
              file=sys.stderr)
    else:
        print(f"FAILED: {len(failed_runs)} {args.attn} configuration(s) could not be run", file=sys.stderr)
    return status


def gpu_problem(nproc: int) -> Optional[str]:
    """Why this machine cannot run --nproc CUDA processes (None when it can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < nproc:
        return (f"--nproc {nproc} needs {nproc} CUDA GPUs; torch {torch.__version__} sees {n}. Run on a machine "
                f"with {nproc} GPUs, or test the plumbing with --device cpu --attn sdpa --sdpa off")
    return None


if __name__ == "__main__":
    raise SystemExit(main())
