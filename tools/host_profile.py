"""Where the host time of one DASH call goes, on a tiny problem (the GPU idle most of the time).

    python tools/host_profile.py [--calls 300] [--hdim 128] [--seqlen 128]

Times each piece of the user path separately (validation, the schedule choice, the forward
op with and without autograd, the backward op alone, ``torch.autograd.grad`` through the
forward), then the whole ``flash_attn_func`` forward+backward under cProfile (Python
functions by own time) and under torch.profiler (ops by self CPU time). A diagnosis tool
for issue 9's host-overhead target; the benchmark's number comes from benchmarks/bench_fwd.py.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=128)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_profile: needs a CUDA GPU with DASH's kernels built", file=sys.stderr)
        return 1
    import dash
    from dash import bench, ops, validation

    d, s = args.hdim, args.seqlen
    q, k, v = (torch.randn(1, s, 1, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    scale = d ** -0.5
    with torch.no_grad():
        out0, lse0 = torch.ops.dash.fwd(q, k, v, scale, True, True, "fa3", 0)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    dout_t = dout.transpose(1, 2)

    def fa_fwdbwd(det):
        def f():
            o = dash.flash_attn_func(q, k, v, causal=True, deterministic=det)
            torch.autograd.grad(o, (q, k, v), dout)
        return f

    def op_fwd_grad():
        torch.ops.dash.fwd(q, k, v, scale, True, True, "fa3", 0)

    def op_fwd_grad_bwd():
        o, _ = torch.ops.dash.fwd(q, k, v, scale, True, True, "fa3", 0)
        torch.autograd.grad(o, (q, k, v), dout)

    def op_fwd_nograd():
        with torch.no_grad():
            torch.ops.dash.fwd(q, k, v, scale, True, True, "fa3", 0)

    def op_bwd(det):
        def f():
            torch.ops.dash.bwd(dout, q, k, v, out0, lse0, scale, True, det, "fa3", 0)
        return f

    def sdpa_fwdbwd():
        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        torch.autograd.grad(o, (qt, kt, vt), dout_t)

    def validate():
        validation.validate_for_launch(q, k, v, softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0,
                                       sm_margin=0, schedule="auto", deterministic=True)

    def resolve():
        ops.resolve_schedule("auto", q, k, True, True, 0)

    def empty_alloc():
        torch.empty_like(q)

    pieces = {
        "bare SDPA fwd+bwd": sdpa_fwdbwd,
        "flash_attn_func det fwd+bwd": fa_fwdbwd(True),
        "flash_attn_func non-det fwd+bwd": fa_fwdbwd(False),
        "dash::fwd op + autograd.grad (det)": op_fwd_grad_bwd,
        "dash::fwd op, grad on": op_fwd_grad,
        "dash::fwd op, no grad": op_fwd_nograd,
        "dash::bwd op, det": op_bwd(True),
        "dash::bwd op, non-det": op_bwd(False),
        "validate_for_launch": validate,
        "resolve_schedule(auto)": resolve,
        "torch.empty_like (yardstick)": empty_alloc,
    }
    print(f"host time per call, b1 h1 s{s} d{d} causal bf16, {args.calls} calls each (us):")
    for name, fn in pieces.items():
        print(f"  {name:40s} {bench.wall_us_per_call(fn, args.calls):8.1f}", flush=True)

    f = fa_fwdbwd(True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        f()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    print("\ncProfile of flash_attn_func det fwd+bwd (own time):")
    print(buf.getvalue())

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(50):
            f()
        torch.cuda.synchronize()
    print("torch.profiler, 50 calls of flash_attn_func det fwd+bwd:")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
