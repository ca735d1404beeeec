# BENCHMARK PEER, not part of burn-megatron: float8 training for PyTorch's peers
# (bench/torch_train.py, bench/torch_fsdp.py: --fp8), the recipe of torchao's default
# "tensorwise" float8 training: per-tensor current scaling, E4M3 inputs and weights, E5M2
# output gradients, torch._scaled_mm for the forward GEMM and both backward GEMMs, bf16 output.
# The transformer blocks' linear layers are converted; the embedding and the output layer stay
# bf16, as in torchao and Megatron.
#
# torchao's own `convert_to_float8_training` is used when torchao is installed; otherwise this
# file's `Float8Linear` (the same recipe, a few lines on torch._scaled_mm). The RESULT line's
# impl names which one ran.

import torch
import torch.nn as nn

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def _cast(t, dtype):
    """`t` scaled by max/amax and cast (saturated) to `dtype`, and the inverse scale."""
    top = torch.finfo(dtype).max
    amax = t.detach().abs().max().float()
    scale = top / torch.clamp(amax, min=1e-12)
    q = (t.float() * scale).clamp(-top, top).to(dtype)
    return q, scale.reciprocal()


def _col_major(t):
    """The same matrix stored column-major, as _scaled_mm's second operand must be."""
    return t.t().contiguous().t()


class _Float8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        qx, sx = _cast(x, E4M3)
        qw, sw = _cast(w, E4M3)
        ctx.save_for_backward(qx, sx, qw, sw)
        ctx.w_dtype = w.dtype
        return torch._scaled_mm(qx, qw.t(), sx, sw, out_dtype=torch.bfloat16)

    @staticmethod
    def backward(ctx, dy):
        qx, sx, qw, sw = ctx.saved_tensors
        qdy, sdy = _cast(dy, E5M2)
        dx = torch._scaled_mm(qdy, _col_major(qw), sdy, sw, out_dtype=torch.bfloat16)
        dw = torch._scaled_mm(qdy.t().contiguous(), _col_major(qx), sdy, sx, out_dtype=torch.bfloat16)
        return dx, dw.to(ctx.w_dtype)


class Float8Linear(nn.Linear):
    """nn.Linear whose GEMMs run in float8 (tensorwise scaling)."""

    def forward(self, x):
        shape = x.shape
        y = _Float8Matmul.apply(x.reshape(-1, shape[-1]), self.weight)
        y = y.reshape(*shape[:-1], y.shape[-1])
        return y + self.bias.to(y.dtype) if self.bias is not None else y


def convert(model, blocks):
    """Converts the linear layers inside `blocks` (a ModuleList); returns the impl's name."""
    try:
        from torchao.float8 import convert_to_float8_training

        for block in blocks:
            convert_to_float8_training(block)
        return "torchao-float8"
    except ImportError:
        pass
    for block in blocks:
        for name, child in list(block.named_children()):
            if type(child) is nn.Linear:
                fp8 = Float8Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                   device=child.weight.device, dtype=child.weight.dtype)
                fp8.weight, fp8.bias = child.weight, child.bias
                setattr(block, name, fp8)
    return "scaled-mm-float8"
