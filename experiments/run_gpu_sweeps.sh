#!/usr/bin/env bash
# Re-run the committed quality sweeps with the GPU size preset (issue P item 2: configs/sweep_sizes_gpu.yaml,
# >= 64K scored serving-path tokens per point, passkey 20 trials per cell up to 8K) into OUT/<sweep>/ (default
# docs/results/gpu).  The serving ppl (with KL / top-1 vs the fp32 cache), passkey and bytes run; the fast-path
# ppl, K/V-error and greedy-agreement tasks stay at their CPU size in docs/results/<sweep>/ (disabled here: the
# serving path is the one the issue sizes, and device time is scarce).
# One process runs every sweep, sharing the model, the corpora and the baseline's serving reference; rerunning
# resumes every sweep from its results.jsonl.  Needs WikiText-2 ($KVQ_DATA_DIR) and SmolLM2.
#     bash experiments/run_gpu_sweeps.sh [OUT] [SWEEP ...]
set -u
OUT=${1:-docs/results/gpu}
shift || true
SWEEPS=${*:-int kivi_residual kivi_axes fp8 mixed_layers w8a8 passkey kvquant_main}
KVQ=${KVQ:-kvq}
CONFIGS=()
for s in $SWEEPS; do
  CONFIGS+=("configs/sweeps/$s.yaml")
  if [ "$s" = kvquant_main ]; then          # its three calibration artifacts (WikiText-2 validation), once
    for b in 4 3 2; do
      [ -e artifacts/kvquant/smollm2_nuq${b}_o1_sink ] || \
        $KVQ calibrate configs/calibration/kvquant_smollm2_nuq$b.yaml --out artifacts/kvquant/smollm2_nuq${b}_o1_sink
    done
  fi
done
t0=$(date +%s)
# kvq sweep writes several configs into OUT/<sweep>/ but ONE config into OUT itself: keep OUT/<sweep>/ either way
# (2026-12-02: a kvquant_main-only run wrote its rows over OUT/'s top level)
DEST=$OUT
[ ${#CONFIGS[@]} = 1 ] && DEST=$OUT/$SWEEPS
$KVQ sweep "${CONFIGS[@]}" --sizes gpu --set tasks.ppl.enabled=false --set tasks.kv_error.enabled=false \
  --set tasks.agreement.enabled=false \
  --out "$DEST" --no-progress
echo "[gpu_sweeps] rc $? in $(( $(date +%s) - t0 )) s"
