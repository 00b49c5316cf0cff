"""One profiled call (between cudaProfilerStart/Stop, after 3 warm-ups) of DASH's or upstream
FA3's forward or backward (non-deterministic unless asked, paper-grid shape: 16k tokens, hidden 2048), as a
target for ncu side-by-side comparisons (docs/kernel-notes.md, fifth pass):

    ncu --kernel-name-base demangled --profile-from-start off --clock-control none \
        -k regex:fwd_main -c 1 --set full python tools/ncu_target.py dash fwd 8192 causal
    ncu ... -k regex:FlashAttnFwdSm90 ... python tools/ncu_target.py fa3 fwd 8192 causal

(bwd: regex:bwd_main / regex:FlashAttnBwdSm90). FA3 must be importable as
flash_attn_interface (built from flash-attention's hopper/, never part of this repository);
FA4 as flash_attn.cute (pip flash-attn-4, ../shared/tools/fa4-anchor.sh; its CuTe-DSL kernels
are named after their classes, e.g. regex:FlashAttentionBackwardSm90). FA4 compiles each
kernel on first use, inside the warm-up calls, so the profiled call is never a compile.

    python tools/ncu_target.py {dash|fa3|fa4} {fwd|bwd} SEQLEN {full|causal} [hdim] [det]

"det" runs the backward deterministically (deterministic=True: DASH's schedule "auto").
"""
import sys
from pathlib import Path

import torch

# Run as a script from anywhere: DASH from this checkout (a source tree with its built kernels).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if len(sys.argv) < 5 or sys.argv[1] not in ("dash", "fa3", "fa4") or sys.argv[2] not in ("fwd", "bwd") \
        or sys.argv[4] not in ("full", "causal"):
    sys.exit(__doc__)
if not torch.cuda.is_available():
    sys.exit("ncu_target: needs a CUDA GPU")
lib, pas, s, mask = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
d = int(sys.argv[5]) if len(sys.argv) > 5 else 128
deterministic = len(sys.argv) > 6 and sys.argv[6] == "det"
if len(sys.argv) > 6 and sys.argv[6] != "det":
    sys.exit(f"ncu_target: the sixth argument may only be 'det', not {sys.argv[6]!r}\n\n{__doc__}")
causal = mask == "causal"
b, h = max(1, 16384 // s), 2048 // d
q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
if lib == "dash":
    from dash import flash_attn_func
elif lib == "fa3":
    from flash_attn_interface import flash_attn_func
else:
    from flash_attn.cute import flash_attn_func


def call():
    if pas == "fwd":
        with torch.no_grad():
            flash_attn_func(q, k, v, causal=causal, deterministic=False)
    else:
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        o = flash_attn_func(qq, kk, vv, causal=causal, deterministic=deterministic)
        o = o[0] if isinstance(o, tuple) else o
        torch.autograd.grad(o, (qq, kk, vv), do)


for _ in range(3):
    call()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
call()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
