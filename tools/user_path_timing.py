"""The path users call (flash_attn_func + torch.autograd.grad) against DASH's kernels alone and
torch cuDNN: how much of a synced call's time is host latency and how much GPU time.

    python tools/user_path_timing.py

Modes in rounds per shape. Timings (us, medians):
  ev     : CUDA events around one synced call (bench.py's timer before it timed bursts)
  ev_pre : same with a 3 ms GPU sleep queued first: GPU time only
  host   : perf_counter from call to return
  b2b    : events around 6 back-to-back calls (no sync between), per call
"""
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    sys.exit("user_path_timing: needs a CUDA GPU with DASH's kernels built")

from dash import bench
from dash.bench import Shape

CYCLES_3MS = int(3e-3 * bench.SLEEP_CLOCK_HZ)
SHAPES = [("tiny b1 h1 s128", Shape(1, 128, 1, 128, False)),
          ("MQA 8/1 causal 8k", Shape(2, 8192, 8, 128, True, heads_kv=1)),
          ("MHA 16 causal 8k", Shape(2, 8192, 16, 128, True)),
          ("MHA 16 full 2k", Shape(8, 2048, 16, 128, False)),
          ("MHA 16 causal 1k", Shape(16, 1024, 16, 128, True))]
modes = bench.available_modes()
names = ["dash_auto_det", "user_dash_auto_det", "dash_nondet", "user_dash_nondet", "torch_cudnn"]
for label, sh in SHAPES:
    sets = bench.make_input_sets(sh, 3, torch.device("cuda"))
    for s in sets:
        s["causal"] = sh.causal
    fns = {n: modes[n] for n in names}
    for f in fns.values():
        for i in range(4):
            f(sets[i % 3])
    torch.cuda.synchronize()
    res = {n: {"ev": [], "ev_pre": [], "host": [], "host_pre": [], "b2b": []} for n in fns}
    for it in range(20):
        s = sets[it % 3]
        for n, f in fns.items():
            for pre in (False, True):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if pre:
                    torch.cuda._sleep(CYCLES_3MS)
                a.record()
                t0 = time.perf_counter()
                f(s)
                t1 = time.perf_counter()
                b.record()
                b.synchronize()
                res[n]["ev_pre" if pre else "ev"].append(a.elapsed_time(b) * 1e3)
                res[n]["host_pre" if pre else "host"].append((t1 - t0) * 1e6)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for j in range(6):
                f(sets[(it + j) % 3])
            b.record()
            b.synchronize()
            res[n]["b2b"].append(a.elapsed_time(b) * 1e3 / 6)
    print(f"== {label}  (us, medians)")
    for n in fns:
        print(f"  {n:20s}: " + "  ".join(f"{k} {statistics.median(v):9.1f}" for k, v in res[n].items()))
    del sets
    torch.cuda.empty_cache()
