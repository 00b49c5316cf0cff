"""Small backward launches for compute-sanitizer (memcheck, racecheck, synccheck, initcheck).

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python tools/sanitize_bwd.py
    compute-sanitizer --tool racecheck python tools/sanitize_bwd.py

Disabling the caching allocator makes every workspace and output its own allocation, so an
out-of-bounds access is caught instead of landing in a neighbouring cached block. Shapes are
tiny (the tools slow kernels down by orders of magnitude) but cover ragged tiles, seqlen_q !=
seqlen_k, causal, GQA (the in-kernel ordered dK/dV reduction), both head dims, both
reduction modes and every kernel schedule (shift: full masks; its grid-planned waves).
"""

import sys

import torch

from dash import reference
from dash._bench import refuse_without_gpu
from dash.api import attention_backward

SHAPES = [  # (batch, seqlen_q, seqlen_k, heads, heads_k)
    (1, 200, 333, 2, 1),
    (2, 129, 64, 1, 1),
]


def main() -> int:
    status = refuse_without_gpu("sanitize_bwd.py")
    if status:
        return status
    torch.manual_seed(0)
    for head_dim in (64, 128):
        for b, sq, sk, h, hk in SHAPES:
            for causal in (False, True):
                for det, schedule in ((False, "auto"), (True, "fa3"), (True, "interleaved"), (True, "descending"),
                                      (True, "shift")):
                    if schedule == "shift" and (causal or -(-sk // 128) > -(-sq // 128)):
                        continue
                    q = torch.randn(b, sq, h, head_dim, device="cuda", dtype=torch.bfloat16)
                    k = torch.randn(b, sk, hk, head_dim, device="cuda", dtype=torch.bfloat16)
                    v = torch.randn_like(k)
                    dout = torch.randn_like(q)
                    # The reference forward (plain PyTorch), so that the only custom kernels the
                    # sanitizer sees are DASH's.
                    out, lse = reference.attention_forward(q, k, v, causal=causal, compute_dtype=torch.float32)
                    out, lse = out.to(q.dtype), lse.float()
                    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det,
                                                    schedule=schedule)
                    torch.cuda.synchronize()
                    ok = all(torch.isfinite(t).all().item() for t in (dq, dk, dv))
                    print(f"hdim {head_dim} b{b} sq{sq} sk{sk} h{h}/{hk} causal={causal} det={det} {schedule}: "
                          f"{'finite' if ok else 'NON-FINITE'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
