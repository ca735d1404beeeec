//! A bias added to every token, and its gradient: the sum of the output's gradient over the
//! tokens.
//!
//! Burn's broadcast add records a generic reduction for the bias's gradient; here the sum is
//! [`BiasOps::bias_gradient`], on CubeCL backends deterministic column sums in f32 with no
//! atomics (`burn_megatron_kernels::fused::column_sum`). The linear layers, bias-GeLU and
//! bias-SwiGLU take their bias gradients from it too.

use burn::backend::Autodiff;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;

use super::autodiff::{BackwardStep, inner, parent, record, register};
use super::primitive::{raw, wrap};

/// A bias added to every token, and its gradient.
pub trait BiasOps: Backend {
    /// `x + bias` for `x: [tokens, features]`, `bias: [features]`. `Autodiff<B>` records one
    /// node whose bias gradient is [`bias_gradient`](Self::bias_gradient).
    fn bias_add(x: Tensor<Self, 2>, bias: Tensor<Self, 1>) -> Tensor<Self, 2> {
        x + bias.unsqueeze()
    }

    /// `Σ_tokens dy` of `dy: [tokens, features]`, in `dy`'s dtype: the gradient of a bias added
    /// to every token. CubeCL backends sum in f32, in a fixed order, with no atomics
    /// (`burn_megatron_kernels::fused::column_sum`).
    fn bias_gradient(dy: Tensor<Self, 2>) -> Tensor<Self, 1> {
        dy.sum_dim(0).squeeze_dim::<1>(0)
    }
}

/// `x + bias` over the last dimension of an `x` of any rank: flattened to `[tokens,
/// features]` for [`BiasOps::bias_add`], then reshaped back.
///
/// # Shapes
/// - `x`: `[..., features]`
/// - `bias`: `[features]`
/// - output: the shape of `x`
pub fn bias_add<B: BiasOps, const D: usize>(x: Tensor<B, D>, bias: Tensor<B, 1>) -> Tensor<B, D> {
    let dims = x.dims();
    let features = dims[D - 1];
    let tokens = dims.iter().product::<usize>() / features.max(1);
    B::bias_add(x.reshape([tokens, features]), bias).reshape(dims)
}

impl<B: BiasOps, C: CheckpointStrategy> BiasOps for Autodiff<B, C> {
    fn bias_add(x: Tensor<Self, 2>, bias: Tensor<Self, 1>) -> Tensor<Self, 2> {
        let (x, bias) = (raw(x), raw(bias));
        let output = B::bias_add(inner(&x), inner(&bias));
        wrap(record::<B, C, _>(
            BiasAddBackward,
            &[&x, &bias],
            (),
            raw(output),
        ))
    }
}

/// The backward of `y = x + bias`: `dx = dy`, `db = Σ_tokens dy` through
/// [`BiasOps::bias_gradient`]. Its parents are `[x, bias]`.
#[derive(Debug)]
struct BiasAddBackward;

impl<B: BiasOps> BackwardStep<B> for BiasAddBackward {
    type State = ();

    fn backward(
        self,
        dy: FloatTensor<B>,
        _: (),
        parents: &[Option<NodeId>],
        grads: &mut Gradients,
    ) {
        register(grads, parent(parents, 1), || {
            B::bias_gradient(wrap::<B, 2>(dy.clone()))
        });
        register(grads, parent(parents, 0), || wrap::<B, 2>(dy));
    }
}

/// CubeCL backends: the bias gradient as deterministic column sums.
#[cfg(feature = "fused")]
mod cube {
    use burn::tensor::{DType, Tensor};
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use burn_megatron_kernels::fused::column_sum::column_sum;

    use super::BiasOps;
    use crate::ops::primitive::{raw, wrap};

    impl<R, F, I, BT> BiasOps for CubeBackend<R, F, I, BT>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        /// Column sums (f64: the composition).
        fn bias_gradient(dy: Tensor<Self, 2>) -> Tensor<Self, 1> {
            let dtype = dy.dtype();
            if dtype == DType::F64 {
                return dy.sum_dim(0).squeeze_dim::<1>(0);
            }
            wrap(column_sum(raw(dy), dtype))
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn_megatron_testing::{assert_close, tolerance, values};

    use crate::init::{InitDistribution, init_full};

    type AD = Autodiff<NdArray>;

    /// `bias_add`'s node (bias gradient through `bias_gradient`) against Burn's broadcast add,
    /// for a 3D input: same output, same gradients of both inputs.
    #[test]
    fn bias_add_backward_matches_burns_autodiff() {
        let dev = Default::default();
        let normal = |shape: [usize; 3], seed| {
            init_full::<AD, 3>(shape, InitDistribution::Normal { std: 1.0 }, seed, &dev)
        };
        let run = |ours: bool| {
            let x = normal([2, 5, 7], 1).require_grad();
            let b = normal([1, 1, 7], 2).reshape([7]).require_grad();
            let y = if ours {
                super::bias_add(x.clone(), b.clone())
            } else {
                x.clone() + b.clone().unsqueeze()
            };
            let upstream = normal([2, 5, 7], 3).detach();
            let grads = (y.clone() * upstream).sum().backward();
            [
                values(y.inner()),
                values(x.grad(&grads).unwrap()),
                values(b.grad(&grads).unwrap()),
            ]
        };
        for (i, (a, b)) in run(true).iter().zip(run(false)).enumerate() {
            assert_close(&format!("bias_add {i}"), a, &b, tolerance::F32_SAME_ORDER);
        }
    }
}
