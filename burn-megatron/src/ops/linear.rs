//! The dense layers' GEMMs: `x · w + bias`, and `x · w_tᵀ + bias` for a weight stored
//! output-major (the output layer's vocabulary table).
//!
//! `Autodiff<B>` records one node per linear layer whose backward is two GEMMs with the
//! transposes folded in ([`LinearOps::gemm`]) and the bias gradient of
//! [`BiasOps::bias_gradient`]: no transposed copies of `x`, `w` or `dy`. Our CUDA backend runs
//! the GEMMs through cuBLASLt in stream order (`burn_megatron_kernels::cuda::gemm`); other
//! backends through Burn's matmul.

use std::any::Any;
use std::sync::Arc;

use burn::backend::Autodiff;
use burn::tensor::Tensor;
use burn::tensor::ops::FloatTensor;
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;

use super::autodiff::{BackwardStep, inner, parent, record, register};
use super::backward_hook::{BackwardHook, WeightGradient};
use super::bias::BiasOps;
use super::primitive::{raw, wrap};
use super::write_slot::{WriteSlotOps, add_to_slot};

/// The dense layers' GEMMs.
pub trait LinearOps: BiasOps + WriteSlotOps {
    /// `op(a) · op(b)`, where `op` transposes when asked; backends with a GEMM library fold
    /// the transposes into it.
    fn gemm(
        a: Tensor<Self, 2>,
        b: Tensor<Self, 2>,
        transpose_a: bool,
        transpose_b: bool,
    ) -> Tensor<Self, 2> {
        let a = if transpose_a { a.transpose() } else { a };
        let b = if transpose_b { b.transpose() } else { b };
        a.matmul(b)
    }

    /// `buffer` (`[numel]` f32) with `op(a) · op(b)` (`[m, n]`) added row-major at
    /// `start..start + m · n`: a weight's gradient summed into its slot of the flat fp32
    /// gradient buffer. The default computes the product, then adds it
    /// ([`WriteSlotOps::add_slot`]); our CUDA backend runs one cuBLASLt GEMM that accumulates
    /// into the slot in place (beta 1, fp32), with no product in the model's dtype.
    fn gemm_add_slot(
        buffer: Tensor<Self, 1>,
        start: usize,
        a: Tensor<Self, 2>,
        b: Tensor<Self, 2>,
        transpose_a: bool,
        transpose_b: bool,
    ) -> Tensor<Self, 1> {
        gemm_add_slot_composition(buffer, start, a, b, transpose_a, transpose_b)
    }

    /// [`linear`](Self::linear), or with `output_major`
    /// [`linear_output_major`](Self::linear_output_major), whose weight gradient the backward
    /// pass first offers to `hook` ([`BackwardHook::take_weight_gradient`]). Only `Autodiff`
    /// has a gradient to offer: the default is the plain product.
    fn hooked_linear(
        x: Tensor<Self, 2>,
        w: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
        output_major: bool,
        hook: &Arc<dyn BackwardHook>,
    ) -> Tensor<Self, 2> {
        let _ = hook;
        match output_major {
            false => <Self as LinearOps>::linear(x, w, bias),
            true => Self::linear_output_major(x, w, bias),
        }
    }

    /// `x · w + bias` for `x: [tokens, d_in]`, `w: [d_in, d_out]`, `bias: [d_out]`.
    fn linear(
        x: Tensor<Self, 2>,
        w: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
    ) -> Tensor<Self, 2> {
        burn::tensor::module::linear(x, w, bias)
    }

    /// `x · w_tᵀ + bias` for a weight stored output-major, `w_t: [d_out, d_in]` (the output
    /// layer's vocabulary table). Unlike [`linear`](Self::linear) of a transposed view,
    /// `Autodiff<B>` records one node whose weight gradient is `w_t`'s own: it is final when
    /// that node's backward runs. Burn runs backward steps by depth, and a transpose of a
    /// parameter has depth 1, so its gradient would come after every layer's, too late to
    /// be reduced while the backward pass goes on.
    fn linear_output_major(
        x: Tensor<Self, 2>,
        w_t: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
    ) -> Tensor<Self, 2> {
        let y = Self::gemm(x, w_t, false, true);
        match bias {
            Some(bias) => Self::bias_add(y, bias),
            None => y,
        }
    }
}

/// [`LinearOps::gemm_add_slot`] as the product ([`LinearOps::gemm`]) and its addition
/// ([`WriteSlotOps::add_slot`]).
pub fn gemm_add_slot_composition<B: LinearOps>(
    buffer: Tensor<B, 1>,
    start: usize,
    a: Tensor<B, 2>,
    b: Tensor<B, 2>,
    transpose_a: bool,
    transpose_b: bool,
) -> Tensor<B, 1> {
    add_to_slot(buffer, start, B::gemm(a, b, transpose_a, transpose_b))
}

/// `x · w + bias` over the last dimension of an `x` of any rank: flattened to
/// `[tokens, d_in]` for [`LinearOps::linear`], then reshaped back.
///
/// # Shapes
/// - `x`: `[..., d_in]`
/// - `w`: `[d_in, d_out]`
/// - `bias`: `[d_out]`
/// - output: `[..., d_out]`
pub fn linear<B: LinearOps, const D: usize>(
    x: Tensor<B, D>,
    w: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    hooked_linear(x, w, bias, false, None)
}

/// `x · w_tᵀ + bias` over the last dimension of an `x` of any rank, for a weight stored
/// output-major: [`LinearOps::linear_output_major`] on `x` flattened to `[tokens, d_in]`,
/// reshaped back.
///
/// # Shapes
/// - `x`: `[..., d_in]`
/// - `w_t`: `[d_out, d_in]`
/// - `bias`: `[d_out]`
/// - output: `[..., d_out]`
pub fn linear_output_major<B: LinearOps, const D: usize>(
    x: Tensor<B, D>,
    w_t: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    hooked_linear(x, w_t, bias, true, None)
}

/// [`linear`] (or, with `output_major`, [`linear_output_major`]) whose weight gradient is
/// offered to `hook` in the backward pass ([`BackwardHook::take_weight_gradient`]): the layers
/// of a model whose hook sums gradients in a flat f32 buffer
/// ([`GradReduceOverlap`](crate::distributed::GradReduceOverlap)) let the weight-gradient
/// GEMM accumulate there.
///
/// # Shapes
/// As [`linear`], or [`linear_output_major`] (`w: [d_out, d_in]`).
pub fn hooked_linear<B: LinearOps, const D: usize>(
    x: Tensor<B, D>,
    w: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
    output_major: bool,
    hook: Option<&Arc<dyn BackwardHook>>,
) -> Tensor<B, D> {
    let dims = x.dims();
    let d_out = w.dims()[usize::from(!output_major)];
    let tokens: usize = dims[..D - 1].iter().product();
    let x = x.reshape([tokens, dims[D - 1]]);
    let y = match (hook, output_major) {
        (Some(hook), _) => B::hooked_linear(x, w, bias, output_major, hook),
        (None, false) => <B as LinearOps>::linear(x, w, bias),
        (None, true) => B::linear_output_major(x, w, bias),
    };
    let mut out = dims;
    out[D - 1] = d_out;
    y.reshape(out)
}

impl<B: LinearOps, C: CheckpointStrategy> LinearOps for Autodiff<B, C> {
    fn linear(
        x: Tensor<Self, 2>,
        w: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
    ) -> Tensor<Self, 2> {
        autodiff_linear::<B, C>(x, w, bias, false, None)
    }

    fn linear_output_major(
        x: Tensor<Self, 2>,
        w_t: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
    ) -> Tensor<Self, 2> {
        autodiff_linear::<B, C>(x, w_t, bias, true, None)
    }

    fn hooked_linear(
        x: Tensor<Self, 2>,
        w: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
        output_major: bool,
        hook: &Arc<dyn BackwardHook>,
    ) -> Tensor<Self, 2> {
        autodiff_linear::<B, C>(x, w, bias, output_major, Some(hook.clone()))
    }
}

/// [`LinearOps::linear`] (or, with `output_major`, `linear_output_major`) on `Autodiff<B>`:
/// the inner backend's product and one node storing `x` and `w`, which offers the weight's
/// gradient to `hook` when there is one.
fn autodiff_linear<B: LinearOps, C: CheckpointStrategy>(
    x: Tensor<Autodiff<B, C>, 2>,
    w: Tensor<Autodiff<B, C>, 2>,
    bias: Option<Tensor<Autodiff<B, C>, 1>>,
    output_major: bool,
    hook: Option<Arc<dyn BackwardHook>>,
) -> Tensor<Autodiff<B, C>, 2> {
    let (x, w, bias) = (raw(x), raw(w), bias.map(raw));
    let inner_bias = bias.as_ref().map(inner);
    let output = match output_major {
        false => <B as LinearOps>::linear(inner(&x), inner(&w), inner_bias),
        true => B::linear_output_major(inner(&x), inner(&w), inner_bias),
    };
    let state = (x.primitive.clone(), w.primitive.clone());
    let step = LinearBackward { output_major, hook };
    let output = match &bias {
        Some(bias) => record::<B, C, _>(step, &[&x, &w, bias], state, raw(output)),
        None => record::<B, C, _>(step, &[&x, &w], state, raw(output)),
    };
    wrap(output)
}

/// The backward of `y = x · w + bias` ([`LinearOps::linear`]) or, with `output_major`, of
/// `y = x · wᵀ + bias` ([`LinearOps::linear_output_major`], `w: [d_out, d_in]`): the
/// transposes folded into the GEMMs, the weight's gradient in the weight's own layout (first
/// offered to `hook`, [`BackwardHook::take_weight_gradient`]), and `db = Σ_tokens dy`. Its
/// parents are `[x, w]` or `[x, w, bias]`.
#[derive(Debug)]
struct LinearBackward {
    output_major: bool,
    hook: Option<Arc<dyn BackwardHook>>,
}

/// The weight gradient of [`LinearBackward`], `xᵀ · dy` (or `dyᵀ · x` output-major), offered
/// to a hook before it is computed.
pub(crate) struct WeightProduct<B: LinearOps> {
    x: Tensor<B, 2>,
    dy: Tensor<B, 2>,
    output_major: bool,
}

impl<B: LinearOps> WeightProduct<B> {
    /// `xᵀ · dy`, the gradient of a `[d_in, d_out]` weight.
    pub(crate) fn new(x: Tensor<B, 2>, dy: Tensor<B, 2>) -> Self {
        Self {
            x,
            dy,
            output_major: false,
        }
    }

    /// The product, computed here (no hook took it).
    pub(crate) fn compute(&self) -> Tensor<B, 2> {
        let (a, b) = self.operands();
        B::gemm(a, b, true, false)
    }

    /// The GEMM's operands and their transposes.
    fn operands(&self) -> (Tensor<B, 2>, Tensor<B, 2>) {
        match self.output_major {
            false => (self.x.clone(), self.dy.clone()),
            true => (self.dy.clone(), self.x.clone()),
        }
    }
}

impl<B: LinearOps> WeightGradient for WeightProduct<B> {
    fn shape(&self) -> Vec<usize> {
        let (a, b) = self.operands();
        vec![a.dims()[1], b.dims()[1]]
    }

    fn add_to(
        &mut self,
        buffer: Box<dyn Any + Send>,
        start: usize,
    ) -> Result<Box<dyn Any + Send>, Box<dyn Any + Send>> {
        let buffer = buffer.downcast::<Tensor<B, 1>>()?;
        let (a, b) = self.operands();
        Ok(Box::new(B::gemm_add_slot(
            *buffer, start, a, b, true, false,
        )))
    }
}

impl<B: LinearOps> BackwardStep<B> for LinearBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(
        self,
        dy: FloatTensor<B>,
        (x, w): <Self as BackwardStep<B>>::State,
        parents: &[Option<NodeId>],
        grads: &mut Gradients,
    ) {
        let dy = wrap::<B, 2>(dy);
        // dx = dy · wᵀ, or dy · w for an output-major weight.
        register(grads, parent(parents, 0), || {
            B::gemm(dy.clone(), wrap(w), false, !self.output_major)
        });
        // dw = xᵀ · dy, or dyᵀ · x for an output-major weight, unless the hook takes it.
        let mut weight = WeightProduct {
            x: wrap(x),
            dy: dy.clone(),
            output_major: self.output_major,
        };
        let taken = match (&self.hook, parent(parents, 1)) {
            (Some(hook), Some(node)) => hook.take_weight_gradient(node, &mut weight),
            _ => false,
        };
        if !taken {
            register(grads, parent(parents, 1), || weight.compute());
        }
        register(grads, parent(parents, 2), || B::bias_gradient(dy));
    }
}

/// Our CUDA backend: cuBLASLt, in stream order. burn-cuda keeps Burn's matmul (the reference
/// ours is tested against).
#[cfg(feature = "cuda")]
mod cuda {
    use burn::tensor::Tensor;
    use burn_cubecl::cubecl::cuda::CudaRuntime;
    use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
    use burn_megatron_kernels::cuda::{MegatronCudaRuntime, gemm};

    use super::{LinearOps, gemm_add_slot_composition};
    use crate::ops::primitive::{raw, wrap};

    impl<F: FloatElement, I: IntElement, BT: BoolElement> LinearOps
        for CubeBackend<MegatronCudaRuntime, F, I, BT>
    {
        fn gemm(
            a: Tensor<Self, 2>,
            b: Tensor<Self, 2>,
            transpose_a: bool,
            transpose_b: bool,
        ) -> Tensor<Self, 2> {
            gemm::matmul(a, b, transpose_a, transpose_b)
        }

        fn linear(
            x: Tensor<Self, 2>,
            w: Tensor<Self, 2>,
            bias: Option<Tensor<Self, 1>>,
        ) -> Tensor<Self, 2> {
            gemm::linear(x, w, bias, false, false)
        }

        /// One cuBLASLt GEMM accumulating into the slot (beta 1), where the buffer is ours
        /// alone; else the product and its addition.
        fn gemm_add_slot(
            buffer: Tensor<Self, 1>,
            start: usize,
            a: Tensor<Self, 2>,
            b: Tensor<Self, 2>,
            transpose_a: bool,
            transpose_b: bool,
        ) -> Tensor<Self, 1> {
            let into = raw(buffer);
            match gemm::gemm_accumulate_at(
                &raw(a.clone()),
                &raw(b.clone()),
                transpose_a,
                transpose_b,
                &into,
                start,
            ) {
                Ok(()) => wrap(into),
                Err(_) => {
                    gemm_add_slot_composition(wrap(into), start, a, b, transpose_a, transpose_b)
                }
            }
        }
    }

    impl<F: FloatElement, I: IntElement, BT: BoolElement> LinearOps
        for CubeBackend<CudaRuntime, F, I, BT>
    {
    }
}

/// wgpu: Burn's matmul.
#[cfg(feature = "wgpu")]
impl<F, I, BT> LinearOps for burn_cubecl::CubeBackend<burn::backend::wgpu::WgpuRuntime, F, I, BT>
where
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn_megatron_testing::{assert_close, tolerance, values};

    use crate::init::{InitDistribution, init_full};

    type AD = Autodiff<NdArray>;

    /// Our linear's hand-written backward (GEMMs with folded transposes) against Burn's own
    /// autodiff, for a 3D input, with and without bias, and for a transposed-view weight.
    #[test]
    fn linear_backward_matches_burns_autodiff() {
        let dev = Default::default();
        let normal = |shape: [usize; 3], seed| {
            init_full::<AD, 3>(shape, InitDistribution::Normal { std: 1.0 }, seed, &dev)
        };
        for (with_bias, transposed_weight) in [(true, false), (false, false), (true, true)] {
            let run = |ours: bool| {
                let x = normal([2, 5, 7], 1).require_grad();
                let stored = if transposed_weight {
                    [1, 3, 7]
                } else {
                    [1, 7, 3]
                };
                let w_param = normal(stored, 2).squeeze_dim::<2>(0).require_grad();
                let w = if transposed_weight {
                    w_param.clone().transpose()
                } else {
                    w_param.clone()
                };
                let b = with_bias.then(|| normal([1, 1, 3], 3).reshape([3]).require_grad());
                let y = if ours {
                    super::linear(x.clone(), w, b.clone())
                } else {
                    burn::tensor::module::linear(x.clone(), w, b.clone())
                };
                let upstream = normal([2, 5, 3], 4).detach();
                let grads = (y.clone() * upstream).sum().backward();
                let mut out = vec![
                    values(y.inner()),
                    values(x.grad(&grads).unwrap()),
                    values(w_param.grad(&grads).unwrap()),
                ];
                out.extend(b.map(|b| values(b.grad(&grads).unwrap())));
                out
            };
            for (i, (a, b)) in run(true).iter().zip(run(false)).enumerate() {
                assert_close(
                    &format!("output {i} (bias {with_bias}, transposed {transposed_weight})"),
                    a,
                    &b,
                    tolerance::F32_SAME_ORDER,
                );
            }
        }
    }

    /// `linear_output_major` (the weight stored `[d_out, d_in]`, no transposed view) against
    /// Burn's autodiff of `linear` on the transposed view, with and without bias.
    #[test]
    fn output_major_linear_matches_burns_autodiff() {
        let dev = Default::default();
        let normal = |shape: [usize; 3], seed| {
            init_full::<AD, 3>(shape, InitDistribution::Normal { std: 1.0 }, seed, &dev)
        };
        for with_bias in [false, true] {
            let run = |ours: bool| {
                let x = normal([2, 5, 7], 1).require_grad();
                let w_t = normal([1, 3, 7], 2).squeeze_dim::<2>(0).require_grad();
                let b = with_bias.then(|| normal([1, 1, 3], 3).reshape([3]).require_grad());
                let y = if ours {
                    super::linear_output_major(x.clone(), w_t.clone(), b.clone())
                } else {
                    burn::tensor::module::linear(x.clone(), w_t.clone().transpose(), b.clone())
                };
                let upstream = normal([2, 5, 3], 4).detach();
                let grads = (y.clone() * upstream).sum().backward();
                let mut out = vec![
                    values(y.inner()),
                    values(x.grad(&grads).unwrap()),
                    values(w_t.grad(&grads).unwrap()),
                ];
                out.extend(b.map(|b| values(b.grad(&grads).unwrap())));
                out
            };
            for (i, (a, b)) in run(true).iter().zip(run(false)).enumerate() {
                assert_close(
                    &format!("output {i} (bias {with_bias})"),
                    a,
                    &b,
                    tolerance::F32_SAME_ORDER,
                );
            }
        }
    }
}
