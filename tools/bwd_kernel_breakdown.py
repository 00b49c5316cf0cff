"""Where a backward call's GPU time goes, per kernel, for DASH and the anchors beside it.

    python tools/bwd_kernel_breakdown.py --seqlen 8192 16384 --hdim 64 --causal yes --json out.json

For each shape and mode (bench.py's modes: the DASH kernels alone, FA3 / FA4 through autograd
when importable, torch cuDNN) it runs ``--calls`` back-to-back backward calls under
torch.profiler, after a warm-up, and prints each kernel's mean GPU time per call and the sum.
Then, without the profiler, it calls the mode back to back for ``--clock-seconds`` while
``nvidia-smi`` samples the SM clock and the power draw every 50 ms, and reports their medians
over that window: a kernel that is slower in the benchmark than under ncu (one launch, no
sustained load) can so be told apart from one that runs at a lower clock. Modes run in rounds
(every mode once per round, in bench.round_orders' orders) as in bench.py.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import torch

from dash import bench
from dash._bench import refuse_without_gpu
from dash.cli import OneLineErrorParser, head_dim, nonnegative_float, positive_int

DEFAULT_MODES = ["dash_nondet", "dash_auto_det", "fa3_nondet", "fa3_det", "fa4_nondet", "fa4_det", "torch_cudnn"]


def short_name(kernel: str) -> str:
    """A kernel's name without template arguments, enough to tell the kernels of one call apart.
    FA3's kernels are all ``cutlass::device_kernel<...>``: they keep the name of the kernel
    class inside (``[FlashAttnBwdPreprocess]``, ``[FlashAttnBwdSm90]``, ...)."""
    base = kernel.split("<", 1)[0].replace("void ", "").strip()
    inner = re.search(r"flash::(FlashAttn\w+)", kernel)
    if inner:
        base += f"[{inner.group(1)}]"
    return base[:80]


def run_for(fn, s: dict, seconds: float) -> int:
    """Calls ``fn`` back to back (a sync every few calls) for about ``seconds``; returns the count."""
    n, t_end = 0, time.time() + seconds
    while time.time() < t_end:
        for _ in range(4):
            fn(s)
        torch.cuda.synchronize()
        n += 4
    return n


def profile_calls(fn, s: dict, calls: int) -> dict[str, float]:
    """Mean GPU microseconds per call of each kernel ``fn`` launches, over ``calls`` calls."""
    from torch.profiler import ProfilerActivity, profile

    fn(s)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(s)
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            per_kernel[short_name(ev.name)] += ev.device_time / calls
    return dict(per_kernel)


class ClockSampler:
    """``nvidia-smi`` in the background: (time, SM MHz, watts) every 50 ms."""

    def __init__(self):
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                 "-lms", "50"], stdout=self.log, stderr=subprocess.DEVNULL)
        except OSError:  # no nvidia-smi: no clock column
            self.proc = None

    def samples(self) -> list[tuple[float, float, float]]:
        self.log.flush()
        out = []
        with open(self.log.name) as f:
            for line in f:
                parts = [p.strip() for p in line.split(",")]
                if len(parts) != 3:
                    continue
                try:
                    ts = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
                    ts += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
                    out.append((ts, float(parts[1]), float(parts[2])))
                except ValueError:
                    continue
        return out

    def window(self, t_start: float, t_end: float) -> dict:
        got = [(c, w) for t, c, w in self.samples() if t_start <= t <= t_end]
        if not got:
            return {}
        return {"sm_mhz": statistics.median(c for c, _ in got), "watts": statistics.median(w for _, w in got),
                "samples": len(got)}

    def stop(self):
        if self.proc:
            self.proc.terminate()
            self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def main() -> int:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=positive_int, nargs="+", default=[16384])
    p.add_argument("--hdim", type=head_dim, nargs="+", default=[64])
    p.add_argument("--causal", choices=["yes", "no", "both"], default="both")
    p.add_argument("--modes", nargs="+", default=DEFAULT_MODES)
    p.add_argument("--calls", type=positive_int, default=10)
    p.add_argument("--rounds", type=positive_int, default=2)
    p.add_argument("--clock-seconds", type=nonnegative_float, default=1.5,
                   help="per mode and round: unprofiled back-to-back calls while the clock is sampled (0: none)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    status = refuse_without_gpu("bwd_kernel_breakdown.py")
    if status:
        return status
    available = bench.available_modes()
    modes = [m for m in a.modes if m in available]
    missing = [m for m in a.modes if m not in available]
    if not modes:
        p.error(f"argument --modes: none of {', '.join(a.modes)} can run here; "
                f"this machine has {', '.join(available)}")
    if missing:
        print(f"not available here: {', '.join(missing)}")
    causal = {"yes": [True], "no": [False], "both": [False, True]}[a.causal]
    sampler = ClockSampler()
    results = []
    try:
        for hdim in a.hdim:
            for c in causal:
                for seqlen in a.seqlen:
                    shape = bench.Shape.paper(seqlen, hdim, c)
                    s = bench.make_input_sets(shape, 1, torch.device("cuda"))[0]
                    s["causal"] = c
                    acc: dict[str, list[dict]] = defaultdict(list)
                    clocks: dict[str, list[dict]] = defaultdict(list)
                    for r in range(a.rounds):
                        for m in bench.in_round_order(modes, r):
                            acc[m].append(profile_calls(available[m], s, a.calls))
                            if a.clock_seconds > 0:
                                # The profiled calls last milliseconds, less than one sample of
                                # nvidia-smi: the clock is read over a sustained, unprofiled run.
                                t0 = time.time()
                                run_for(available[m], s, a.clock_seconds)
                                clocks[m].append(sampler.window(t0, time.time()))
                    print(f"\n== {shape.label()}  ({shape.bwd_flops() / 1e12:.2f} TFLOP per backward)")
                    for m in modes:
                        names = sorted({k for d in acc[m] for k in d})
                        per = {k: statistics.median(d.get(k, 0.0) for d in acc[m]) for k in names}
                        total = sum(per.values())
                        clk = [x for x in clocks[m] if x]
                        mhz = statistics.median(x["sm_mhz"] for x in clk) if clk else None
                        watts = statistics.median(x["watts"] for x in clk) if clk else None
                        clock = f"  SM {mhz:6.0f} MHz  {watts:5.0f} W" if clk else "  (no clock samples)"
                        print(f"  {m:16s} total {total:9.1f} us  {shape.bwd_flops() / total / 1e6:6.1f} TFLOP/s{clock}")
                        for k in sorted(per, key=per.get, reverse=True):
                            print(f"      {per[k]:9.1f} us  {k}")
                        results.append(dict(shape=shape.label(), seqlen=seqlen, hdim=hdim, causal=c, mode=m,
                                            kernels_us=per, total_us=total, sm_mhz=mhz, watts=watts,
                                            clock_samples=sum(x["samples"] for x in clk)))
                    del s
                    torch.cuda.empty_cache()
    finally:
        sampler.stop()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), environment=bench.environment(),
                           settings=dict(calls=a.calls, rounds=a.rounds, clock_seconds=a.clock_seconds), rows=results),
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
