"""Quick GPU check of the forward kernel (torch.ops.dash.fwd) without the Python API:
max error of out and lse vs the float64 reference against FA3's bound, every output
element written (poison), then --bench: forward TFLOP/s beside torch's cuDNN and flash
SDPA forwards on the paper grid. Prints as it goes (a hang shows where it stopped)."""

import argparse
import math
import os
import sys

import torch

from dash import reference
from dash._bench import refuse_without_gpu


def run_fwd(q, k, v, causal):
    return torch.ops.dash.fwd(q, k, v, q.shape[-1] ** -0.5, causal, False, "fa3", 0)


def case(b, sq, sk, h, d, causal, dtype=torch.bfloat16, hk=None):
    torch.manual_seed(sq * 7 + sk * 3 + h + d + causal)
    hk = hk or h
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    print(f"  b={b} sq={sq} sk={sk} h={h}/{hk} d={d} causal={causal} {str(dtype)[6:]} ...", end="", flush=True)
    os.environ["DASH_POISON_OUTPUTS"] = "1"
    out, lse = run_fwd(q, k, v, causal)
    torch.cuda.synchronize()
    os.environ["DASH_POISON_OUTPUTS"] = "0"
    hi_o, hi_l = reference.attention_forward(q, k, v, causal=causal, compute_dtype=torch.float64)
    lo_o, lo_l = reference.attention_forward(q, k, v, causal=causal, compute_dtype=dtype)
    err_o = (out.double() - hi_o).abs().max().item()
    bound_o = reference.error_bound(hi_o, lo_o)
    fin = torch.isfinite(hi_l)
    err_l = (lse.double() - hi_l)[fin].abs().max().item() if fin.any() else 0.0
    lse_ok = bool(torch.equal(torch.isinf(lse), ~fin)) and err_l <= 1e-3 * max(1.0, hi_l[fin].abs().max().item())
    ok = err_o <= bound_o and bool(torch.isfinite(out).all()) and lse_ok
    print(f" {'OK ' if ok else 'BAD'} out {err_o:.2e}/{bound_o:.2e} lse {err_l:.2e}", flush=True)
    return ok


def bench(d, causal, seqlen, dtype=torch.bfloat16, total_tokens=16384, hidden=2048, iters=20):
    b, h = max(1, total_tokens // seqlen), hidden // d
    q, k, v = (torch.randn(b, seqlen, h, d, device="cuda", dtype=dtype) for _ in range(3))
    flops = 4 * b * h * seqlen * seqlen * d / (2 if causal else 1)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def f():
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        return f

    fns = {"dash": lambda: run_fwd(q, k, v, causal), "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
           "flash2": sdpa(SDPBackend.FLASH_ATTENTION)}
    res = {}
    for name, fn in fns.items():
        for _ in range(3):
            fn()
        ts = []
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
        ts.sort()
        res[name] = flops / (ts[len(ts) // 2] * 1e-3) / 1e12
    print(f"  hd{d} {'causal' if causal else 'full  '} {seqlen:>5}: " +
          "  ".join(f"{n} {t:6.1f}" for n, t in res.items()) + f"   dash/cudnn {res['dash'] / res['cudnn']:.3f}",
          flush=True)
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--hdim", type=int, nargs="*", default=[64, 128])
    args = ap.parse_args()
    status = refuse_without_gpu("smoke_fwd.py")
    if status:
        sys.exit(status)
    # After the check: loading the kernels without a GPU or a build is a traceback, not a message.
    import dash._C  # noqa: F401  (registers torch.ops.dash)
    all_ok = True
    if not args.no_check:
        for d in args.hdim:
            for causal in (False, True):
                all_ok &= case(1, 256, 256, 2, d, causal)
                all_ok &= case(2, 1000, 777, 3, d, causal)
                all_ok &= case(1, 777, 1000, 3, d, causal)
                all_ok &= case(1, 113, 203, 2, d, causal)
                all_ok &= case(1, 203, 113, 2, d, causal)
                all_ok &= case(1, 1, 1, 1, d, causal)
                all_ok &= case(1, 640, 1024, 8, d, causal, hk=2)
                all_ok &= case(2, 640, 640, 6, d, causal, hk=1)
                all_ok &= case(1, 512, 512, 4, d, causal, dtype=torch.float16)
                all_ok &= case(1, 4096, 4096, 2, d, causal)
        print("SMOKE", "PASS" if all_ok else "FAIL", flush=True)
    if args.bench:
        geo = {}
        for d in args.hdim:
            for causal in (False, True):
                for s in (512, 1024, 2048, 4096, 8192, 16384):
                    r = bench(d, causal, s)
                    geo.setdefault("dash/cudnn", []).append(r["dash"] / r["cudnn"])
        g = geo["dash/cudnn"]
        print(f"geomean dash/cudnn {math.exp(sum(map(math.log, g)) / len(g)):.3f} worst {min(g):.3f}")
    sys.exit(0 if all_ok else 1)
