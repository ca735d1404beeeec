#!/usr/bin/env bash
# The first iteration's gradient norm of one small model on one GPU in bf16, with the step's
# 4 samples as 4 microbatches or one, with and without full recomputation: all four must agree
# (the norm of the mean loss's gradient). Dense (GPT-3 6.7B's shape with 2 layers) and MoE (the
# DeepSeek-like preset with 2 layers, EP 1).
#   bash bench/gradnorm_gpu_check.sh     (needs .gpu/bin/{pretrain_gpt,bm-launch})
#   MOE_ONLY=1 bash bench/gradnorm_gpu_check.sh   (the MoE presets, with and without the aux loss)
set -u
cd "$(dirname "$0")/.."
source .gpu/env.sh
for z in .gpu/bin/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done 2>/dev/null
chmod +x .gpu/bin/* 2>/dev/null
COMMON="--bf16 --no-save --eval-interval 0 --log-interval 1 --collective-checks false --lr-warmup-iters 1 --train-iters 2 --num-layers 2 --global-batch-size 4 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --data-parallel-size 1"
norm() { # label, flags...
  local label=$1; shift
  line=$(timeout 120 .gpu/bin/bm-launch --nproc-per-node 1 -- .gpu/bin/pretrain_gpt $COMMON "$@" 2>&1 | grep -E "iteration +1/|rror|panick" | head -2 | cut -c1-160)
  echo "$label: $line"
}
if [ -n "${MOE_ONLY:-}" ]; then
  # The MoE presets at 4 microbatches without recomputation, with and without their auxiliary
  # loss, and at one microbatch.
  for preset in deepseek_moe_1b mixtral_1b_moe; do
    C="--config examples/configs/$preset.toml --expert-model-parallel-size 1"
    norm "$preset mb=1" $C --micro-batch-size 1
    norm "$preset mb=1 aux 0" $C --micro-batch-size 1 --moe-aux-loss-coeff 0
    norm "$preset mb=4" $C --micro-batch-size 4
  done
  exit 0
fi
for preset in gpt3_6.7b deepseek_moe_1b; do
  extra=""
  [ $preset = deepseek_moe_1b ] && extra="--expert-model-parallel-size 1"
  for mb in 1 4; do
    for rc in "" "--recompute-granularity full"; do
      line=$(timeout 120 .gpu/bin/bm-launch --nproc-per-node 1 -- .gpu/bin/pretrain_gpt --config examples/configs/$preset.toml $COMMON $extra --micro-batch-size $mb $rc 2>&1 | grep -E "iteration +1/|rror|panick" | head -2 | cut -c1-160)
      echo "$preset mb=$mb ${rc:-no-recompute}: $line"
    done
  done
done
