"""Benchmark peer (PyTorch, not part of burn-megatron): scaled_dot_product_attention, bf16,
causal, forward and forward + backward, on the shapes of examples/examples/attention_bench.rs.
FLOPs as FlashAttention counts them (forward 4·b·h·S²·d, halved when causal; backward 2.5×)."""
import torch
import torch.nn.functional as F


def median_ms(fn, warmup=3, samples=7, calls=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def main():
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}: SDPA, bf16, causal")
    shapes = [(16, 12, 1024, 64)]
    for d in (64, 128):
        for s in (1024, 2048, 4096, 8192):
            shapes.append((16384 // s, 2048 // d, s, d))
    for b, h, s, d in shapes:
        q, k, v, g = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_(True)
        fwd = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))

        def both():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(g)

        fb = median_ms(both)
        flops = 4 * b * h * s * s * d / 2
        print(f"b{b:>2} h{h:>2} s{s:>5} d{d:>3}: forward {fwd:8.3f} ms {flops / fwd / 1e9:6.1f} TFLOP/s, "
              f"forward+backward {fb:8.3f} ms {3.5 * flops / fb / 1e9:6.1f} TFLOP/s")
        print(f"RESULT impl=torch batch={b} heads={h} seq={s} head_dim={d} fwd_ms={fwd:.4f} "
              f"fwd_tflops={flops / fwd / 1e9:.1f} fwdbwd_ms={fb:.4f} fwdbwd_tflops={3.5 * flops / fb / 1e9:.1f}")


if __name__ == "__main__":
    main()
