//! Flash attention on CubeCL backends: a vendor library where the runtime has one (cuDNN's
//! fused engines on our CUDA backend), the portable CubeCL kernels of
//! `burn_megatron_kernels::fused::flash_attention` otherwise (head dims up to 256, not f64),
//! and the composition for what neither takes.

use burn::tensor::{DType, Tensor};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_megatron_kernels::fused::flash_attention as flash_kernels;
pub use burn_megatron_kernels::fused::flash_attention::packed::ViewOffsets;

use super::{FlashAttentionOps, backward_composition, forward_composition};
use crate::ops::primitive::{raw, wrap};

/// What a CubeCL runtime brings to attention besides the portable kernels.
pub trait AttentionRuntime: CubeRuntime {
    /// Where a view of a packed QKV buffer may start.
    const VIEW_OFFSETS: ViewOffsets;

    /// The output (`[batch, seq_q, heads, head_dim]` in memory, viewed `[batch, heads, seq_q,
    /// head_dim]`) and `lse` through a vendor library; `None` where it does not take the call.
    fn vendor_forward(
        q: &CubeTensor<Self>,
        k: &CubeTensor<Self>,
        v: &CubeTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> Option<(CubeTensor<Self>, CubeTensor<Self>)> {
        let _ = (q, k, v, scale, causal);
        None
    }

    /// `[dq, dk, dv]` through a vendor library; `None` where it does not take the call.
    #[allow(clippy::too_many_arguments)]
    fn vendor_backward(
        q: &CubeTensor<Self>,
        k: &CubeTensor<Self>,
        v: &CubeTensor<Self>,
        out: &CubeTensor<Self>,
        lse: &CubeTensor<Self>,
        grad: &CubeTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> Option<[CubeTensor<Self>; 3]> {
        let _ = (q, k, v, out, lse, grad, scale, causal);
        None
    }

    /// The backward through a vendor library, writing `[dq, dk, dv]` into `grads`; whether it
    /// took the call.
    #[allow(clippy::too_many_arguments)]
    fn vendor_backward_into(
        qkv: [&CubeTensor<Self>; 3],
        out: &CubeTensor<Self>,
        lse: &CubeTensor<Self>,
        grad: &CubeTensor<Self>,
        grads: &[CubeTensor<Self>; 3],
        scale: f64,
        causal: bool,
    ) -> bool {
        let _ = (qkv, out, lse, grad, grads, scale, causal);
        false
    }
}

/// Whether the portable kernels take inputs of `dtype` and `head_dim` (else: the composition).
pub(crate) fn kernels_take(dtype: DType, head_dim: usize) -> bool {
    dtype != DType::F64 && (1..=flash_kernels::MAX_HEAD_DIM).contains(&head_dim)
}

/// The kernels' options.
pub(crate) fn options(scale: f64, causal: bool) -> flash_kernels::AttentionOptions {
    flash_kernels::AttentionOptions {
        scale: scale as f32,
        causal,
    }
}

impl<R, F, I, BT> FlashAttentionOps for CubeBackend<R, F, I, BT>
where
    R: AttentionRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn flash_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        scale: f64,
        causal: bool,
    ) -> (Tensor<Self, 4>, Tensor<Self, 3>) {
        let [raw_q, raw_k, raw_v] = [&q, &k, &v].map(|t| raw(t.clone()));
        if let Some((out, lse)) = R::vendor_forward(&raw_q, &raw_k, &raw_v, scale, causal) {
            return (wrap(out), wrap(lse));
        }
        let dtype = q.dtype();
        if !kernels_take(dtype, q.dims()[3]) {
            return forward_composition(q, k, v, scale, causal);
        }
        let cast = |t: Tensor<Self, 4>| raw(t.cast(dtype));
        let (out, lse) = flash_kernels::forward(cast(q), cast(k), cast(v), options(scale, causal));
        (wrap(out), wrap(lse))
    }

    fn flash_attention_backward(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        out: Tensor<Self, 4>,
        lse: Tensor<Self, 3>,
        grad: Tensor<Self, 4>,
        scale: f64,
        causal: bool,
    ) -> [Tensor<Self, 4>; 3] {
        let [raw_q, raw_k, raw_v, raw_out, raw_grad] =
            [&q, &k, &v, &out, &grad].map(|t| raw(t.clone()));
        let raw_lse = raw(lse.clone());
        if let Some(grads) = R::vendor_backward(
            &raw_q, &raw_k, &raw_v, &raw_out, &raw_lse, &raw_grad, scale, causal,
        ) {
            return grads.map(wrap);
        }
        let dtype = q.dtype();
        if !kernels_take(dtype, q.dims()[3]) {
            return backward_composition(q, k, v, out, lse, grad, scale, causal);
        }
        let cast = |t: Tensor<Self, 4>| raw(t.cast(dtype));
        flash_kernels::backward(
            cast(q),
            cast(k),
            cast(v),
            cast(out),
            raw(lse.cast(DType::F32)),
            cast(grad),
            options(scale, causal),
        )
        .map(wrap)
    }
}

/// burn-cuda: the portable kernels, views at any element.
#[cfg(feature = "cuda")]
impl AttentionRuntime for burn_cubecl::cubecl::cuda::CudaRuntime {
    const VIEW_OFFSETS: ViewOffsets = ViewOffsets::AnyElement;
}

/// wgpu: the portable kernels, views at the memory alignment (WebGPU binds buffers there).
#[cfg(feature = "wgpu")]
impl AttentionRuntime for burn::backend::wgpu::WgpuRuntime {
    const VIEW_OFFSETS: ViewOffsets = ViewOffsets::MemoryAlignment;
}

/// Our CUDA backend: cuDNN's fused attention first (kernels get device pointers: views may
/// start at any element).
#[cfg(feature = "cuda")]
mod cudnn {
    use burn_cubecl::tensor::CubeTensor;
    use burn_megatron_kernels::cuda::MegatronCudaRuntime;
    use burn_megatron_kernels::cuda::cudnn::attention;

    use super::{AttentionRuntime, ViewOffsets};

    type Tensor = CubeTensor<MegatronCudaRuntime>;

    impl AttentionRuntime for MegatronCudaRuntime {
        const VIEW_OFFSETS: ViewOffsets = ViewOffsets::AnyElement;

        fn vendor_forward(
            q: &Tensor,
            k: &Tensor,
            v: &Tensor,
            scale: f64,
            causal: bool,
        ) -> Option<(Tensor, Tensor)> {
            attention::forward(q, k, v, scale as f32, causal)
        }

        fn vendor_backward(
            q: &Tensor,
            k: &Tensor,
            v: &Tensor,
            out: &Tensor,
            lse: &Tensor,
            grad: &Tensor,
            scale: f64,
            causal: bool,
        ) -> Option<[Tensor; 3]> {
            attention::backward(q, k, v, out, lse, grad, scale as f32, causal)
        }

        fn vendor_backward_into(
            [q, k, v]: [&Tensor; 3],
            out: &Tensor,
            lse: &Tensor,
            grad: &Tensor,
            grads: &[Tensor; 3],
            scale: f64,
            causal: bool,
        ) -> bool {
            attention::backward_into(q, k, v, out, lse, grad, grads, scale as f32, causal)
        }
    }
}
