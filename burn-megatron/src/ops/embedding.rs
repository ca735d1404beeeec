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
use burn::tensor::{IndexingUpdateOp, backend::Backend, ops::IntTensor};
use burn::tensor::{Int, Tensor, TensorPrimitive};
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

/// Rows of `weight` for `ids`, where an id of `vocab` (the table's row count) or more gives
/// a zero row and no gradient: [`ModelBackend::embedding_lookup_or_zero`].
pub fn embedding_or_zero<B: ModelBackend>(
    weight: Tensor<B, 2>,
    ids: Tensor<B, 2, Int>,
) -> Tensor<B, 3> {
    B::embedding_lookup_or_zero(weight, ids)
}

/// `dW` (`[vocab, hidden]`, `grad`'s dtype) from the output's gradient `grad` (`[tokens,
/// hidden]`) and the ids (`[tokens]`) as Burn computes it: a zero table and a `select_add`.
/// Tokens whose id is `vocab` or more add nothing (their rows of `grad` are zeroed and their
/// ids clamped into the table).
pub fn backward_composition<B: Backend>(
    grad: Tensor<B, 2>,
    ids: Tensor<B, 1, Int>,
    vocab: usize,
) -> Tensor<B, 2> {
    let hidden = grad.dims()[1];
    let in_range = ids.clone().lower_elem(vocab as i64);
    let grad = grad.clone() * in_range.float().cast(grad.dtype()).unsqueeze_dim::<2>(1);
    let ids = ids.clamp_max(vocab as i64 - 1);
    let zeros = Tensor::<B, 2>::zeros([vocab, hidden], (&grad.device(), grad.dtype()));
    zeros.select_assign(0, ids, grad, IndexingUpdateOp::Add)
}

/// [`ModelBackend::embedding_lookup`] (or, with `or_zero`, `embedding_lookup_or_zero`) on
/// `Autodiff<B>`: the inner backend's lookup, and one [`EmbeddingBackward`] node holding the
/// ids and the vocabulary size.
pub(crate) fn autodiff_embedding<B: ModelBackend, C: CheckpointStrategy>(
    weight: Tensor<Autodiff<B, C>, 2>,
    ids: Tensor<Autodiff<B, C>, 2, Int>,
    or_zero: bool,
) -> Tensor<Autodiff<B, C>, 3> {
    let weight = weight.into_primitive().tensor();
    let ids: IntTensor<B> = ids.into_primitive();
    let table = wrap::<B, 2>(weight.primitive.clone());
    let vocab = table.dims()[0];
    let inner_ids = Tensor::<B, 2, Int>::from_primitive(ids.clone());
    let output = match or_zero {
        false => B::embedding_lookup(table, inner_ids),
        true => B::embedding_lookup_or_zero(table, inner_ids),
    }
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

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::{Int, Tensor, TensorData};
    use burn_megatron_testing::{assert_close, tolerance, values};

    use crate::init::{InitDistribution, init_full};

    type AD = Autodiff<NdArray>;

    /// Our node (ids kept, `ModelBackend::embedding_gradient` backward) against Burn's own
    /// autodiff `embedding`: output and table gradient, with repeated ids, the first and last
    /// row, and rows no token hits (their gradient must be zero, not missing).
    #[test]
    fn embedding_gradient_matches_burns_autodiff() {
        let dev = Default::default();
        let (vocab, hidden) = (11, 6);
        let ids = [[0, 3, 3, 10], [7, 0, 3, 10], [1, 1, 1, 5]];
        let run = |ours: bool| {
            let w = init_full::<AD, 2>(
                [vocab, hidden],
                InitDistribution::Normal { std: 1.0 },
                1,
                &dev,
            )
            .require_grad();
            let ids = Tensor::<AD, 2, Int>::from_data(TensorData::from(ids), &dev);
            let y = if ours {
                super::embedding(w.clone(), ids)
            } else {
                burn::tensor::module::embedding(w.clone(), ids)
            };
            let upstream = init_full::<AD, 3>(
                [3, 4, hidden],
                InitDistribution::Normal { std: 1.0 },
                2,
                &dev,
            );
            let grads = (y.clone() * upstream).sum().backward();
            [values(y.inner()), values(w.grad(&grads).unwrap())]
        };
        let [ours, burns] = [run(true), run(false)];
        assert_close("output", &ours[0], &burns[0], tolerance::F32_SAME_ORDER);
        assert_close("dW", &ours[1], &burns[1], tolerance::F32_SAME_ORDER);
        let untouched = (2..vocab).filter(|v| ![3, 5, 7, 10].contains(v));
        for v in untouched {
            assert!(ours[1][v * hidden..][..hidden].iter().all(|&g| g == 0.0));
        }
        assert!(ours[1][3 * hidden..][..hidden].iter().all(|&g| g != 0.0));
    }

    /// Ids of `vocab` or more give zero rows and no gradient: the lookup against the table
    /// with a zero row appended (where those ids point), output and gradient, with the
    /// appended row's gradient dropped. Row 0 and the last row get exactly their own tokens.
    #[test]
    fn ids_past_the_table_give_zero_rows_and_no_gradient() {
        let dev = Default::default();
        let (vocab, hidden) = (5, 3);
        let ids = [[0, 5, 4, 7], [5, 0, 2, 6]];
        let upstream = init_full::<AD, 3>(
            [2, 4, hidden],
            InitDistribution::Normal { std: 1.0 },
            2,
            &dev,
        );
        let w = init_full::<AD, 2>(
            [vocab, hidden],
            InitDistribution::Normal { std: 1.0 },
            1,
            &dev,
        )
        .require_grad();
        let ours = super::embedding_or_zero(
            w.clone(),
            Tensor::<AD, 2, Int>::from_data(TensorData::from(ids), &dev),
        );
        let grads = (ours.clone() * upstream.clone()).sum().backward();
        let dw = values(w.grad(&grads).unwrap());

        let table = w.clone().inner();
        let padded = Tensor::<AD, 2>::from_inner(Tensor::cat(
            vec![table.clone(), table.zeros_like().narrow(0, 0, 1)],
            0,
        ))
        .require_grad();
        let clamped = ids.map(|row| row.map(|id: i64| id.min(vocab as i64)));
        let reference = burn::tensor::module::embedding(
            padded.clone(),
            Tensor::<AD, 2, Int>::from_data(TensorData::from(clamped), &dev),
        );
        let grads = (reference.clone() * upstream).sum().backward();
        let dw_reference = values(padded.grad(&grads).unwrap());
        let out = values(ours.inner());
        assert_close(
            "output",
            &out,
            &values(reference.inner()),
            tolerance::F32_SAME_ORDER,
        );
        assert_close(
            "dW",
            &dw,
            &dw_reference[..vocab * hidden],
            tolerance::F32_SAME_ORDER,
        );
        for t in [1, 3, 4, 7] {
            assert!(out[t * hidden..][..hidden].iter().all(|&v| v == 0.0));
        }
    }
}
