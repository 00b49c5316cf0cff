#!/usr/bin/env bash
# One device call: what a kernel change must pass before it counts (GPU tests, benchmark,
# traces), each stage under its own time limit so that a hang costs one stage, not the call.
#
#   tools/gpu_check.sh STAGES...     e.g. tools/gpu_check.sh info smoke deadlock tests bench trace
#                                    (alltests: every GPU test file, all failures listed)
#
# Runs from the repository root against the kernels built beside the sources (pip install
# --no-build-isolation . places them in dash/); logs and results go to $OUT (or ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
stage() { local name=$1 limit=$2; shift 2; echo "=== $name (limit ${limit}s)"; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s"; tail -n "${TAIL:-25}" "$OUT/$name.log"; }
for s in "$@"; do case $s in
  info)     stage info 60 $PY -m dash info ;;
  smoke)    stage smoke 120 $PY tools/smoke_bwd.py ;;
  deadlock) stage deadlock 300 $PY -m pytest -q -x tests/test_schedules_gpu.py -k deadlock ;;
  tests)    stage tests 420 $PY -m pytest -q -x tests/test_schedules_gpu.py tests/test_bwd_gpu.py ;;
  hf)       stage hf 240 $PY -m pytest -q -x tests/test_integration_transformers.py ;;
  alltests) # every GPU test file, without -x: the first run after CPU-only sessions should list every failure
            stage alltests 560 $PY -m pytest -q -rf tests/test_fwd_gpu.py tests/test_bwd_gpu.py \
              tests/test_schedules_gpu.py tests/test_fa3_entry_points.py tests/test_dispatch.py tests/test_trace.py \
              tests/test_integration_transformers.py ;;
  slow)     stage slow 500 $PY -m pytest -q -x -m slow tests/test_schedules_gpu.py tests/test_bwd_gpu.py ;;
  bench)    stage bench 420 $PY benchmarks/bench_bwd.py --out-dir "$OUT" ;;
  sanitize) # the forward's and the backward's launches, dense and packed (varlen) batches
            for dir in fwd bwd; do for tool in synccheck racecheck memcheck initcheck; do
              stage "sanitize-$dir-$tool" 150 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool $tool \
                --kernel-name regex=${dir}_ --print-limit 20 $PY tools/sanitize_$dir.py; done; done ;;
  fa3build) # upstream FA3 as an anchor (never part of the repository): .anchors/fa3 prepared by
            # ../shared/tools/fa3-anchor.sh; built in the background while other stages run.
            ( MAX_JOBS=12 bash .anchors/fa3-anchor.sh build .anchors/fa3 > "$OUT/fa3build.log" 2>&1 ) &
            FA3_PID=$! ;;
  fa3wait)  echo "=== waiting for the FA3 build"; wait "$FA3_PID"; tail -3 "$OUT/fa3build.log"
            export PYTHONPATH=$PYTHONPATH:/tmp/fa3/hopper ;;
  trace)    stage trace 240 bash -c "for a in '--seqlen 2048 --hdim 64' '--seqlen 8192 --hdim 128 --causal' \
              '--seqlen 4096 --hdim 128 --schedule fa3'; do $PY -m dash trace \$a --gantt $OUT/trace-\$(echo \$a | tr -d ' -').png \
              --json $OUT/trace-\$(echo \$a | tr -d ' -').json; done" ;;
  *) echo "unknown stage $s"; exit 2 ;;
esac; done
