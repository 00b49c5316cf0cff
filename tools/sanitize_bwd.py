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
                    q = torch.randn(b, sq, h, head_dim, dtype=torch.bfloat16).cuda()
                    k = torch.randn(b, sk, hk, head_dim, dtype=torch.bfloat16).cuda()
                    v = torch.randn(b, sk, hk, head_dim, dtype=torch.bfloat16).cuda()
                    dout = torch.randn(b, sq, h, head_dim, dtype=torch.bfloat16).cuda()
                    # The reference forward (plain PyTorch) on the host, uploaded: the only kernels
                    # on the device are DASH's. initcheck runs with a kernel filter, so it would
                    # not see the writes of uninstrumented torch kernels and would report their
                    # outputs as uninitialised; a host-to-device copy initialises what it writes.
                    out, lse = reference.attention_forward(q.cpu(), k.cpu(), v.cpu(), causal=causal,
                                                           compute_dtype=torch.float32)
                    out, lse = out.to(q.dtype).cuda(), lse.float().cuda()
                    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det,
                                                    schedule=schedule)
                    torch.cuda.synchronize()
                    # What DASH's kernels wrote is checked on the host: initcheck inspects that
                    # device-to-host copy (an element no kernel wrote is reported there). Under
                    # GQA dk/dv are cast from DASH's fp32 accumulators by a torch kernel, which
                    # initcheck does not instrument, so they are checked on the device instead.
                    on_host = (dq, dk, dv) if h == hk else (dq,)
                    on_device = () if h == hk else (dk, dv)
                    ok = all(torch.isfinite(t.cpu()).all().item() for t in on_host) and \
                        all(torch.isfinite(t).all().item() for t in on_device)
                    print(f"hdim {head_dim} b{b} sq{sq} sk{sk} h{h}/{hk} causal={causal} det={det} {schedule}: "
                          f"{'finite' if ok else 'NON-FINITE'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
