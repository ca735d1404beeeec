"""torch.matmul (cuBLAS) on the shapes of examples/gemm_bench.rs, for the same device call.

A benchmark peer, not part of burn-megatron. `--fp8`: torch._scaled_mm (E4M3 operands, per-tensor
scales, bf16 output) against bf16 torch.matmul on the same a[m,k] . b[n,k]^T shapes as
`gemm_bench fp8`, with and without fast accumulation. `--grouped`: torch._grouped_mm (the experts'
grouped GEMM torch_moe.py uses) on the shapes of `gemm_bench grouped`, each product and the autograd
forward + backward, next to a dense torch.matmul of the same FLOPs.
"""
import statistics
import sys
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


def timed(op):
    for _ in range(3):
        op()
    torch.cuda.synchronize()
    samples = []
    for _ in range(7):
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = [op() for _ in range(5)]
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / 5)
        del outs
    return statistics.median(samples)


def fp8():
    print("== torch._scaled_mm", torch.__version__, torch.cuda.get_device_name(), "==")
    print(f"{'GEMM a[m,k] . b[n,k]^T':<36} {'bf16':>9} {'fp8':>9} {'fp8 fast':>9} {'ratio':>7}")
    e4m3 = torch.float8_e4m3fn
    for label, m, n, k, _, _ in shapes():
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        sa = (448.0 / a.abs().max().float()).reshape(())
        sb = (448.0 / b.abs().max().float()).reshape(())
        qa = (a.float() * sa).clamp(-448, 448).to(e4m3)
        qb = (b.float() * sb).clamp(-448, 448).to(e4m3)
        ia, ib = sa.reciprocal(), sb.reciprocal()
        flops = 2 * m * n * k
        bf16 = flops / timed(lambda: a @ b.t()) / 1e12
        slow = flops / timed(lambda: torch._scaled_mm(qa, qb.t(), ia, ib, out_dtype=torch.bfloat16)) / 1e12
        fast = flops / timed(lambda: torch._scaled_mm(qa, qb.t(), ia, ib, out_dtype=torch.bfloat16, use_fast_accum=True)) / 1e12
        print(f"{label:<36} {bf16:9.1f} {slow:9.1f} {fast:9.1f} {fast / bf16:7.2f}")


UNEVEN = [0.20, 0.08, 0.15, 0.05, 0.18, 0.12, 0.10, 0.12]


def split(tokens, fractions):
    counts = [int(tokens * f) for f in fractions]
    counts[-1] += tokens - sum(counts)
    return counts


def fine(experts):
    weights = [e % 5 + 1 for e in range(experts)]
    return [w / sum(weights) for w in weights]


def even(experts):
    # An even load as forced balancing gives it: 0.875-1.125 times the mean, 12 288 rows over
    # 64 experts (half a row above each count, so that the split's truncation gives it).
    rows = [168, 176, 184, 192, 192, 200, 208, 216]
    return [(rows[e % 8] + 0.5) / 12288 for e in range(experts)]


def grouped():
    print("== torch._grouped_mm", torch.__version__, torch.cuda.get_device_name(), "==")
    print(f"{'product':<38} {'grouped':>9} {'dense':>9} {'grouped/dense':>14}")
    # The cases of `gemm_bench grouped`: fc1's width and fc2's input width.
    cases = [
        ("mixtral-1b", 2048, 5632, 5632, 16384, UNEVEN),
        ("mixtral-8x7b", 4096, 14336, 14336, 16384, UNEVEN),
        ("deepseek-1b ep2", 2048, 1408, 1408, 12288, fine(32)),
        ("deepseek-1b ep1", 2048, 1408, 1408, 12288, fine(64)),
        ("deepseek-1b ep1 even", 2048, 1408, 1408, 12288, even(64)),
    ]
    for model, hidden, fc1, fc2, tokens, fractions in cases:
        counts = split(tokens, fractions)
        offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
        print(f"{model}: {tokens} tokens over {len(counts)} experts {counts}")
        for layer, k, m in [("fc1", hidden, fc1), ("fc2", fc2, hidden)]:
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn(tokens, m, device="cuda", dtype=torch.bfloat16)
            # [experts, k, m] as the transpose of [experts, m, k], as torch_moe.py keeps it.
            w = torch.randn(len(counts), m, k, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
            dense_w = torch.randn(k, m, device="cuda", dtype=torch.bfloat16)
            flops = 2 * tokens * k * m
            products = [
                ("Forward", lambda: torch._grouped_mm(x, w, offs=offs), lambda: x @ dense_w),
                ("InputGrad", lambda: torch._grouped_mm(dy, w.transpose(-2, -1), offs=offs),
                 lambda: dy @ dense_w.t()),
                ("WeightGrad", lambda: torch._grouped_mm(x.t(), dy, offs=offs), lambda: x.t() @ dy),
            ]
            for name, op, dense in products:
                label = f"{model} {layer} {name} k={k} m={m}"
                try:
                    g = flops / timed(op) / 1e12
                except (RuntimeError, TypeError) as e:
                    print(f"{label:<38} torch._grouped_mm failed: {str(e).splitlines()[0][:200]}")
                    continue
                d = flops / timed(dense) / 1e12
                print(f"{label:<38} {g:9.1f} {d:9.1f} {g / d:14.2f}")
            # What autograd runs: the forward and both backward products.
            xr = x.detach().requires_grad_()
            wr = w.detach().requires_grad_()

            def step():
                xr.grad = wr.grad = None
                y = torch._grouped_mm(xr, wr, offs=offs)
                y.backward(dy)
                return y
            try:
                t = timed(step)
                print(f"{model + ' ' + layer + ' autograd fwd+bwd':<38} {3 * flops / t / 1e12:9.1f}")
            except (RuntimeError, TypeError) as e:
                print(f"{model} {layer} autograd: torch._grouped_mm failed: {str(e).splitlines()[0][:200]}")


def main():
    if "--fp8" in sys.argv:
        return fp8()
    if "--grouped" in sys.argv:
        return grouped()
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
