//! The shell every written-out backward shares.
//!
//! Burn's autodiff records an operation as a node implementing `Backward<B, N>` for its `N`
//! tracked inputs. Our operations take optional inputs (a bias or a residual), so the same
//! backward runs with one, two or three parents. A [`BackwardStep`] is written once, against a
//! slice of parents, and [`record`] turns it into the node of the right arity: no op restates
//! the "consume the gradient, map the parents, match tracked or not" shell.

use std::fmt::Debug;

use burn::backend::Autodiff;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use super::primitive::wrap;

/// The backward pass of one recorded operation.
pub(crate) trait BackwardStep<B: Backend>: Debug + Send + Sized + 'static {
    /// What the forward pass keeps for the backward pass.
    type State: Clone + Send + Debug + 'static;

    /// Registers the gradient of each input whose node is `Some` in `parents` (in the order the
    /// inputs were given to [`record`]) from the output's gradient `grad`.
    fn backward(
        self,
        grad: FloatTensor<B>,
        state: <Self as BackwardStep<B>>::State,
        parents: &[Option<NodeId>],
        grads: &mut Gradients,
    );
}

/// A [`BackwardStep`] as Burn's node, for any number of parents.
#[derive(Debug)]
struct Node<S>(S);

impl<B: Backend, S: BackwardStep<B>, const N: usize> Backward<B, N> for Node<S> {
    type State = S::State;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let parents = ops.parents.map(|parent| parent.map(|node| node.id));
        self.0.backward(grad, ops.state, &parents, grads);
    }
}

/// The autodiff tensor of `output`, computed on the inner backend from `inputs` (one to five),
/// with `step` as its backward; `state` is kept only where some input needs a gradient.
pub(crate) fn record<B: Backend, C: CheckpointStrategy, S: BackwardStep<B>>(
    step: S,
    inputs: &[&AutodiffPrimitive<B>],
    state: S::State,
    output: FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    macro_rules! finish {
        ($n:literal; $($i:literal),+) => {
            match Backward::<B, $n>::prepare::<C>(Node(step), [$(inputs[$i].node.clone()),+])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(state, output),
                OpsKind::UnTracked(prep) => prep.finish(output),
            }
        };
    }
    match inputs.len() {
        1 => finish!(1; 0),
        2 => finish!(2; 0, 1),
        3 => finish!(3; 0, 1, 2),
        4 => finish!(4; 0, 1, 2, 3),
        5 => finish!(5; 0, 1, 2, 3, 4),
        n => unreachable!("a recorded operation has one to five inputs, not {n}"),
    }
}

/// Registers `grad()` as the gradient of `parent`, computing it only when `parent` is tracked.
pub(crate) fn register<B: Backend, const D: usize>(
    grads: &mut Gradients,
    parent: Option<NodeId>,
    grad: impl FnOnce() -> Tensor<B, D>,
) {
    if let Some(id) = parent {
        grads.register::<B>(id, grad().into_primitive().tensor());
    }
}

/// The parent at `index`, `None` where that input was not given or needs no gradient.
pub(crate) fn parent(parents: &[Option<NodeId>], index: usize) -> Option<NodeId> {
    parents.get(index).copied().flatten()
}

/// Burn's autodiff primitive over `B`, whatever the checkpoint strategy (Burn keeps its type
/// private).
pub(crate) type AutodiffPrimitive<B> = FloatTensor<Autodiff<B>>;

/// The inner backend's tensor behind an autodiff primitive.
pub(crate) fn inner<B: Backend, const D: usize>(tensor: &AutodiffPrimitive<B>) -> Tensor<B, D> {
    wrap(tensor.primitive.clone())
}
