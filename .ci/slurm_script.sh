#!/usr/bin/env bash
# examples/slurm/pretrain_gpt.sbatch on this machine: the script itself runs, with srun and
# scontrol replaced by the stand-ins in .ci/slurm/ (4 tasks on one node, CPU process ranks at
# TP 2 x PP 2). The ranks find their place from SLURM's variables alone (no RANK set), and
# the logged losses must equal those of the same run under bm-launch. No SLURM cluster is
# involved: what this checks is the script and the SLURM variables' path, not a real
# multi-node run. Needs `cargo build --example pretrain_gpt --bin bm-launch` first.
set -euo pipefail
dir="$CARGO_TARGET_DIR/debug"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
args=(--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2
      --global-batch-size 8 --train-iters 6 --lr-warmup-iters 2 --eval-interval 0 --log-interval 1
      --no-save)
losses() { awk '/^ iteration / { split($2, it, "/"); for (i = 1; i <= NF; i++) if ($i == "loss" && $(i - 1) != "lm") print it[1], $(i + 1) }' "$1"; }

"$dir/bm-launch" --nproc-per-node 4 --master-port 29710 -- "$dir/examples/pretrain_gpt" "${args[@]}" \
  > "$work/bm-launch.log" 2>&1
env -u RANK -u WORLD_SIZE -u LOCAL_RANK PATH="$PWD/.ci/slurm:$PATH" SLURM_NTASKS=4 \
  SLURM_JOB_NODELIST=ci MASTER_PORT=29711 PRETRAIN_GPT="$dir/examples/pretrain_gpt" \
  bash examples/slurm/pretrain_gpt.sbatch "${args[@]}" > "$work/slurm.log" 2>&1 \
  || { cat "$work/slurm.log"; exit 1; }
losses "$work/bm-launch.log" > "$work/want"
losses "$work/slurm.log" > "$work/got"
test "$(wc -l < "$work/want")" -eq 6
if ! cmp -s "$work/want" "$work/got"; then
  echo "the sbatch script's losses differ from bm-launch's:"; diff "$work/want" "$work/got"; exit 1
fi
echo "the sbatch script (srun stand-in, 4 tasks): the losses of bm-launch's run: $(cut -d' ' -f2 "$work/want" | tr '\n' ' ')"
