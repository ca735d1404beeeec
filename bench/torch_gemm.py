"""torch.matmul (cuBLAS) on the shapes of examples/gemm_bench.rs, for the same device call."""
import statistics
import time

import torch


def shapes():
    out = [("square 4096", 4096, 4096, 4096, False, False), ("square 8192", 8192, 8192, 8192, False, False)]
    layers = [("gpt2-1.5b", "qkv", 1600, 4800), ("gpt2-1.5b", "fc1", 1600, 6400), ("gpt2-1.5b", "fc2", 6400, 1600),
              ("llama-8b", "qkv", 4096, 6144), ("llama-8b", "out", 4096, 4096), ("llama-8b", "up", 4096, 14336),
              ("llama-8b", "down", 14336, 4096)]
    for tokens in [4096, 16384]:
        for model, layer, d_in, d_out in layers:
            out.append((f"{model} {layer} fwd T={tokens}", tokens, d_out, d_in, False, False))
            out.append((f"{model} {layer} dX T={tokens}", tokens, d_in, d_out, False, True))
            out.append((f"{model} {layer} dW T={tokens}", d_in, d_out, tokens, True, False))
    return out


def main():
    print("== torch.matmul", torch.__version__, torch.cuda.get_device_name(), "==")
    for label, m, n, k, ta, tb in shapes():
        a = torch.rand(*( (k, m) if ta else (m, k) ), device="cuda", dtype=torch.bfloat16)
        b = torch.rand(*( (n, k) if tb else (k, n) ), device="cuda", dtype=torch.bfloat16)
        a_op = a.t() if ta else a
        b_op = b.t() if tb else b
        for _ in range(3):
            a_op @ b_op
        torch.cuda.synchronize()
        samples = []
        for _ in range(7):
            torch.cuda.synchronize()
            start = time.perf_counter()
            outs = [a_op @ b_op for _ in range(5)]
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - start) / 5)
            del outs
        t = statistics.median(samples)
        print(f"{label:<36} {2 * m * n * k / t / 1e12:10.1f} TFLOP/s")


if __name__ == "__main__":
    main()
