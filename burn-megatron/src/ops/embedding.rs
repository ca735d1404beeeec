//! The token-embedding lookup, with its weight gradient behind
//! [`ModelBackend::embedding_gradient`].
//!
//! The forward is Burn's `embedding` (a gather of rows). Its gradient scatters the output's
//! gradient back onto the table, `dW[v] = Σ_{tokens t with id v} dY[t]`; Burn's kernel for
//! that gives one thread to each hidden column and loops over every token (6.5 ms of a GPT-2
//! step on an H100). CubeCL backends run `burn_megatron_kernels::fused::embedding` instead:
//! deterministic, each row summed in token order in f32. `Autodiff<B>` records one node
//! holding only the ids.

use burn::backend::Autodiff;
use burn::tensor::{Int, Tensor, TensorPrimitive};
use burn::tensor::{IndexingUpdateOp, backend::Backend, ops::IntTensor};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use crate::backend::{ModelBackend, wrap};

/// Rows of `weight` (`[vocab, hidden]`) for `ids` (`[batch, seq]`, each in `0..vocab`):
/// `[batch, seq, hidden]`. Its weight gradient is [`ModelBackend::embedding_gradient`].
pub fn embedding<B: ModelBackend>(weight: Tensor<B, 2>, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
    B::embedding_lookup(weight, ids)
}

/// `dW` (`[vocab, hidden]`, `grad`'s dtype) from the output's gradient `grad` (`[tokens,
/// hidden]`) and the ids (`[tokens]`) as Burn computes it: a zero table and a `select_add`.
pub fn backward_composition<B: Backend>(
    grad: Tensor<B, 2>,
    ids: Tensor<B, 1, Int>,
    vocab: usize,
) -> Tensor<B, 2> {
    let hidden = grad.dims()[1];
    let zeros = Tensor::<B, 2>::zeros([vocab, hidden], (&grad.device(), grad.dtype()));
    zeros.select_assign(0, ids, grad, IndexingUpdateOp::Add)
}

/// [`ModelBackend::embedding_lookup`] on `Autodiff<B>`: Burn's gather on the inner backend, and one
/// [`EmbeddingBackward`] node holding the ids and the vocabulary size.
pub(crate) fn autodiff_embedding<B: ModelBackend, C: CheckpointStrategy>(
    weight: Tensor<Autodiff<B, C>, 2>,
    ids: Tensor<Autodiff<B, C>, 2, Int>,
) -> Tensor<Autodiff<B, C>, 3> {
    let weight = weight.into_primitive().tensor();
    let ids: IntTensor<B> = ids.into_primitive();
    let table = wrap::<B, 2>(weight.primitive.clone());
    let vocab = table.dims()[0];
    let output = burn::tensor::module::embedding(
        table,
        Tensor::<B, 2, Int>::from_primitive(ids.clone()),
    )
    .into_primitive()
    .tensor();
    let output = match EmbeddingBackward
        .prepare::<C>([weight.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((ids, vocab), output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    };
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// The backward of `y = W[ids]`: `dW` from [`ModelBackend::embedding_gradient`]. Its parent
/// is the table.
#[derive(Debug)]
struct EmbeddingBackward;

impl<B: ModelBackend> Backward<B, 1> for EmbeddingBackward {
    /// The `[batch, seq]` ids and the vocabulary size.
    type State = (IntTensor<B>, usize);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [parent] = ops.parents;
        let Some(parent) = parent else {
            return;
        };
        let (ids, vocab) = ops.state;
        let grad = wrap::<B, 3>(grad);
        let [batch, seq, hidden] = grad.dims();
        let ids = Tensor::<B, 2, Int>::from_primitive(ids).reshape([batch * seq]);
        let dw = B::embedding_gradient(grad.reshape([batch * seq, hidden]), ids, vocab);
        grads.register::<B>(parent.id, dw.into_primitive().tensor());
    }
}
