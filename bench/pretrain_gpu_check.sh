#!/usr/bin/env bash
# The GPU check of pretrain_gpt (issue 17) and the step benchmark with its PyTorch peer, in
# one device call; logs go to $OUT. Needs, packed under .gpu/ (bench/pack_gpu.sh):
# bin/{pretrain_gpt,gpt_train_bench,bm-launch} (gzipped is fine) and
# data/realtext_text_document.{bin,idx} (bench/make_realtext.py, then preprocess_data).
#   GPUS=2 bash bench/pretrain_gpu_check.sh            # 1 GPU, DP 2, TP 2, --learner DP 2
#   GPUS=1 PART=pretrain bash bench/pretrain_gpu_check.sh   # fp16, --learner fp16/bf16 on 1 GPU
#   PART=bench bash bench/pretrain_gpu_check.sh        # gpt_train_bench vs torch.compile
set -u
cd "$(dirname "$0")/.."
source .gpu/env.sh
gunzip -kf .gpu/bin/*.gz .gpu/data/*.gz 2>/dev/null
chmod +x .gpu/bin/* 2>/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpus.txt
B=.gpu/bin
COMMON="--pipeline-model-parallel-size 1 --num-layers 6 --hidden-size 384 --num-attention-heads 6 --seq-length 512 --micro-batch-size 8 --global-batch-size 32 --train-iters ${ITERS:-300} --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 20 --eval-interval ${ITERS:-300} --eval-iters 4 --log-interval 25 --split 98,2,0 --data-path .gpu/data/realtext_text_document"
if [ "${PART:-all}" != bench ]; then
  if [ "${GPUS:-2}" = 1 ]; then
    runs=("fp16_1gpu:1:--tensor-model-parallel-size 1 --fp16 --initial-loss-scale 65536" "learner_fp16_1gpu:1:--tensor-model-parallel-size 1 --fp16 --initial-loss-scale 65536 --learner --save-interval 150" "learner_bf16_1gpu:1:--tensor-model-parallel-size 1 --bf16 --learner --save-interval 150")
  else
    runs=("1 gpu:1:--tensor-model-parallel-size 1" "dp2:2:--tensor-model-parallel-size 1 --data-parallel-size 2" "tp2:2:--tensor-model-parallel-size 2" "learner_dp2:2:--tensor-model-parallel-size 1 --data-parallel-size 2 --learner --save-interval 150")
  fi
  for run in "${runs[@]}"; do
    name=${run%%:*}; rest=${run#*:}; n=${rest%%:*}; flags=${rest#*:}
    echo "=== pretrain_gpt $name ($n GPUs): $flags" | tee -a $OUT/pretrain.log
    s=$(date +%s)
    timeout 240 $B/bm-launch --nproc-per-node $n -- $B/pretrain_gpt $COMMON --save /tmp/ck_${name// /_} $flags > $OUT/pretrain_${name// /_}.log 2>&1
    echo "rc=$? seconds=$(( $(date +%s) - s ))" | tee -a $OUT/pretrain.log
    grep -E "iteration|validation|Error|error|panicked" $OUT/pretrain_${name// /_}.log | tail -14 | tee -a $OUT/pretrain.log
  done
fi
if [ "${PART:-all}" != pretrain ]; then
  for preset in "gpt2-124m --batch 16" "gpt-1.3b --batch 8 --steps 6 --warmup 2"; do
    echo "=== ours $preset" | tee -a $OUT/bench.log
    timeout 200 $B/gpt_train_bench --preset $preset --dtype bf16 2>&1 | tail -6 | tee -a $OUT/bench.log
    echo "=== torch.compile $preset" | tee -a $OUT/bench.log
    timeout 200 python3 bench/torch_train.py --preset $preset --mode compile 2>&1 | tail -4 | tee -a $OUT/bench.log
  done
fi
