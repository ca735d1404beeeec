"""Compares the loss curves of two `gpt_train_bench --print-losses` runs (e.g. bf16 and f32).

    python3 bench/loss_curves.py bf16.log f32.log [--every 20]

Prints both curves every `--every` steps and the largest relative gap between them, overall and
over the last quarter of the run.
"""
import argparse


def curve(path):
    for line in open(path):
        if line.startswith("LOSSES "):
            fields = line.split()
            return fields[1], [float(x) for x in fields[2:]]
    raise SystemExit(f"{path}: no LOSSES line (run gpt_train_bench with --print-losses)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--every", type=int, default=20)
    args = parser.parse_args()
    (name_a, a), (name_b, b) = curve(args.a), curve(args.b)
    n = min(len(a), len(b))
    print(f"| step | {name_a} | {name_b} | relative gap |")
    print("|---|---|---|---|")
    for i in list(range(0, n, args.every)) + ([n - 1] if (n - 1) % args.every else []):
        print(f"| {i + 1} | {a[i]:.4f} | {b[i]:.4f} | {abs(a[i] - b[i]) / abs(b[i]):.2e} |")
    gaps = [abs(x - y) / abs(y) for x, y in zip(a[:n], b[:n])]
    tail = gaps[3 * n // 4:]
    print(f"largest relative gap: {max(gaps):.2e} overall, {max(tail):.2e} over the last quarter")


if __name__ == "__main__":
    main()
