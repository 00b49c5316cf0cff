"""Varlen (packed sequences) throughput: DASH's flash_attn_varlen_func beside FA3's when importable.

    python benchmarks/bench_varlen.py                          # both mixes, hdim 64/128, both masks
    python benchmarks/bench_varlen.py --hdim 128 --causal --mix skewed

A row is one packed batch of 16k tokens (hidden 2048) cut into sequences by a fixed mix:
  uniform  16 sequences of lengths spread evenly over 256..2048 (seeded; total 16k tokens);
  skewed   one sequence of half the tokens, the rest in sequences of 64..512 tokens, the case
           where the padded grids of the longest sequence cost the most (kernel notes,
           twenty-fifth pass).
Timed (``dash.bench.cuda_time_ms_interleaved``: modes interleaved in rounds, host ahead): the
forward (under ``torch.no_grad``), and the forward plus ``torch.autograd.grad`` (DASH
deterministic ``auto``, and non-deterministic ``auto``); FA3's varlen forward and
forward+backward likewise when its module imports. ``--nondet-schedules`` adds the
non-deterministic forward+backward per varlen kernel schedule (``dash_varlen_nondet_<name>``),
the measurement behind non-deterministic ``auto``'s rule. A control times DASH's padded
``flash_attn_func`` once per sequence (batch 1 each): the same FLOPs without varlen's padding.
FLOPs are FA3's count summed over the sequences (4*h*sq*sk*d forward, halved visible pairs under
a causal mask as the grid benchmarks count them; backward 2.5x). Prints a table and writes
benchmarks/results/<date>-<gpu>-varlen.json (every number, device, commit, date).
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dash import _bench  # noqa: E402

TOKENS = 16384
HIDDEN = 2048


def lengths_of(mix: str, seed: int = 0) -> list[int]:
    """The sequence lengths of a mix (a fixed function of the mix and the seed)."""
    rng = random.Random(seed)
    if mix == "uniform":
        lengths = [rng.randint(256, 2048) for _ in range(16)]
    elif mix == "skewed":
        lengths = [TOKENS // 2]
        while sum(lengths) < TOKENS:
            lengths.append(rng.randint(64, 512))
    else:
        raise ValueError(f"unknown mix {mix!r}")
    scale = TOKENS / sum(lengths)  # total exactly TOKENS
    lengths = [max(1, int(n * scale)) for n in lengths]
    lengths[0] += TOKENS - sum(lengths)
    return lengths


def attention_flops(lengths: list[int], heads: int, head_dim: int, causal: bool) -> float:
    """FA3's forward count summed over sequences (causal: half the pairs, as the grids count)."""
    return sum(4.0 * heads * n * n * head_dim * (0.5 if causal else 1.0) for n in lengths)


def run_row(mix: str, head_dim: int, causal: bool, iters: int, warmup: int, with_fa3: bool = True,
            nondet_schedules: tuple[str, ...] = ()) -> dict:
    import torch

    from dash import bench
    from dash.api import flash_attn_func, flash_attn_varlen_func

    lengths = lengths_of(mix)
    heads = HIDDEN // head_dim
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    longest = max(lengths)
    q, k, v = (torch.randn(TOKENS, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(TOKENS, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    flops = attention_flops(lengths, heads, head_dim, causal)
    modes: dict[str, tuple] = {}

    def varlen(det, schedule="auto"):
        return lambda: flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal, deterministic=det,
                                              schedule=schedule)

    modes["dash_varlen"] = (varlen(True), False)
    modes["dash_varlen_det"] = (varlen(True), True)
    modes["dash_varlen_nondet"] = (varlen(False), True)
    for name in nondet_schedules:
        modes[f"dash_varlen_nondet_{name}"] = (varlen(False, name), True)

    pieces = [(a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]

    def per_sequence():
        return torch.cat([flash_attn_func(q[None, a:b], k[None, a:b], v[None, a:b], causal=causal,
                                          deterministic=True)[0] for a, b in pieces])

    modes["dash_per_sequence_det"] = (per_sequence, True)
    fa3 = None
    if with_fa3:
        try:
            import flash_attn_interface as fa3
        except ImportError:
            pass
    if fa3 is not None:
        def fa3_varlen(det):
            def call():
                out = fa3.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal, deterministic=det)
                return out[0] if isinstance(out, tuple) else out
            return call
        modes["fa3_varlen"] = (fa3_varlen(True), False)
        modes["fa3_varlen_det"] = (fa3_varlen(True), True)
        modes["fa3_varlen_nondet"] = (fa3_varlen(False), True)

    row = {"mix": mix, "lengths": lengths, "head_dim": head_dim, "heads": heads, "causal": causal,
           "fwd_flops": flops, "ms": {}, "tflops": {}, "errors": {}}
    steps, work = {}, {}
    for name, (forward, with_backward) in modes.items():
        if with_backward:
            def step(_, forward=forward):
                torch.autograd.grad(forward(), (q, k, v), dout)
            work[name] = 3.5 * flops
        else:
            def step(_, forward=forward):
                with torch.no_grad():
                    forward()
            work[name] = flops
        steps[name] = step
    # The project's timing (dash.bench): rounds that interleave the modes, host ahead of the GPU;
    # a mode that raises is recorded in errors and the others go on.
    row["ms"] = bench.cuda_time_ms_interleaved(steps, [{}], warmup, iters, errors=row["errors"])
    row["tflops"] = {name: work[name] / (ms * 1e-3) / 1e12 for name, ms in row["ms"].items()}
    return row


def results_meta(device: str, date: str, torch_version: str, iters: int) -> dict:
    """The results file's header. ``commit`` is the kernels' (what their build recorded), as in
    bench_fwd's and bench_bwd's files; ``checkout_describe`` is None when the run is not from a git
    checkout (e.g. a copy of the tree holding another build)."""
    from dash._ext import manifest
    from dash.bench import ROUND_ORDERS

    build = manifest()
    return {"kind": "varlen", "device": device, "date": date, "torch": torch_version, "tokens": TOKENS,
            "hidden": HIDDEN, "iters": iters, "round_orders": ROUND_ORDERS, "commit": build.get("git_commit"),
            **_bench.code_identity(ROOT), "build": build}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench_varlen.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--hdim", type=int, nargs="*", default=[64, 128])
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                   help="only causal (--causal) or only full (--no-causal) rows; default both")
    p.add_argument("--mix", nargs="*", choices=["uniform", "skewed"], default=["uniform", "skewed"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--fa3", action=argparse.BooleanOptionalAction, default=True,
                   help="time FA3's varlen when flash_attn_interface imports (default); it must be built with "
                        "varlen (an FA3 built with FLASH_ATTENTION_DISABLE_VARLEN crashes the process on the call)")
    p.add_argument("--nondet-schedules", action="store_true",
                   help="also time the non-deterministic forward+backward with each varlen kernel schedule")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    if _bench.refuse_without_gpu("bench_varlen.py"):
        return 1
    import torch

    masks = [args.causal] if args.causal is not None else [False, True]
    from dash.validation import VARLEN_KERNEL_SCHEDULES

    schedules = VARLEN_KERNEL_SCHEDULES if args.nondet_schedules else ()
    rows = [run_row(mix, d, c, args.iters, args.warmup, args.fa3, schedules) for mix in args.mix for d in args.hdim
            for c in masks]
    names = sorted({n for r in rows for n in r["tflops"]})
    print(f"{'row':<28}" + "".join(f"{n:>24}" for n in names))
    for r in rows:
        label = f"{r['mix']} hd{r['head_dim']} {'causal' if r['causal'] else 'full'}"
        print(f"{label:<28}" + "".join(f"{r['tflops'].get(n, float('nan')):>24.1f}" for n in names))
        for n, e in r["errors"].items():
            print(f"  {n}: {e}")
    device = torch.cuda.get_device_name()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    args.out.mkdir(parents=True, exist_ok=True)
    path = _bench.results_path(args.out, device, date, "varlen")
    meta = results_meta(device, date, torch.__version__, args.iters)
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
