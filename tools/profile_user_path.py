"""Why the backward through torch.autograd.grad is slower than the kernels alone: both paths
at one shape (default hdim 128 causal 16k, b1 h16), CUDA-event time per synced call (modes in
rounds), then one torch.profiler session in which the two paths alternate call by call (so a
clock change hits both alike), listing every GPU kernel in order with its duration and the
gap before it.

    python tools/profile_user_path.py [--seqlen 16384] [--hdim 128] [--full]
"""

import argparse
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("profile_user_path: needs a CUDA GPU with DASH's kernels built")
from torch.profiler import ProfilerActivity, profile

from dash import bench
from dash.bench import Shape

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--seqlen", type=int, default=16384)
ap.add_argument("--hdim", type=int, default=128)
ap.add_argument("--full", action="store_true")
args = ap.parse_args()
sh = Shape.paper(args.seqlen, args.hdim, not args.full)
sets = bench.make_input_sets(sh, 3, torch.device("cuda"))
for s in sets:
    s["causal"] = sh.causal
modes = bench.available_modes()
fns = {m: modes[m] for m in ("dash_auto_det", "user_dash_auto_det")}
print(sh.label(), "ms per synced call:", bench.cuda_time_ms_interleaved(fns, sets, 5, 20, burst=1))
print(sh.label(), "ms per call, back to back:", bench.cuda_time_ms_interleaved(fns, sets, 5, 10, burst=3))
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
    for i in range(4):
        for name, fn in fns.items():
            with torch.profiler.record_function(f"{name} #{i}"):
                fn(sets[i % 3])
            torch.cuda.synchronize()
gpu = sorted((e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA),
             key=lambda e: e.time_range.start)
user = sorted((e for e in p.events() if e.name.endswith(tuple(f"#{i}" for i in range(4)))
               and e.device_type == torch.autograd.DeviceType.CPU), key=lambda e: e.time_range.start)
for i, e in enumerate(user):
    end = user[i + 1].time_range.start if i + 1 < len(user) else float("inf")
    print(f"{e.name:28s} host {e.time_range.start:12.1f} .. {e.time_range.end:12.1f} us")
    prev = e.time_range.start
    for k in gpu:
        if e.time_range.start <= k.time_range.start < end:  # this call's kernels (each call is synced)
            print(f"    {k.name[:56]:56s} gap {k.time_range.start - prev:8.1f} dur {k.time_range.elapsed_us():8.1f}")
            prev = k.time_range.end
