#!/usr/bin/env bash
# Kill-and-resume (issue 17): pretrain_gpt is killed with SIGKILL after its checkpoint at
# iteration 10 is published, restarted with the same command, and must log the same losses for
# iterations 11..20 as an uninterrupted run. Needs `cargo build --example pretrain_gpt` first.
set -euo pipefail
bin="$CARGO_TARGET_DIR/debug/examples/pretrain_gpt"
work=$(mktemp -d)
args=(--train-iters 20 --lr-warmup-iters 2 --eval-interval 20 --save-interval 10)
losses() { awk '/^ iteration / { split($2, it, "/"); for (i = 1; i <= NF; i++) if ($i == "loss" && $(i - 1) != "lm") print it[1], $(i + 1) }' "$1"; }

"$bin" "${args[@]}" --save "$work/whole" > "$work/whole.log" 2>&1

"$bin" "${args[@]}" --save "$work/killed" > "$work/first.log" 2>&1 &
pid=$!
until [ -f "$work/killed/iter_0000010/metadata.json" ]; do
  kill -0 "$pid" 2>/dev/null || { echo "the run ended before its checkpoint at 10"; exit 1; }
  sleep 0.2
done
kill -9 "$pid"
wait "$pid" 2>/dev/null || true
"$bin" "${args[@]}" --save "$work/killed" --load "$work/killed" > "$work/resumed.log" 2>&1

losses "$work/whole.log" | awk '$1 > 10' > "$work/want"
losses "$work/resumed.log" > "$work/got"
echo "uninterrupted iterations 11..20:"; cat "$work/want"
echo "after kill -9 at 10 and a restart:"; cat "$work/got"
test "$(wc -l < "$work/want")" -eq 10
diff "$work/want" "$work/got"
echo "kill-and-resume: the resumed losses equal the uninterrupted run's"
rm -rf "$work"
