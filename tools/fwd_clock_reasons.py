"""Why the SM clock sits below its maximum under a sustained forward: nvidia-smi's clock-event
reasons (SW power cap, HW slowdown, power brake, thermal), instantaneous and average power and
temperature, sampled every 20 ms while DASH's forward and cuDNN's run back to back.

    python tools/fwd_clock_reasons.py [--hdim 128 64] [--seqlen 8192] [--seconds 2.5]

Per side and round it prints the time per call and the median (min, max) of each sampled
quantity, the reasons' bit masks with their sample counts, and per named reason the number of
samples in which it was active. Full mask, paper-grid shape (16k tokens, hidden 2048), bf16.
Used for docs/kernel-notes.md, twentieth pass (every sample: SW power cap).
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dash._bench import refuse_without_gpu  # noqa: E402
from dash.cli import OneLineErrorParser, head_dim, nonnegative_float, positive_int  # noqa: E402

FIELDS = ("timestamp", "clocks.sm", "power.draw.instant", "power.draw.average", "temperature.gpu",
          "clocks_event_reasons.active", "clocks_event_reasons.sw_power_cap", "clocks_event_reasons.hw_slowdown",
          "clocks_event_reasons.hw_power_brake_slowdown", "clocks_event_reasons.sw_thermal_slowdown",
          "clocks_event_reasons.hw_thermal_slowdown")
NAMED = ("sw_power_cap", "hw_slowdown", "hw_power_brake", "sw_thermal", "hw_thermal")  # FIELDS[6:]


def main() -> int:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hdim", type=head_dim, nargs="+", default=[128, 64])
    p.add_argument("--seqlen", type=positive_int, default=8192)
    p.add_argument("--seconds", type=nonnegative_float, default=2.5, help="per side and round (default 2.5)")
    a = p.parse_args()
    status = refuse_without_gpu("fwd_clock_reasons.py")
    if status:
        return status
    from dash import ops
    from dash.bench import Shape, back_to_back

    log = tempfile.NamedTemporaryFile("w+", suffix=".csv")
    proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
                             "-lms", "20"], stdout=log, stderr=subprocess.STDOUT)
    marks = []
    try:
        time.sleep(1.0)
        for d in a.hdim:
            sh = Shape.paper(a.seqlen, d, False)
            q, k, v = (torch.randn(sh.batch, a.seqlen, sh.heads, d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

            def cudnn():
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)

            sides = {"dash": lambda: ops.forward_impl(q, k, v, d ** -0.5, False), "cudnn": cudnn}
            for fn in sides.values():  # warm-up: cuDNN builds its plan on the first call
                fn()
            for r in range(2):
                for name, fn in (list(sides.items()) if r == 0 else list(sides.items())[::-1]):
                    time.sleep(0.5)
                    t0, t1, n = back_to_back(fn, a.seconds)
                    marks.append((f"hd{d} {name} round {r}", t0, t1, (t1 - t0) / n * 1e3))
        time.sleep(0.3)
    finally:
        proc.terminate()
        proc.wait()
    log.flush()
    rows = []
    for line in open(log.name):
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != len(FIELDS):
            continue
        try:
            stamp, frac = parts[0].split(".") if "." in parts[0] else (parts[0], "0")
            rows.append((time.mktime(time.strptime(stamp, "%Y/%m/%d %H:%M:%S")) + float("0." + frac), *parts[1:]))
        except ValueError:
            continue
    if not rows:
        print("fwd_clock_reasons.py: nvidia-smi gave no samples of these fields on this driver", file=sys.stderr)
        return 1
    for label, t0, t1, ms in marks:
        got = [r for r in rows if t0 + 0.3 <= r[0] <= t1]

        def stat(i):
            xs = sorted(float(r[i]) for r in got if r[i] not in ("[N/A]", "N/A"))
            return f"{xs[len(xs) // 2]:.0f} ({xs[0]:.0f}-{xs[-1]:.0f})" if xs else "n/a"

        masks = dict(collections.Counter(r[5] for r in got))
        active = {n: sum(1 for r in got if r[6 + j] == "Active") for j, n in enumerate(NAMED)}
        print(f"{label:20s} {ms:7.3f} ms  samples {len(got):3d}  SM MHz {stat(1)}  W inst {stat(2)}  "
              f"W avg {stat(3)}  C {stat(4)}  reasons {masks}  active {active}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
