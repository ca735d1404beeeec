#!/usr/bin/env bash
# Pipeline schedules through pretrain_gpt on 2 GPUs (issue 31), in one device call (kind
# nvidia-h100-x2 or nvidia-h200-x2): the Llama-3 8B preset cut to LAYERS layers (16: 4.5 B
# parameters) at PP 2 with 1F1B and with the interleaved schedule (2 and 4 chunks a rank),
# TP 2 + SP for comparison, and the PyTorch FSDP2 peer (bench/torch_fsdp.py) on the same GPUs
# and shape; logs go to $OUT. Needs, packed under .gpu/ (bench/pack_gpu.sh):
#   bin/{pretrain_gpt,bm-launch}   bench/pack_gpu.sh build --release --features cuda
#       -p burn-megatron-examples --example pretrain_gpt -p burn-megatron-dist --bin bm-launch
#   LAYERS=16 ITERS=6 bash bench/pipeline_gpu_check.sh
#   PART=startup LAYERS=16 ITERS=3 bash bench/pipeline_gpu_check.sh   (start-up, first losses)
#   PART=uneven LAYERS=16 ITERS=6 bash bench/pipeline_gpu_check.sh   (uneven stages: the last
#       rank, which also runs the 128k-vocabulary output layer, holding fewer layers)
set -u
cd "$(dirname "$0")/.."
source .gpu/env.sh
for z in .gpu/bin/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done 2>/dev/null
chmod +x .gpu/bin/* 2>/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpus.txt
B=.gpu/bin
ITERS=${ITERS:-6}
LAYERS=${LAYERS:-16}
COMMON="--config examples/configs/llama3_8b.toml --num-layers $LAYERS --bf16 --no-save --eval-interval 0 --log-interval 1 --train-iters $ITERS --collective-checks false --lr-warmup-iters 2"
# Each line of a run's log with the seconds since its launch ("[+12.3s]"): the first
# iteration's line tells how long a user waits for it.
stamp() { local t0=${EPOCHREALTIME/./} line; while IFS= read -r line; do printf '%s [+%d.%ds]\n' "$line" $(( (${EPOCHREALTIME/./} - t0) / 1000000 )) $(( (${EPOCHREALTIME/./} - t0) / 100000 % 10 )); done; }
ours() { # name, flags...
  local name=$1; shift
  echo "=== ours $name: $*" | tee -a $OUT/pipeline.log
  local s=$(date +%s)
  timeout ${LIMIT:-150} $B/bm-launch --nproc-per-node 2 -- $B/pretrain_gpt $COMMON "$@" 2>&1 | stamp > $OUT/$name.log
  echo "rc=${PIPESTATUS[0]} seconds=$(( $(date +%s) - s ))" | tee -a $OUT/pipeline.log
  grep -E "start-up|training a GPT|iteration +[0-9]+/|Error|error|panicked" $OUT/$name.log | tail -$((ITERS + 3)) | cut -c1-400 | tee -a $OUT/pipeline.log
}
torch() { # name, flags...
  local name=$1; shift
  echo "=== torch $name: $*" | tee -a $OUT/pipeline.log
  timeout ${LIMIT:-150} torchrun --nproc-per-node 2 bench/torch_fsdp.py --preset llama3-8b --layers $LAYERS --steps $ITERS "$@" > $OUT/torch_$name.log 2>&1
  echo "rc=$?" | tee -a $OUT/pipeline.log
  grep -E "RESULT|step:|Error|error" $OUT/torch_$name.log | tail -4 | cut -c1-400 | tee -a $OUT/pipeline.log
}
PP2="--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2"
if [ "${PART:-schedules}" = startup ]; then
  # Start-up with the initial values drawn on the GPU (issue 31): DP 2 with the distributed
  # optimizer (each rank holds the whole model: 44-59 s of start-up with the host's draw),
  # PP 2 with 9 + 7 layers and TP 2; the first loss (before any update) agrees across them.
  ours dp2_zero --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --data-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce
  ours pp2_last7 $PP2 --decoder-last-pipeline-num-layers 7
  ours tp2_sp --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel
  exit 0
fi
if [ "${PART:-schedules}" = uneven ]; then
  # The planner's balancing count for the last rank: its layers plus the output layer (2.1
  # layers' work) level with the first rank's (16 layers: 9 + 7).
  LAST=${LAST:-7}
  ours pp2_v4_even $PP2 --num-layers-per-virtual-pipeline-stage $((LAYERS / 8))
  ours pp2_v4_last$LAST $PP2 --num-virtual-stages-per-pipeline-rank 4 --decoder-last-pipeline-num-layers $LAST
  torch fsdp_b1 --batch 1
  ours pp2_1f1b_last$LAST $PP2 --decoder-last-pipeline-num-layers $LAST
  torch fsdp_b2 --batch 2
  ours pp2_1f1b_even $PP2
  # The planner's table for this world, to set its peaks beside the logged ones.
  $B/pretrain_gpt $COMMON $PP2 --plan --gpu-memory-gib 140 > $OUT/plan.log 2>&1
  exit 0
fi
ours pp2_1f1b $PP2
ours pp2_interleaved_v2 $PP2 --num-layers-per-virtual-pipeline-stage $((LAYERS / 4))
torch fsdp_b1 --batch 1
ours pp2_interleaved_v4 $PP2 --num-layers-per-virtual-pipeline-stage $((LAYERS / 8))
ours tp2_sp --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel
torch fsdp_b2 --batch 2
