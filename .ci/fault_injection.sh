#!/usr/bin/env bash
# Fault injection (issue 32): RUNS runs of pretrain_gpt on CPU process ranks (TP 2 x PP 2, one
# process a rank) under `bm-launch --max-restarts`, each with one random rank killed by SIGKILL
# at a random moment (some during a save). Every run must finish; the last checkpoint's files
# must be byte-equal to an uninterrupted run's (model and optimizer state: the same bits), every
# loss it logged, before or after a restart, must equal the uninterrupted run's for that
# iteration, and every checkpoint left on disk must pass checkpoint_tool's checks. Needs
# `cargo build --example pretrain_gpt --example checkpoint_tool --bin bm-launch` first.
set -euo pipefail
dir="$CARGO_TARGET_DIR/debug"
launch="$dir/bm-launch"; bin="$dir/examples/pretrain_gpt"; tool="$dir/examples/checkpoint_tool"
RUNS=${RUNS:-20}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
args=(--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2
      --global-batch-size 8 --train-iters 8 --lr-warmup-iters 2 --eval-interval 0 --log-interval 1
      --save-interval 2)
losses() { awk '/^ iteration / { split($2, it, "/"); for (i = 1; i <= NF; i++) if ($i == "loss" && $(i - 1) != "lm") print it[1], $(i + 1) }' "$1"; }
# The checkpoint files that carry values (model and optimizer shards), without the metadata,
# which records when and by whom it was written.
shards() { (cd "$1" && find . -type f ! -name '*.json' | sort); }

port=29600
start=$(date +%s.%N)
"$launch" --nproc-per-node 4 --master-port $port -- "$bin" "${args[@]}" --save "$work/whole" > "$work/whole.log" 2>&1
seconds=$(echo "$(date +%s.%N) - $start" | bc)
losses "$work/whole.log" | sort -n | uniq > "$work/want"
test "$(wc -l < "$work/want")" -eq 8
echo "uninterrupted: $(tr '\n' ' ' < "$work/want") ($seconds s)"

for run in $(seq 1 "$RUNS"); do
  port=$((port + 1))
  out="$work/run$run"
  "$launch" --nproc-per-node 4 --master-port $port --max-restarts 3 -- \
    "$bin" "${args[@]}" --save "$out" --load "$out" > "$out.log" 2>&1 &
  launcher=$!
  # A random moment within the uninterrupted run's time, then a random rank of the launcher
  # that is still running: a rank that has finished (a zombie until bm-launch reaps it) can be
  # "killed" without effect, and then no restart is due.
  sleep "$(echo "scale=2; $seconds * $((RANDOM % 75 + 20)) / 100" | bc)"
  ranks=()
  for pid in $(pgrep -P "$launcher" || true); do
    state=$(awk '{ print $3 }' "/proc/$pid/stat" 2>/dev/null || true)
    case "$state" in R | S | D) ranks+=("$pid") ;; esac
  done
  killed="none (the run had ended)"
  published=0
  if [ ${#ranks[@]} -gt 0 ]; then
    victim=${ranks[$((RANDOM % ${#ranks[@]}))]}
    published=$(ls "$out" 2>/dev/null | grep -c '^iter_' || true)
    kill -9 "$victim" 2>/dev/null && killed="pid $victim, $published checkpoints published"
  fi
  if ! wait "$launcher"; then
    echo "run $run: bm-launch failed (killed $killed)"; tail -30 "$out.log"; exit 1
  fi
  losses "$out.log" > "$work/got"
  # Every logged loss, a repeated iteration's too, is the uninterrupted run's.
  if ! awk 'NR == FNR { want[$1] = $2; next } want[$1] != $2 { print "iteration " $1 ": " $2 " against " want[$1]; bad = 1 } END { exit bad }' "$work/want" "$work/got"; then
    echo "run $run: the losses differ (killed $killed)"; exit 1
  fi
  test "$(sort -n "$work/got" | uniq | wc -l)" -eq 8
  for ck in "$out"/iter_*; do "$tool" inspect "$ck" > /dev/null; done
  diff <(shards "$work/whole/iter_0000008") <(shards "$out/iter_0000008") > /dev/null
  (cd "$work/whole/iter_0000008" && shards . | while read -r f; do cmp -s "$f" "$out/iter_0000008/$f" || { echo "run $run: $f differs"; exit 1; }; done)
  restarts=$(grep -c "restarting all" "$out.log" || true)
  resumed=$(grep -c "resumed from" "$out.log" || true)
  # A killed rank stops every rank and all start again; a restart after a published checkpoint
  # resumes from one (not from scratch).
  # bm-launch restarts after any rank's failure while restarts are left, so a run without a
  # restart lost no rank: the victim had ended on its own between the check and the kill.
  case "$killed" in none*) ;; *) [ "$restarts" -ge 1 ] || killed="a rank that had just ended" ;; esac
  if [ "$restarts" -ge 1 ] && [ "$published" -gt 0 ] && [ "$resumed" -lt 1 ]; then
    echo "run $run: restarted from scratch with $published checkpoints on disk"; exit 1
  fi
  echo "run $run: killed $killed; $restarts restarts, $resumed resumed; losses and final checkpoint equal"
  rm -rf "$out" "$out.log"
done
echo "fault injection: $RUNS runs, every one equal to the uninterrupted run"
