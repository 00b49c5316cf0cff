"""Small backward launches for compute-sanitizer (memcheck, racecheck, synccheck, initcheck).

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python tools/sanitize_bwd.py
    compute-sanitizer --tool racecheck python tools/sanitize_bwd.py

Disabling the caching allocator makes every workspace and output its own allocation, so an
out-of-bounds access is caught instead of landing in a neighbouring cached block. Shapes are
tiny (the tools slow kernels down by orders of magnitude) but cover ragged tiles, seqlen_q !=
seqlen_k, causal, GQA (the in-kernel ordered dK/dV reduction), both head dims, both
reduction modes and every kernel schedule (shift: full masks; its grid-planned waves); then
packed batches (dash::bwd_varlen: empty sequences, sequences without keys, lengths off every
tile size, GQA) in both reduction modes and every schedule built for them.
"""

import sys

import torch

from dash import reference
from dash._bench import refuse_without_gpu
from dash.api import attention_backward
from dash.ops import run_backward_varlen
from dash.validation import VARLEN_KERNEL_SCHEDULES

SHAPES = [  # (batch, seqlen_q, seqlen_k, heads, heads_k)
    (1, 200, 333, 2, 1),
    (2, 129, 64, 1, 1),
]

# Packed batches: (lengths of q, lengths of k, heads, heads_k).
VARLEN_CASES = [
    ([1, 0, 239, 130], [1, 5, 239, 64], 2, 1),
    ([64, 13, 300], [333, 0, 129], 1, 1),
]


def offsets(lengths: list[int]) -> torch.Tensor:
    """cu_seqlens (int32, batch + 1) of ``lengths`` on the host."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def finite(on_host, on_device) -> bool:
    """What DASH's kernels wrote, checked on the host (initcheck inspects that device-to-host
    copy: an element no kernel wrote is reported there), and what a torch kernel cast from
    DASH's fp32 accumulators (GQA dk/dv; initcheck does not instrument it) on the device."""
    return all(torch.isfinite(t.cpu()).all().item() for t in on_host) and \
        all(torch.isfinite(t).all().item() for t in on_device)


def main() -> int:
    status = refuse_without_gpu("sanitize_bwd.py")
    if status:
        return status
    torch.manual_seed(0)
    failed = 0
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
                    ok = finite((dq, dk, dv) if h == hk else (dq,), () if h == hk else (dk, dv))
                    failed += not ok
                    print(f"hdim {head_dim} b{b} sq{sq} sk{sk} h{h}/{hk} causal={causal} det={det} {schedule}: "
                          f"{'finite' if ok else 'NON-FINITE'}", flush=True)
        for lens_q, lens_k, h, hk in VARLEN_CASES:
            cu_q, cu_k = offsets(lens_q), offsets(lens_k)
            q, dout = (torch.randn(sum(lens_q), h, head_dim, dtype=torch.bfloat16) for _ in range(2))
            k, v = (torch.randn(sum(lens_k), hk, head_dim, dtype=torch.bfloat16) for _ in range(2))
            for causal in (False, True):
                # As above: the reference forward on the host, uploaded.
                out, lse = reference.attention_forward_varlen(q, k, v, cu_q.tolist(), cu_k.tolist(), causal=causal,
                                                              compute_dtype=torch.float32)
                args = [t.cuda() for t in (dout, q, k, v, out.to(q.dtype), lse.float().contiguous(), cu_q, cu_k)]
                for det, schedule in [(False, "fa3")] + [(True, s) for s in VARLEN_KERNEL_SCHEDULES]:
                    dq, dk, dv = run_backward_varlen(*args, max(lens_q), max(lens_k), head_dim ** -0.5, causal, det,
                                                     schedule, 0)
                    torch.cuda.synchronize()
                    ok = finite((dq, dk, dv) if h == hk else (dq,), () if h == hk else (dk, dv))
                    failed += not ok
                    print(f"hdim {head_dim} varlen q{lens_q} k{lens_k} h{h}/{hk} causal={causal} det={det} "
                          f"{schedule}: {'finite' if ok else 'NON-FINITE'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
