# Benchmark peer (PyTorch, not part of burn-megatron): the ops our fused kernels replace, at
# the sizes examples/examples/kernel_bench.rs uses, eager and torch.compile, with the copy
# bandwidth from the same process. GB/s counts the least bytes each op must move, as ours.
import torch
import torch.nn.functional as F

ROWS, LOCAL, REAL = 16_384, 50_304, 50_257


def time_ms(fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(7):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 5)
    return sorted(samples)[3]


def report(name, nbytes, ms):
    gbs = nbytes / (ms / 1e3) / 1e9
    print(f"{name:<48} {ms:>9.3} ms {gbs:>8.0} GB/s")
    print(f'RESULT kernel="{name}" ms={ms:.4f} gbs={gbs:.1f}')


def main():
    torch.manual_seed(0)
    for dtype in [torch.bfloat16, torch.float32]:
        size = torch.finfo(dtype).bits // 8
        name = "BF16" if dtype == torch.bfloat16 else "F32"
        x = (torch.randn(ROWS, LOCAL, device="cuda") * 2).to(dtype)
        targets = torch.randint(0, REAL, (ROWS,), device="cuda")
        elements = ROWS * LOCAL
        y = torch.empty_like(x)
        report(f"torch {name} copy", 2 * elements * size, time_ms(lambda: y.copy_(x)))

        def loss_fn(logits, t):
            return F.cross_entropy(logits[:, :REAL].float(), t)

        compiled = torch.compile(loss_fn)
        fwd_bytes = elements * size
        fwd_bwd_bytes = 3 * elements * size
        for label, fn in [("eager", loss_fn), ("compile", compiled)]:
            report(f"torch {name} cross-entropy forward, {label}", fwd_bytes,
                   time_ms(lambda: fn(x, targets)))
            xg = x.detach().requires_grad_(True)

            def step():
                xg.grad = None
                fn(xg, targets).backward()

            report(f"torch {name} cross-entropy fwd+bwd, {label}", fwd_bwd_bytes, time_ms(step))


def causal_softmax():
    shape = (16, 12, 1024, 1024)
    scale = 0.125
    elements = 16 * 12 * 1024 * 1024
    mask = torch.ones(1024, 1024, device="cuda", dtype=torch.bool).triu(1)

    def softmax(s):
        return torch.softmax((s.float() * scale).masked_fill(mask, float("-inf")), -1).to(s.dtype)

    compiled = torch.compile(softmax)
    for dtype in [torch.bfloat16, torch.float32]:
        size = torch.finfo(dtype).bits // 8
        name = "BF16" if dtype == torch.bfloat16 else "F32"
        s = (torch.randn(*shape, device="cuda") * 4).to(dtype)
        for label, fn in [("eager", softmax), ("compile", compiled)]:
            report(f"torch {name} causal softmax forward, {label}", 2 * elements * size,
                   time_ms(lambda: fn(s)))
            sg = s.detach().requires_grad_(True)
            grad = torch.randn_like(s)

            def step():
                sg.grad = None
                fn(sg).backward(grad)

            report(f"torch {name} causal softmax fwd+bwd, {label}", 5 * elements * size, time_ms(step))


if __name__ == "__main__":
    main()
    causal_softmax()
