#!/usr/bin/env bash
# The first iteration's gradient norm of small models on one GPU in bf16: the norm of the mean
# loss's gradient over the step's 4 samples, whether they run as 4 microbatches or one, with
# or without full recomputation. Every run of a preset must give its first run's norm (within
# 1e-3 relative: bf16 sums in another order); a run that differs, fails or prints no norm is a
# FAIL line, and the script exits 1. Presets: the dense GPT (GPT-3 6.7B's shape, 2 layers),
# the DeepSeek-like and Mixtral-like MoE presets (2 layers, EP 1), these also with
# `--moe-aux-loss-coeff 0` (the auxiliary loss changes the gradient a little, so that run is
# printed, not compared).
#   bash bench/gradnorm_gpu_check.sh     (needs .gpu/bin/{pretrain_gpt,bm-launch})
#   MOE_ONLY=1 bash bench/gradnorm_gpu_check.sh   (the MoE presets at 1 and 4 microbatches only)
set -u
cd "$(dirname "$0")/.."
source .gpu/env.sh
for z in .gpu/bin/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done 2>/dev/null
chmod +x .gpu/bin/* 2>/dev/null
COMMON="--bf16 --no-save --eval-interval 0 --log-interval 1 --collective-checks false --lr-warmup-iters 1 --train-iters 2 --num-layers 2 --global-batch-size 4 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --data-parallel-size 1"
FAILED=0
# Prints the run's first iteration line and sets NORM to its gradient norm ("" if none).
norm() { # label, flags...
  local label=$1; shift
  local line
  line=$(timeout 120 .gpu/bin/bm-launch --nproc-per-node 1 -- .gpu/bin/pretrain_gpt $COMMON "$@" 2>&1 | grep -E "iteration +1/|rror|panick" | head -2 | cut -c1-160)
  echo "$label: $line"
  NORM=$(sed -n 's/.*grad norm \([0-9.eE+-]*\).*/\1/p' <<< "$line" | head -1)
}
# Compares NORM with the preset's reference norm.
same() { # label, reference
  if ! [[ $NORM =~ ^[0-9] && $2 =~ ^[0-9] ]] || ! awk -v a="$NORM" -v b="$2" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(b > 0 && d <= 1e-3 * b) }'; then
    echo "FAIL $1: grad norm '${NORM}' against '${2}'"
    FAILED=1
  fi
}
for preset in gpt3_6.7b deepseek_moe_1b mixtral_1b_moe; do
  C="--config examples/configs/$preset.toml"
  [ $preset = gpt3_6.7b ] || C="$C --expert-model-parallel-size 1"
  [ -n "${MOE_ONLY:-}" ] && [ $preset = gpt3_6.7b ] && continue
  norm "$preset 1 microbatch" $C --micro-batch-size 4
  ref=$NORM
  norm "$preset 4 microbatches" $C --micro-batch-size 1
  same "$preset 4 microbatches" "$ref"
  [ -n "${MOE_ONLY:-}" ] && continue
  for mb in 4 1; do
    norm "$preset mb=$mb, full recomputation" $C --micro-batch-size $mb --recompute-granularity full
    same "$preset mb=$mb, full recomputation" "$ref"
  done
  [ $preset = gpt3_6.7b ] || norm "$preset 4 microbatches, aux loss 0 (not compared)" $C --micro-batch-size 1 --moe-aux-loss-coeff 0
done
[ $FAILED = 0 ] && echo "GRADNORM PASS" || echo "GRADNORM FAIL"
exit $FAILED
