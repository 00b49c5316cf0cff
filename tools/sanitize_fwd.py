"""Small forward launches for compute-sanitizer (memcheck, racecheck, synccheck).

    PYTHONPATH=$PWD PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
        --kernel-name regex=fwd_ python tools/sanitize_fwd.py

The forward's counterpart of tools/sanitize_bwd.py: tiny shapes (the tools slow kernels down by
orders of magnitude) that still cover ragged Q tiles and KV blocks, seqlen_q != seqlen_k both
ways (causal rows that see no key), GQA, both head dims and both masks; then packed batches
(flash_attn_varlen_func: empty sequences, sequences without keys, lengths off every tile size,
one sequence longer than a tile). Inputs are made on the host and uploaded, so the only
instrumented kernels are DASH's.
"""

import sys

import torch

from dash._bench import refuse_without_gpu
from dash.api import flash_attn_func, flash_attn_varlen_func

SHAPES = [  # (batch, seqlen_q, seqlen_k, heads, heads_k)
    (1, 200, 333, 2, 1),
    (2, 129, 64, 1, 1),
    (1, 64, 700, 3, 3),
]

# Packed batches: (lengths of q, lengths of k, heads, heads_k).
VARLEN_CASES = [
    ([1, 0, 239, 130], [1, 5, 239, 64], 2, 1),
    ([64, 13, 300], [333, 0, 129], 3, 3),
]


def offsets(lengths: list[int]) -> torch.Tensor:
    """cu_seqlens (int32, batch + 1) of ``lengths``, made on the host and uploaded."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).cuda()


def main() -> int:
    status = refuse_without_gpu("sanitize_fwd.py")
    if status:
        return status
    torch.manual_seed(0)
    failed = 0
    for head_dim in (64, 128):
        for b, sq, sk, h, hk in SHAPES:
            for causal in (False, True):
                q, k, v = (torch.randn(b, s, n, head_dim, dtype=torch.bfloat16).cuda()
                           for s, n in ((sq, h), (sk, hk), (sk, hk)))
                out = flash_attn_func(q, k, v, causal=causal)
                torch.cuda.synchronize()
                ok = torch.isfinite(out.cpu()).all().item()
                failed += not ok
                print(f"hdim {head_dim} b{b} sq{sq} sk{sk} h{h}/{hk} causal={causal}: "
                      f"{'finite' if ok else 'NON-FINITE'}", flush=True)
        for lens_q, lens_k, h, hk in VARLEN_CASES:
            for causal in (False, True):
                q, k, v = (torch.randn(sum(lens), n, head_dim, dtype=torch.bfloat16).cuda()
                           for lens, n in ((lens_q, h), (lens_k, hk), (lens_k, hk)))
                out = flash_attn_varlen_func(q, k, v, offsets(lens_q), offsets(lens_k), max(lens_q), max(lens_k),
                                             causal=causal)
                torch.cuda.synchronize()
                ok = torch.isfinite(out.cpu()).all().item()
                failed += not ok
                print(f"hdim {head_dim} varlen q{lens_q} k{lens_k} h{h}/{hk} causal={causal}: "
                      f"{'finite' if ok else 'NON-FINITE'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
