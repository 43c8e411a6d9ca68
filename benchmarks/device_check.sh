#!/usr/bin/env bash
# Ragged paged attention on a lent GPU (an H200: 32 query / 8 KV heads, head_dim 128, bf16).
#
#   PYTHONPATH=. bash benchmarks/device_check.sh            # on the GPU machine, from the repo root
#   PYTHONPATH=. bash benchmarks/device_check.sh --smoke    # tiny sizes, any machine (CPU: interpret mode)
#
# 1. correctness: the natively compiled Pallas Triton kernel against the jnp reference and a
#    float64 numpy oracle on hostile ragged batches (decode, mixed, prefill, KV splits, GQA 3 and
#    1, a layer-stacked cache, sliding window + soft cap); stops here if any check fails;
# 2. timing: decode batches of 64, 128 and 256 sequences x 1k, 2k, 4k and 8k context (plus a
#    ragged-context and a mixed batch), end to end and kernel only, with achieved HBM bandwidth
#    (bytes of K/V the batch needs / median time) against the copy bandwidth measured in the
#    same run (target: >= 70 %);
# 3. a small sweep of kernel configurations on two decode cases (the best one is reported).
# Every step has its own timeout; the whole script stays under ~7 minutes even if all expire.
# Results go to $OUT if set, else benchmarks/results/: device_check.log, device_check_correctness.json,
# kernel_bench_gpu.json, kernel_tune_gpu.json. No network is used.
set -uo pipefail

SMOKE=0
if [[ "${1:-}" == "--smoke" ]]; then SMOKE=1; fi
OUT_DIR="${OUT:-benchmarks/results}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python}"
LOG="$OUT_DIR/device_check.log"
export PYTHONPATH="${PYTHONPATH:-.}"
export PYTHONUNBUFFERED=1

if [[ $SMOKE == 1 ]]; then
  SUITE=smoke; T_CHECK=300; T_BENCH=300; T_TUNE=300; REPS=3; BUDGET=1
else
  SUITE=gpu; T_CHECK=150; T_BENCH=200; T_TUNE=70; REPS=25; BUDGET=2
fi

start=$(date +%s)
{
  echo "== device_check $(date -u +%Y-%m-%dT%H:%M:%SZ) suite=$SUITE"
  git rev-parse --short HEAD 2>/dev/null || true
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import sys, jax; print('python', sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
} 2>&1 | tee "$LOG"

echo "== 1/3 correctness (timeout ${T_CHECK}s)" | tee -a "$LOG"
timeout "$T_CHECK" "$PY" benchmarks/kernel_bench.py --suite "$SUITE" --check-only \
  --out "$OUT_DIR/device_check_correctness.json" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
if [[ $rc != 0 ]]; then
  echo "== correctness failed or timed out (rc=$rc): not timing a wrong kernel" | tee -a "$LOG"
  exit "$rc"
fi

echo "== 2/3 timing (timeout ${T_BENCH}s)" | tee -a "$LOG"
timeout "$T_BENCH" "$PY" benchmarks/kernel_bench.py --suite "$SUITE" --reps "$REPS" --budget-s "$BUDGET" \
  --out "$OUT_DIR/kernel_bench_gpu.json" 2>&1 | tee -a "$LOG"
bench_rc=${PIPESTATUS[0]}

echo "== 3/3 kernel configurations (timeout ${T_TUNE}s)" | tee -a "$LOG"
timeout "$T_TUNE" "$PY" benchmarks/kernel_bench.py --suite "$SUITE" --tune-only --reps "$REPS" --budget-s "$BUDGET" \
  --out "$OUT_DIR/kernel_tune_gpu.json" 2>&1 | tee -a "$LOG"
tune_rc=${PIPESTATUS[0]}

echo "== summary (bench rc=$bench_rc, tune rc=$tune_rc, $(( $(date +%s) - start ))s)" | tee -a "$LOG"
"$PY" - "$OUT_DIR/kernel_bench_gpu.json" <<'PYEOF' 2>&1 | tee -a "$LOG"
import json, sys
try:
    doc = json.load(open(sys.argv[1]))
except Exception as e:  # the timing step may have been cut short before its first write
    sys.exit(f"no timing results: {e}")
m = doc["machine"]
print(f"{m['device']}  jax {m['jax']}  copy bandwidth {m['ceiling_gb_s']:.0f} GB/s (read+write)")
print(f"{'case':44s} {'backend':14s} {'median ms':>10s} {'GB/s':>8s} {'of copy':>8s}")
for r in doc["results"]:
    if "median_ms" in r:
        flag = "  >= 70%" if r["backend"].startswith("pallas") and r["fraction_of_ceiling"] >= 0.7 else ""
        print(f"{r['case']:44s} {r['backend']:14s} {r['median_ms']:10.3f} {r['gb_s']:8.0f} "
              f"{100 * r['fraction_of_ceiling']:7.1f}%{flag}")
dec = [r for r in doc["results"] if r.get("backend") == "pallas" and r.get("kind") == "decode" and "gb_s" in r]
if dec:
    fr = sorted(r["fraction_of_ceiling"] for r in dec)
    print(f"pallas decode, end to end: median {100 * fr[len(fr) // 2]:.1f}% of copy bandwidth, "
          f"min {100 * fr[0]:.1f}%, max {100 * fr[-1]:.1f}% (target >= 70%)")
PYEOF
exit "$bench_rc"
