"""Quick GPU smoke check of the backward: a few shapes, max error vs the float64 reference
and the FA3-rule bound, printed as it goes (flushes, so a hang shows where it stopped)."""

import sys
import time

import torch

from dash import reference
from dash._bench import refuse_without_gpu
from dash.api import attention_backward


def case(b, sq, sk, h, d, causal, det, dtype=torch.bfloat16, schedule="auto", hk=None):
    torch.manual_seed(0)
    hk = hk or h
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    dout = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    out, lse = reference.attention_forward(q, k, v, causal=causal, compute_dtype=torch.float64)
    out, lse = out.to(dtype), lse.float()
    print(f"  launch b={b} sq={sq} sk={sk} h={h}/{hk} d={d} causal={causal} det={det} {schedule} ...", end="",
          flush=True)
    t0 = time.time()
    g = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det, schedule=schedule)
    torch.cuda.synchronize()
    hi = reference.attention_backward(dout, q, k, v, out, lse, causal=causal, compute_dtype=torch.float64)
    lo = reference.attention_backward(dout, q, k, v, out, lse, causal=causal, compute_dtype=dtype)
    msg = []
    ok = True
    for name, x, H, L in zip(("dq", "dk", "dv"), g, hi, lo):
        err = (x.double() - H).abs().max().item()
        bound = reference.error_bound(H, L)
        ok &= err <= bound and torch.isfinite(x).all().item()
        msg.append(f"{name} {err:.2e}/{bound:.2e}")
    print(f" {time.time() - t0:.2f}s {'OK ' if ok else 'BAD'} " + " ".join(msg), flush=True)
    return ok


if __name__ == "__main__":
    status = refuse_without_gpu("smoke_bwd.py")
    if status:
        sys.exit(status)
    all_ok = True
    for d in (64, 128):
        for causal in (False, True):
            for sched in ("fa3", "interleaved", "descending") + (() if causal else ("shift",)):
                for det in (False, True):
                    all_ok &= case(1, 256, 256, 2, d, causal, det, schedule=sched)
                all_ok &= case(2, 1000, 777, 3, d, causal, True, schedule=sched)
            all_ok &= case(1, 113, 203, 2, d, causal, False)
            all_ok &= case(1, 640, 1024, 8, d, causal, True, hk=2)
            all_ok &= case(1, 640, 1024, 6, d, causal, False, hk=1)
    print("SMOKE", "PASS" if all_ok else "FAIL", flush=True)
    sys.exit(0 if all_ok else 1)
