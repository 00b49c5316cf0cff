#!/usr/bin/env bash
# A/B timing of kernel builds on the GPU machine, in one device call: builds in alternating
# processes (two rounds), each row's DASH time normalised by torch cuDNN in the same process
# (tools/ab_time.py), then a summary per variant: speed-up over the base build per row, its
# geometric mean, and whether the outputs' bits match the base build's (forward; backward too
# when deterministic).
#
#   tools/ab_run.sh "fwd|bwd|bwd --deterministic" NAME=DIR ...   (base = this checkout's dash/)
#
# DIR holds a variant's _C*.so and _build_manifest.json, and its dash/config.py when its table
# differs (carry it); it is run as a copy of this checkout's dash/ with those files swapped in.
# AB_TIME_ARGS is passed on to tools/ab_time.py (e.g. "--hdim 64 --seqlen 2048 16384").
# AB_BASE=DIR takes the base build from DIR like a variant's, instead of this checkout's dash/
# (which refuses kernels built from other sources than its csrc/, e.g. a kept build of an older
# commit whose kernels are the same). Lines go to $OUT/ab.jsonl.
set -u
ops=$1; shift
OUT=${OUT:-ab-out}; mkdir -p "$OUT"; rm -f "$OUT/ab.jsonl" "$OUT/ab.err"
if [ -n "${AB_BASE:-}" ]; then builds=(); set -- "base=$AB_BASE" "$@"; else builds=("base:$PWD"); fi
for v in "$@"; do
  name=${v%%=*}; dir=${v#*=}; pkg=/tmp/ab-$name
  rm -rf "$pkg" && mkdir -p "$pkg" && cp -r dash "$pkg/" \
    && cp "$dir"/_C*.so "$dir"/_build_manifest.json "$pkg/dash/" \
    || { echo "ab_run: variant $name: no _C*.so and _build_manifest.json in $dir" >&2; exit 1; }
  # A variant built from another table brings its dash/config.py, so that the Python side reads the
  # table its kernels were compiled from.
  if [ -f "$dir/config.py" ]; then cp "$dir/config.py" "$pkg/dash/"; fi
  builds+=("$name:$pkg")
done
IFS='|' read -ra oplist <<< "$ops"
for r in 1 2; do for b in "${builds[@]}"; do for op in "${oplist[@]}"; do
  PYTHONPATH=${b#*:} timeout 200 python tools/ab_time.py --label "${b%%:*}" --op $op ${AB_TIME_ARGS:-} >> "$OUT/ab.jsonl" 2>> "$OUT/ab.err"
done; done; done
python - "$OUT/ab.jsonl" <<'PY'
import json, sys, collections, math
rows = [json.loads(l) for l in open(sys.argv[1])]
t = collections.defaultdict(list); dig = collections.defaultdict(dict)
raw = collections.defaultdict(list); mhz = collections.defaultdict(list)  # DASH's own time and clock
burst = collections.defaultdict(list)  # --sustained: the burst timing taken before it, normalised as above
mean = lambda x: sum(x) / len(x)
for r in rows:
    key = (r["op"] + (" det" if r.get("deterministic") else ""), r["hdim"], "causal" if r["causal"] else "full", r["seqlen"])
    t[key, r["label"]].append(r["dash_over_cudnn_time"]); dig[key][r["label"]] = r.get("digest")
    raw[key, r["label"]].append(r["dash_ms"])
    if r.get("dash_sm_mhz"): mhz[key, r["label"]].append(r["dash_sm_mhz"])
    if r.get("burst_dash_ms"): burst[key, r["label"]].append(r["burst_dash_ms"] / r["burst_cudnn_ms"])
labels = sorted({l for _, l in t} - {"base"})
for lab in labels:
    g = collections.defaultdict(list)
    for key in sorted({k for k, _ in t}):
        a, b = t[key, "base"], t.get((key, lab))
        if not a or not b: continue
        s = (sum(a) / len(a)) / (sum(b) / len(b)); g[key[0]].append(s)
        nondet_bwd = key[0] == "bwd"  # the non-deterministic backward's bits vary from run to run anyway
        same = "same bits" if dig[key].get(lab) == dig[key].get("base") else (
            "bwd bits differ (non-det: expected)" if nondet_bwd else "BITS DIFFER")
        # Under --sustained: DASH's own time ratio and median SM clocks (base / variant) as well.
        extra = (f"  raw {mean(raw[key, 'base']) / mean(raw[key, lab]):.3f}  MHz {mean(mhz[key, 'base']):.0f}/{mean(mhz[key, lab]):.0f}"
                 if mhz.get((key, "base")) and mhz.get((key, lab)) else "")
        if burst.get((key, "base")) and burst.get((key, lab)):
            extra += f"  burst {mean(burst[key, 'base']) / mean(burst[key, lab]):.3f}"
        print(f"{lab:8s} {' '.join(map(str, key)):28s} speed-up {s:.3f}  base {' '.join('%.3f' % x for x in a)}  {lab} {' '.join('%.3f' % x for x in b)}  {same}{extra}")
    for op, v in g.items():
        print(f"{lab:8s} {op:10s} geomean speed-up {math.exp(sum(map(math.log, v)) / len(v)):.4f} over {len(v)} rows, worst {min(v):.3f}")
PY
tail -3 "$OUT/ab.err"
