//! The row-parallel projection whose sequence-parallel reduce-scatter follows it, with the
//! backward's all-gather hidden behind a GEMM (Megatron's `--tp-comm-overlap`, for the
//! projections that leave a tensor-parallel region: attention's output and fc2).
//!
//! Composed of separate operations, the backward all-gathers the output's gradient (the
//! reduce-scatter's backward) and only then runs the projection's two GEMMs. Here the
//! projection and the reduce-scatter are one node whose backward starts the all-gather,
//! computes the input gradient of this rank's own tokens (whose output gradient it holds)
//! while the gather runs, then that of the other ranks' tokens and the weight gradient.
//!
//! A failed all-gather in the backward is recorded on the group
//! ([`ProcessGroup::fail_in_backward`]) and the gradients go on as zeros.

use burn::backend::Autodiff;
use burn::tensor::Tensor;
use burn::tensor::ops::FloatTensor;
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_megatron_dist::{DistBackend, DistResult, ProcessGroup, ReduceOp};

use super::autodiff::{BackwardStep, inner, parent, record, register};
use super::gathered_linear::local_first;
use super::linear::LinearOps;
use super::primitive::{raw, wrap};

/// A projection whose partial results are reduce-scattered over a tensor-parallel group.
pub trait ReduceScatteredLinearOps: LinearOps + DistBackend {
    /// `reduce_scatter(x · w)` over `group` along the tokens (dimension 0, rank-major).
    /// `Autodiff<B>` records one node whose backward computes this rank's own tokens' input
    /// gradient while the output gradient's all-gather runs (see the [module docs](self)).
    ///
    /// # Shapes
    /// - `x`: `[size · tokens, d_in]`, every rank's tokens in rank order, this rank's slice of
    ///   the features
    /// - `w`: `[d_in, d_out]`
    /// - output: `[tokens, d_out]`, this rank's tokens, summed over the group
    fn reduce_scattered_linear(
        x: Tensor<Self, 2>,
        w: Tensor<Self, 2>,
        group: &ProcessGroup,
    ) -> DistResult<Tensor<Self, 2>> {
        group.reduce_scatter(<Self as LinearOps>::linear(x, w, None), 0, ReduceOp::Sum)
    }
}

impl<B: ReduceScatteredLinearOps, C: CheckpointStrategy> ReduceScatteredLinearOps
    for Autodiff<B, C>
{
    fn reduce_scattered_linear(
        x: Tensor<Self, 2>,
        w: Tensor<Self, 2>,
        group: &ProcessGroup,
    ) -> DistResult<Tensor<Self, 2>> {
        let (x, w) = (raw(x), raw(w));
        let y = B::reduce_scattered_linear(inner(&x), inner(&w), group)?;
        let state = (x.primitive.clone(), w.primitive.clone(), group.clone());
        Ok(wrap(record::<B, C, _>(
            ReduceScatteredBackward,
            &[&x, &w],
            state,
            raw(y),
        )))
    }
}

/// The backward: the output gradient's all-gather started, this rank's tokens' input gradient
/// computed meanwhile, then the rest. Its parents are `[x, w]`.
#[derive(Debug)]
struct ReduceScatteredBackward;

impl<B: ReduceScatteredLinearOps> BackwardStep<B> for ReduceScatteredBackward {
    /// `x`, `w` and the group.
    type State = (FloatTensor<B>, FloatTensor<B>, ProcessGroup);

    fn backward(
        self,
        grad: FloatTensor<B>,
        (x, w, group): <Self as BackwardStep<B>>::State,
        parents: &[Option<NodeId>],
        grads: &mut Gradients,
    ) {
        let (x, w, dy) = (wrap::<B, 2>(x), wrap::<B, 2>(w), wrap::<B, 2>(grad));
        let (rank, size) = (group.rank(), group.size());
        let [tokens, d_out] = dy.dims();
        let (dtype, device) = (dy.dtype(), dy.device());
        let gathered = match group.all_gather(dy.clone(), 0) {
            Ok(gathered) => gathered,
            Err(error) => {
                group.fail_in_backward(error);
                Tensor::zeros([size * tokens, d_out], (&device, dtype))
            }
        };
        register(grads, parent(parents, 0), || {
            local_first(dy, gathered.clone(), rank, size, |d| {
                B::gemm(d, w.clone(), false, true)
            })
        });
        register(grads, parent(parents, 1), || {
            B::gemm(x, gathered, true, false)
        });
    }
}

/// CubeCL backends: the default.
#[cfg(feature = "fused")]
impl<R, F, I, BT> ReduceScatteredLinearOps for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
    Self: LinearOps + DistBackend,
{
}
