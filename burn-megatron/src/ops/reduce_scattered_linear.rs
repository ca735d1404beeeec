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
//! The forward is cut in [`FORWARD_CHUNKS`] chunks of every rank's tokens: the reduce-scatter
//! of one chunk's product runs (on the group's side stream, on GPUs) while the next chunk's
//! GEMM computes, so that only the last chunk's collective is exposed. Chunk `j` holds part `j`
//! of every rank's tokens, so that its reduce-scatter gives each rank part `j` of its own
//! tokens; the parts are then joined in order. Every output row is the same dot products as
//! in one GEMM, reduced by the same collective.
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

/// Chunks of each rank's tokens that the forward product and its reduce-scatter are cut in
/// (see the [module docs](self)), where the rank's tokens divide evenly; one otherwise. Two
/// hide half the forward collective at the cost of GEMMs of half the rows.
pub const FORWARD_CHUNKS: usize = 2;

/// A projection whose partial results are reduce-scattered over a tensor-parallel group.
pub trait ReduceScatteredLinearOps: LinearOps + DistBackend {
    /// `reduce_scatter(x · w)` over `group` along the tokens (dimension 0, rank-major), in
    /// [`FORWARD_CHUNKS`] chunks whose collectives overlap the next chunk's GEMM.
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
        let size = group.size();
        let [rows, d_in] = x.dims();
        let tokens = rows / size;
        let chunks = match size > 1 && tokens.is_multiple_of(FORWARD_CHUNKS) {
            true => FORWARD_CHUNKS,
            false => 1,
        };
        if chunks == 1 {
            return group.reduce_scatter(<Self as LinearOps>::linear(x, w, None), 0, ReduceOp::Sum);
        }
        // `[rank, chunk, part, d_in]`: chunk `j` is part `j` of every rank's tokens.
        let part = tokens / chunks;
        let by_chunk = x.reshape([size, chunks, part, d_in]);
        let mut parts = Vec::with_capacity(chunks);
        for j in 0..chunks {
            let rows = by_chunk
                .clone()
                .narrow(1, j, 1)
                .reshape([size * part, d_in]);
            let product = <Self as LinearOps>::linear(rows, w.clone(), None);
            parts.push(group.reduce_scatter(product, 0, ReduceOp::Sum)?);
        }
        Ok(Tensor::cat(parts, 0))
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

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;
    use burn::tensor::backend::Backend;
    use burn::tensor::{Distribution, Tensor};
    use burn_megatron_dist::ReduceOp;
    use burn_megatron_testing::run;

    use super::{FORWARD_CHUNKS, ReduceScatteredLinearOps};
    use crate::ops::LinearOps;

    type B = NdArray<f32>;

    /// The chunked forward equals one GEMM and one reduce-scatter, bit for bit, at TP 2 and 4
    /// with rank token counts that split into the chunks (2, 4, 6) and that do not (3, 1).
    #[test]
    fn the_chunked_forward_equals_one_gemm_and_one_reduce_scatter() {
        assert_eq!(
            FORWARD_CHUNKS, 2,
            "the token counts below are chosen for two chunks"
        );
        for size in [2, 4] {
            for tokens in [2, 4, 6, 3, 1] {
                run(size, |ctx| {
                    let group = ctx.world();
                    let device = Default::default();
                    B::seed(&device, 40 + group.rank() as u64);
                    let uniform = Distribution::Uniform(-1.0, 1.0);
                    let x = Tensor::<B, 2>::random([size * tokens, 5], uniform, &device);
                    let w = Tensor::<B, 2>::random([5, 7], uniform, &device);
                    let plain = group.reduce_scatter(
                        B::linear(x.clone(), w.clone(), None),
                        0,
                        ReduceOp::Sum,
                    )?;
                    let chunked = B::reduce_scattered_linear(x, w, group)?;
                    assert_eq!(chunked.dims(), [tokens, 7]);
                    let (chunked, plain) = (chunked.into_data(), plain.into_data());
                    assert_eq!(
                        chunked.as_slice::<f32>().unwrap(),
                        plain.as_slice::<f32>().unwrap(),
                        "TP {size}, {tokens} tokens a rank"
                    );
                    Ok(())
                });
            }
        }
    }
}
