#!/usr/bin/env bash
# Which Llama component changes a short run's loss curve (issue 31 diagnostics): a 1B-class
# Llama (16 layers, 2048 wide, 32 heads in 8 groups, SwiGLU 8192, RMSNorm, rope 500000,
# untied, no biases, Llama 3's vocabulary) at TP 2 x PP 2 on 4 GPUs, then the same with one
# component swapped for GPT's. Logs go to $OUT; needs .gpu/bin/{pretrain_gpt,bm-launch}.
set -u
cd "$(dirname "$0")/.."
source .gpu/env.sh
for z in .gpu/bin/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done 2>/dev/null
chmod +x .gpu/bin/* 2>/dev/null
B=.gpu/bin
BASE="--num-layers 16 --hidden-size 2048 --num-attention-heads 32 --ffn-hidden-size 8192 --vocab-size 128256 --seq-length 2048 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel --micro-batch-size 2 --global-batch-size 16 --bf16 --no-save --eval-interval 0 --log-interval 1 --train-iters ${ITERS:-10} --collective-checks false --lr ${LR:-3e-4} --min-lr 3e-5 --lr-warmup-iters 2 --untie-embeddings-and-output-weights --disable-bias-linear"
LLAMA="--swiglu --normalization RMSNorm --position-embedding-type rope --rotary-base 500000 --group-query-attention --num-query-groups 8"
run() { # name, flags
  local name=$1; shift
  echo "=== $name: $*" | tee -a $OUT/variants.log
  timeout 120 $B/bm-launch --nproc-per-node 4 -- $B/pretrain_gpt $BASE "$@" > $OUT/$name.log 2>&1
  echo "rc=$?" | tee -a $OUT/variants.log
  grep -oE "iteration +[0-9]+|\| loss [0-9.]+|grad norm [0-9.]+" $OUT/$name.log | paste -sd' ' | sed 's/iteration/\n  it/g' | tail -${ITERS:-10} | tee -a $OUT/variants.log
  grep -E "Error|error|panicked" $OUT/$name.log | head -3 | tee -a $OUT/variants.log
}
run llama $LLAMA
run no_gqa --swiglu --normalization RMSNorm --position-embedding-type rope --rotary-base 500000
run learned_positions --swiglu --normalization RMSNorm --group-query-attention --num-query-groups 8
run gelu --normalization RMSNorm --position-embedding-type rope --rotary-base 500000 --group-query-attention --num-query-groups 8
run layernorm --swiglu --position-embedding-type rope --rotary-base 500000 --group-query-attention --num-query-groups 8
run gpt_untied
