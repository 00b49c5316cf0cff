"""Standalone runner for Nsight Compute / Nsight Systems: one backward shape, a few calls.

    ncu --clock-control none -k regex:bwd_main_kernel -c 1 python tools/profile_bwd.py --seqlen 4096 --hdim 128 --causal
    nsys profile -t cuda,nvtx python tools/profile_bwd.py --seqlen 8192 --hdim 64 --deterministic

Each backward call is wrapped in an NVTX range named by variant (dash.bwd hdim.. causal ..).
"""

import argparse
import sys

import torch

from dash import reference
from dash._bench import refuse_without_gpu
from dash.api import attention_backward
from dash.cli import OneLineErrorParser, head_dim, positive_int


def main() -> int:
    # Sizes checked while parsing (one-line errors): --seqlen 0 would divide by zero below.
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=positive_int, default=4096)
    p.add_argument("--seqlen-k", type=positive_int, default=None)
    p.add_argument("--hdim", type=head_dim, default=128)
    p.add_argument("--batch", type=positive_int, default=None, help="default: 16384 // seqlen")
    p.add_argument("--heads", type=positive_int, default=None, help="default: 2048 // hdim")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--calls", type=positive_int, default=3)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    a = p.parse_args()
    status = refuse_without_gpu("profile_bwd.py")
    if status:
        return status
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    b, h = a.batch or max(16384 // a.seqlen, 1), a.heads or 2048 // a.hdim
    sk = a.seqlen_k or a.seqlen
    q = torch.randn(b, a.seqlen, h, a.hdim, device="cuda", dtype=dt)
    k = torch.randn(b, sk, h, a.hdim, device="cuda", dtype=dt)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    with torch.no_grad():
        out, lse = reference.attention_forward(q, k, v, causal=a.causal, compute_dtype=torch.float32)
    out, lse = out.to(dt), lse.float()
    for _ in range(a.calls):
        attention_backward(dout, q, k, v, out, lse, causal=a.causal, deterministic=a.deterministic)
    torch.cuda.synchronize()
    print(f"ran {a.calls} backward calls: b{b} h{h} sq{a.seqlen} sk{sk} d{a.hdim} causal={a.causal} "
          f"deterministic={a.deterministic}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
