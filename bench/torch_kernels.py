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


def norm_gelu_and_bias_gradient():
    rows = 16_384
    for norm_width, gelu_width in [(4096, 4096), (768, 3072)]:
        for dtype in [torch.bfloat16, torch.float32]:
            size = torch.finfo(dtype).bits // 8
            name = "BF16" if dtype == torch.bfloat16 else "F32"
            x = torch.randn(rows, norm_width, device="cuda", dtype=dtype)
            scale = torch.ones(norm_width, device="cuda", dtype=dtype)
            shift = torch.zeros(norm_width, device="cuda", dtype=dtype)

            def layer_norm(x, w, b):
                return F.layer_norm(x, (norm_width,), w, b, 1e-5)

            elements = rows * norm_width
            for label, fn in [("eager", layer_norm), ("compile", torch.compile(layer_norm))]:
                report(f"torch {name} LayerNorm forward, {label}, {rows}x{norm_width}",
                       2 * elements * size, time_ms(lambda: fn(x, scale, shift)))
                xg = x.detach().requires_grad_(True)
                wg = scale.detach().requires_grad_(True)
                bg = shift.detach().requires_grad_(True)
                grad = torch.randn_like(x)

                def step():
                    xg.grad = wg.grad = bg.grad = None
                    fn(xg, wg, bg).backward(grad)

                report(f"torch {name} LayerNorm fwd+bwd, {label}, {rows}x{norm_width}",
                       5 * elements * size, time_ms(step))

            h = torch.randn(rows, gelu_width, device="cuda", dtype=dtype)
            bias = torch.randn(gelu_width, device="cuda", dtype=dtype)

            def bias_gelu(h, b):
                return F.gelu(h + b, approximate="tanh")

            elements = rows * gelu_width
            for label, fn in [("eager", bias_gelu), ("compile", torch.compile(bias_gelu))]:
                report(f"torch {name} bias-GeLU forward, {label}, {rows}x{gelu_width}",
                       2 * elements * size, time_ms(lambda: fn(h, bias)))
                hg = h.detach().requires_grad_(True)
                bg = bias.detach().requires_grad_(True)
                grad = torch.randn_like(h)

                def step():
                    hg.grad = bg.grad = None
                    fn(hg, bg).backward(grad)

                report(f"torch {name} bias-GeLU fwd+bwd (with bias grad), {label}, {rows}x{gelu_width}",
                       5 * elements * size, time_ms(step))
            report(f"torch {name} bias gradient, sum(0), {rows}x{gelu_width}", elements * size,
                   time_ms(lambda: h.sum(0)))


def dropout_rope_and_padded_softmax():
    for dtype in [torch.bfloat16, torch.float32]:
        size = torch.finfo(dtype).bits // 8
        name = "BF16" if dtype == torch.bfloat16 else "F32"
        rows, hidden = 16_384, 4096
        x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
        residual = torch.randn_like(x)

        def dropout_add(x, r):
            return r + F.dropout(x, 0.1, training=True)

        elements = rows * hidden
        for label, fn in [("eager", dropout_add), ("compile", torch.compile(dropout_add))]:
            report(f"torch {name} dropout + residual, {label}, {rows}x{hidden}",
                   3 * elements * size, time_ms(lambda: fn(x, residual)))
            xg = x.detach().requires_grad_(True)
            grad = torch.randn_like(x)

            def step():
                xg.grad = None
                fn(xg, residual).backward(grad)

            report(f"torch {name} dropout + residual fwd+bwd, {label}, {rows}x{hidden}",
                   5 * elements * size, time_ms(step))

        # Llama's rotate-half RoPE on q and k of [8, 2048, 32 + 8 heads, 128], as transformers
        # applies it (cos/sin tables precomputed, as its rotary embedding caches them).
        b, t, d = 8, 2048, 128
        q = torch.randn(b, 32, t, d, device="cuda", dtype=dtype)
        k = torch.randn(b, 8, t, d, device="cuda", dtype=dtype)
        inv = 1.0 / (500_000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d))
        angles = torch.outer(torch.arange(t, device="cuda").float(), inv)
        emb = torch.cat([angles, angles], -1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)

        def rotate_half(x):
            return torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)

        def rope(q, k):
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

        # Bytes as ours: q, k and v read and written (ours also copies v).
        elements = b * t * 48 * d
        for label, fn in [("eager", rope), ("compile", torch.compile(rope))]:
            report(f"torch {name} RoPE on q and k, {label}, [8, 2048, 8, 6, 128]",
                   2 * elements * size, time_ms(lambda: fn(q, k)))

        shape = (16, 12, 1024, 1024)
        s = (torch.randn(*shape, device="cuda") * 4).to(dtype)
        lengths = torch.tensor([1024 - 37 * i for i in range(16)], device="cuda")
        causal = torch.ones(1024, 1024, device="cuda", dtype=torch.bool).triu(1)
        padding = torch.arange(1024, device="cuda")[None, :] >= lengths[:, None]
        mask = causal[None, None] | padding[:, None, None, :]

        def padded_softmax(s):
            p = torch.softmax((s.float() * 0.125).masked_fill(mask, float("-inf")), -1)
            return p.nan_to_num(0.0).to(s.dtype)

        elements = 16 * 12 * 1024 * 1024
        for label, fn in [("eager", padded_softmax), ("compile", torch.compile(padded_softmax))]:
            report(f"torch {name} padded causal softmax forward, {label}", 2 * elements * size,
                   time_ms(lambda: fn(s)))


def bias_swiglu():
    rows, columns = 16_384, 4096
    for dtype in [torch.bfloat16, torch.float32]:
        size = torch.finfo(dtype).bits // 8
        name = "BF16" if dtype == torch.bfloat16 else "F32"
        gate, up = (torch.randn(rows, columns, device="cuda", dtype=dtype) for _ in range(2))
        bg, bu = (torch.randn(columns, device="cuda", dtype=dtype) * 0.1 for _ in range(2))

        def swiglu(g, u, bg, bu):
            return F.silu(g + bg) * (u + bu)

        elements = rows * columns
        for label, fn in [("eager", swiglu), ("compile", torch.compile(swiglu))]:
            report(f"torch {name} bias-SwiGLU forward, {label}, {rows}x{columns}",
                   3 * elements * size, time_ms(lambda: fn(gate, up, bg, bu)))
            tensors = [t.detach().requires_grad_(True) for t in (gate, up, bg, bu)]
            grad = torch.randn_like(gate)

            def step():
                for t in tensors:
                    t.grad = None
                fn(*tensors).backward(grad)

            report(f"torch {name} bias-SwiGLU fwd+bwd (with bias grads), {label}, {rows}x{columns}",
                   8 * elements * size, time_ms(step))


if __name__ == "__main__":
    # Sections by name (all without arguments), e.g. `python3 bench/torch_kernels.py
    # dropout_rope_and_padded_softmax`.
    import sys

    sections = [main, causal_softmax, norm_gelu_and_bias_gradient, dropout_rope_and_padded_softmax,
                bias_swiglu]
    wanted = sys.argv[1:]
    for section in sections:
        if not wanted or section.__name__ in wanted:
            section()
