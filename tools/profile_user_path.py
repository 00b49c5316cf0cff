"""Why the backward through torch.autograd.grad is slower than the kernels alone: both paths
at hdim 128 causal 16k (b1 h16), CUDA-event time per call (modes in rounds), then each under
torch.profiler (kernel durations and their start times on the GPU).

    python tools/profile_user_path.py
"""
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("profile_user_path: needs a CUDA GPU with DASH's kernels built")
from torch.profiler import ProfilerActivity, profile
from dash import bench
from dash.bench import Shape
sh = Shape(1, 16384, 16, 128, True)
sets = bench.make_input_sets(sh, 3, torch.device("cuda"))
for s in sets:
    s["causal"] = True
modes = bench.available_modes()
fns = {m: modes[m] for m in ("dash_auto_det", "user_dash_auto_det")}
print(bench.cuda_time_ms_interleaved(fns, sets, 5, 20))
for name, fn in fns.items():
    for i in range(3):
        fn(sets[i % 3])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for i in range(6):
            fn(sets[i % 3])
        torch.cuda.synchronize()
    print("=====", name)
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    evs = sorted([e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA], key=lambda e: e.time_range.start)
    for e in evs[:12]:
        print(f"  {e.name[:60]:60s} start {e.time_range.start:12.1f} dur {e.time_range.elapsed_us():9.1f}")
