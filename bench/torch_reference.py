"""PyTorch figures for the same ops as examples/cuda_runtime_bench.rs, for the same device call."""
import statistics
import time

import torch


def timed(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(7):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / reps)
    return statistics.median(samples)


def main():
    dev = "cuda"
    print("== PyTorch", torch.__version__, torch.cuda.get_device_name(), "==")
    for n, dtype in [(4096, torch.float32), (4096, torch.bfloat16), (8192, torch.bfloat16)]:
        for tf32 in ([False, True] if dtype == torch.float32 else [False]):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            a = torch.rand(n, n, device=dev, dtype=dtype)
            b = torch.rand(n, n, device=dev, dtype=dtype)
            t = timed(lambda: a @ b, 5)
            label = f"matmul {dtype} {n}^3" + (" (tf32)" if tf32 else "")
            print(f"{label:<36} {2 * n**3 / t / 1e12:8.1f} TFLOP/s")
    x = torch.rand(8192, 8192, device=dev)
    nbytes = x.numel() * 4
    t = timed(lambda: x.sum(dim=1), 10)
    print(f"{'sum_dim 8192x8192 f32':<36} {nbytes / t / 1e9:8.1f} GB/s")
    t = timed(lambda: torch.tanh(torch.exp(x * 2 + 1)), 10)
    print(f"{'exp(tanh(2x+1)) f32 (eager)':<36} {2 * nbytes / t / 1e9:8.1f} GB/s")
    y = torch.zeros(1, device=dev)
    t = timed(lambda: y + 1, 10000)
    print(f"{'kernel launch (y + 1, 1 element)':<36} {t * 1e6:8.2} µs")


if __name__ == "__main__":
    main()
