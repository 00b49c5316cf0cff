"""Where a varlen forward's time goes: the mix, its longest sequence alone and the other sequences
alone, for DASH and (when importable) upstream FA3, in one process.

    python tools/varlen_split_timing.py --mix skewed --hdim 128 --causal

Each library's forward (no autograd) on: the whole mix (``flash_attn_varlen_func``), the
longest sequence alone (varlen with one sequence, and ``flash_attn_func`` at batch 1), and the
remaining sequences alone (varlen). If the mix costs about what its parts cost, a gap to the
other library lies in one of the parts; if it costs more, in how the kernel shares the grid
between them. Then the kernels each library launches for the mix, with their GPU times
(torch.profiler). Times: ``dash.bench.cuda_time_ms_interleaved`` (medians, host ahead).
The mixes are benchmarks/bench_varlen.py's.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _bench_varlen():
    spec = importlib.util.spec_from_file_location("bench_varlen", ROOT / "benchmarks" / "bench_varlen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mix", choices=("uniform", "skewed"), default="skewed")
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    from dash._bench import refuse_without_gpu

    if refuse_without_gpu("varlen_split_timing.py"):
        return 1
    import torch

    from dash import bench
    from dash.api import flash_attn_func, flash_attn_varlen_func

    bv = _bench_varlen()
    lengths = bv.lengths_of(args.mix)
    heads = bv.HIDDEN // args.hdim
    q, k, v = (torch.randn(bv.TOKENS, heads, args.hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    longest = max(lengths)
    i_long = lengths.index(longest)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    a, b = starts[i_long], starts[i_long + 1]
    others = [n for i, n in enumerate(lengths) if i != i_long]
    # The other sequences packed on their own (copied, so the long one's rows are not read).
    rest = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in range(len(lengths)) if i != i_long]).cuda()
    qr, kr, vr = q[rest].contiguous(), k[rest].contiguous(), v[rest].contiguous()

    def cu_of(ns):
        return torch.tensor([0, *torch.tensor(ns).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

    cu_all, cu_long, cu_rest = cu_of(lengths), cu_of([longest]), cu_of(others)
    ql, kl, vl = q[a:b].contiguous(), k[a:b].contiguous(), v[a:b].contiguous()
    flops = {"mix": bv.attention_flops(lengths, heads, args.hdim, args.causal),
             "long": bv.attention_flops([longest], heads, args.hdim, args.causal),
             "rest": bv.attention_flops(others, heads, args.hdim, args.causal)}
    flops["long_dense"] = flops["long"]

    libs = {"dash": (flash_attn_varlen_func, flash_attn_func)}
    try:
        import flash_attn_interface as fa3

        libs["fa3"] = (fa3.flash_attn_varlen_func, fa3.flash_attn_func)
    except ImportError:
        print("FA3 not importable: DASH only")

    fns = {}
    for lib, (varlen, dense) in libs.items():
        def mk(fn):
            def call(_):
                with torch.no_grad():
                    out = fn()
                return out
            return call
        c = args.causal
        fns[f"{lib} mix"] = mk(lambda varlen=varlen: varlen(q, k, v, cu_all, cu_all, longest, longest, causal=c))
        fns[f"{lib} long"] = mk(lambda varlen=varlen: varlen(ql, kl, vl, cu_long, cu_long, longest, longest, causal=c))
        fns[f"{lib} long_dense"] = mk(lambda dense=dense: dense(ql[None], kl[None], vl[None], causal=c))
        fns[f"{lib} rest"] = mk(lambda varlen=varlen: varlen(qr, kr, vr, cu_rest, cu_rest, max(others), max(others),
                                                              causal=c))
    errors: dict[str, str] = {}
    ms = bench.cuda_time_ms_interleaved(fns, [{}], 3, args.iters, errors=errors)
    print(f"mix {args.mix}: {len(lengths)} sequences, longest {longest}, the rest {min(others)}-{max(others)} "
          f"({sum(others)} tokens); hdim {args.hdim}, {'causal' if args.causal else 'full'}, heads {heads}")
    print(f"{'call':<20}{'ms':>10}{'TFLOP/s':>10}")
    for name, t in ms.items():
        part = name.split()[1]
        print(f"{name:<20}{t:>10.4f}{flops[part] / (t * 1e-3) / 1e12:>10.1f}")
    for lib in libs:
        if all(f"{lib} {x}" in ms for x in ("mix", "long", "rest")):
            parts = ms[f"{lib} long"] + ms[f"{lib} rest"]
            print(f"{lib}: mix {ms[f'{lib} mix']:.4f} ms against long + rest {parts:.4f} ms "
                  f"({ms[f'{lib} mix'] / parts:.3f})")
    for name, e in errors.items():
        print(f"  {name}: {e}")

    from torch.profiler import ProfilerActivity, profile

    for lib in libs:
        fn = fns[f"{lib} mix"]
        fn({})
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn({})
            torch.cuda.synchronize()
        print(f"kernels of {lib} mix (3 calls):")
        def gpu_us(ev):
            return getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)

        for ev in sorted(prof.key_averages(), key=lambda e: -gpu_us(e))[:6]:
            if gpu_us(ev) > 0:
                print(f"  {ev.count:3d} x {gpu_us(ev) / max(ev.count, 1):9.1f} us  {ev.key[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
