//! Selective recomputation of the attention core: only `q`, `k` and `v` are stored for the
//! backward pass, which recomputes the `[batch, heads, seq, seq]` probabilities (Megatron's
//! `--recompute-granularity selective`).

use std::fmt::Debug;

use burn::backend::Autodiff;
use burn::tensor::Tensor;
use burn::tensor::ops::FloatTensor;
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;

use super::autodiff::{BackwardStep, inner, parent, record, register};
use super::causal_softmax::SoftmaxOps;
use super::dropout::DropoutOps;
use super::primitive::{raw, wrap};

/// An attention core whose backward recomputes what its forward computed from `q`, `k`, `v`
/// (`transformer::AttentionCore`).
///
/// # Shapes
/// `q`, `k`, `v`, the output and every gradient: `[batch, heads, seq, head_dim]`.
pub trait RecomputedAttention: Clone + Send + Sync + Debug + 'static {
    /// The output.
    fn forward<B: SoftmaxOps + DropoutOps>(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
    ) -> Tensor<B, 4>;

    /// `[dq, dk, dv]` from the output's gradient `grad`, recomputing the forward's
    /// intermediates.
    fn backward<B: SoftmaxOps + DropoutOps>(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        grad: Tensor<B, 4>,
    ) -> [Tensor<B, 4>; 3];
}

/// Running an attention core that stores only its inputs.
pub trait RecomputeOps: SoftmaxOps + DropoutOps {
    /// `core`'s output; `Autodiff<B>` records one node storing only `q`, `k` and `v`, whose
    /// backward is `core`'s.
    fn recomputed_attention_core<A: RecomputedAttention>(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        core: A,
    ) -> Tensor<Self, 4> {
        core.forward(q, k, v)
    }
}

impl<B: RecomputeOps, C: CheckpointStrategy> RecomputeOps for Autodiff<B, C> {
    fn recomputed_attention_core<A: RecomputedAttention>(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        core: A,
    ) -> Tensor<Self, 4> {
        let [q, k, v] = [q, k, v].map(raw);
        let output = core.forward::<B>(inner(&q), inner(&k), inner(&v));
        let state = (
            q.primitive.clone(),
            k.primitive.clone(),
            v.primitive.clone(),
            core,
        );
        wrap(record::<B, C, _>(
            Recomputed::<A>(std::marker::PhantomData),
            &[&q, &k, &v],
            state,
            raw(output),
        ))
    }
}

/// CubeCL backends: the default (the recomputation is the autodiff node's).
#[cfg(feature = "fused")]
impl<R, F, I, BT> RecomputeOps for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
}

/// The backward of [`RecomputeOps::recomputed_attention_core`]. Its parents are `[q, k, v]`.
#[derive(Debug)]
struct Recomputed<A>(std::marker::PhantomData<fn() -> A>);

impl<B: RecomputeOps, A: RecomputedAttention> BackwardStep<B> for Recomputed<A> {
    type State = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, A);

    fn backward(
        self,
        grad: FloatTensor<B>,
        (q, k, v, core): <Self as BackwardStep<B>>::State,
        parents: &[Option<NodeId>],
        grads: &mut Gradients,
    ) {
        let [dq, dk, dv] = core.backward::<B>(wrap(q), wrap(k), wrap(v), wrap(grad));
        for (index, gradient) in [dq, dk, dv].into_iter().enumerate() {
            register(grads, parent(parents, index), || gradient);
        }
    }
}
