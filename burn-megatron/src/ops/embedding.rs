//! The token-embedding lookup, with its weight gradient behind
//! [`EmbeddingOps::embedding_gradient`].
//!
//! The forward is Burn's `embedding` (a gather of rows). Its gradient scatters the output's
//! gradient back onto the table, `dW[v] = Σ_{tokens t with id v} dY[t]`; Burn's kernel for
//! that gives one thread to each hidden column and loops over every token (6.5 ms of a GPT-2
//! step on an H100). CubeCL backends run `burn_megatron_kernels::fused::embedding` instead:
//! deterministic, each row summed in token order in f32. `Autodiff<B>` records one node
//! holding only the ids.

use burn::backend::Autodiff;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{IndexingUpdateOp, Int, Tensor, backend::Backend};
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;

use super::autodiff::{BackwardStep, inner, parent, record, register};
use super::primitive::{raw, wrap};

/// The token-embedding lookup and its weight gradient.
pub trait EmbeddingOps: Backend {
    /// Rows of `weight` (`[vocab, hidden]`) for `ids` (`[batch, seq]`), Burn's gather.
    /// `Autodiff<B>` records one node holding the ids, whose backward is
    /// [`embedding_gradient`](Self::embedding_gradient).
    fn embedding_lookup(weight: Tensor<Self, 2>, ids: Tensor<Self, 2, Int>) -> Tensor<Self, 3> {
        burn::tensor::module::embedding(weight, ids)
    }

    /// [`embedding_lookup`](Self::embedding_lookup) where an id of `vocab` (the table's row
    /// count) or more gives a zero row and adds nothing to the table's gradient: the tokens
    /// that another tensor-parallel rank's slice of the vocabulary holds. Pointing those at a
    /// row of this slice and masking the row would give the same values, but the gradient
    /// kernel would then sum every such token into that one row, one after the other.
    fn embedding_lookup_or_zero(
        weight: Tensor<Self, 2>,
        ids: Tensor<Self, 2, Int>,
    ) -> Tensor<Self, 3> {
        let vocab = weight.dims()[0] as i64;
        let in_range = ids.clone().lower_elem(vocab);
        let rows = burn::tensor::module::embedding(weight, ids.clamp_max(vocab - 1));
        let dtype = rows.dtype();
        rows * in_range.float().cast(dtype).unsqueeze_dim::<3>(2)
    }

    /// The gradient `[vocab, hidden]` of an embedding table from its output's gradient
    /// `grad` (`[tokens, hidden]`) and the ids (`[tokens]`), in `grad`'s dtype: row `v` sums
    /// the rows of `grad` whose id is `v`; ids of `vocab` or more add nothing (see
    /// [`embedding_lookup_or_zero`](Self::embedding_lookup_or_zero)). CubeCL backends run one
    /// deterministic kernel (`burn_megatron_kernels::fused::embedding`); the default is Burn's
    /// `select_add`.
    fn embedding_gradient(
        grad: Tensor<Self, 2>,
        ids: Tensor<Self, 1, Int>,
        vocab: usize,
    ) -> Tensor<Self, 2> {
        backward_composition(grad, ids, vocab)
    }
}

/// Rows of `weight` (`[vocab, hidden]`) for `ids` (`[batch, seq]`, each in `0..vocab`):
/// `[batch, seq, hidden]`. Its weight gradient is [`EmbeddingOps::embedding_gradient`].
pub fn embedding<B: EmbeddingOps>(weight: Tensor<B, 2>, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
    B::embedding_lookup(weight, ids)
}

/// Rows of `weight` for `ids`, where an id of `vocab` (the table's row count) or more gives
/// a zero row and no gradient: [`EmbeddingOps::embedding_lookup_or_zero`].
pub fn embedding_or_zero<B: EmbeddingOps>(
    weight: Tensor<B, 2>,
    ids: Tensor<B, 2, Int>,
) -> Tensor<B, 3> {
    B::embedding_lookup_or_zero(weight, ids)
}

/// Rows `rows` of `table` (`[n, hidden]`, each index in `0..n`): `[rows.len(), hidden]`. The
/// lookup above on one sequence of ids, for gathers that are not embeddings (the MoE
/// dispatcher's permutations): its gradient is [`EmbeddingOps::embedding_gradient`], one
/// deterministic kernel on CubeCL backends, where the gradient of Burn's `select` loops over
/// every index for each column (1.6 ms a call for 16k rows of 2048 on an H200, 40 % of an MoE
/// step).
///
/// # Shapes
/// - `table`: `[n, hidden]`
/// - `rows`: `[m]`
/// - output: `[m, hidden]`
pub fn gather_rows<B: EmbeddingOps>(table: Tensor<B, 2>, rows: Tensor<B, 1, Int>) -> Tensor<B, 2> {
    let (m, hidden) = (rows.dims()[0], table.dims()[1]);
    B::embedding_lookup(table, rows.reshape([1, m])).reshape([m, hidden])
}

/// [`gather_rows`] where an index of `n` (the table's row count) or more gives a zero row
/// and adds nothing to the table's gradient ([`EmbeddingOps::embedding_lookup_or_zero`]): the
/// MoE dispatcher's padding rows. Pointing them at a zero row appended to the table would
/// cost a copy of the table, and the gradient kernel would sum every padding row into that
/// one row, one after the other (the longest chain of the step).
///
/// # Shapes
/// As [`gather_rows`].
pub fn gather_rows_or_zero<B: EmbeddingOps>(
    table: Tensor<B, 2>,
    rows: Tensor<B, 1, Int>,
) -> Tensor<B, 2> {
    let (m, hidden) = (rows.dims()[0], table.dims()[1]);
    B::embedding_lookup_or_zero(table, rows.reshape([1, m])).reshape([m, hidden])
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

/// The inner backend's lookup, and one node holding the ids and the vocabulary size.
impl<B: EmbeddingOps, C: CheckpointStrategy> EmbeddingOps for Autodiff<B, C> {
    fn embedding_lookup(weight: Tensor<Self, 2>, ids: Tensor<Self, 2, Int>) -> Tensor<Self, 3> {
        autodiff_embedding::<B, C>(weight, ids, false)
    }

    fn embedding_lookup_or_zero(
        weight: Tensor<Self, 2>,
        ids: Tensor<Self, 2, Int>,
    ) -> Tensor<Self, 3> {
        autodiff_embedding::<B, C>(weight, ids, true)
    }
}

/// [`EmbeddingOps::embedding_lookup`] (or, with `or_zero`, `embedding_lookup_or_zero`) on
/// `Autodiff<B>`.
fn autodiff_embedding<B: EmbeddingOps, C: CheckpointStrategy>(
    weight: Tensor<Autodiff<B, C>, 2>,
    ids: Tensor<Autodiff<B, C>, 2, Int>,
    or_zero: bool,
) -> Tensor<Autodiff<B, C>, 3> {
    let weight = raw(weight);
    let ids: IntTensor<B> = ids.into_primitive();
    let table = inner::<B, 2>(&weight);
    let vocab = table.dims()[0];
    let inner_ids = Tensor::<B, 2, Int>::from_primitive(ids.clone());
    let output = match or_zero {
        false => B::embedding_lookup(table, inner_ids),
        true => B::embedding_lookup_or_zero(table, inner_ids),
    };
    wrap(record::<B, C, _>(
        EmbeddingBackward,
        &[&weight],
        (ids, vocab),
        raw(output),
    ))
}

/// The backward of `y = W[ids]`: `dW` from [`EmbeddingOps::embedding_gradient`]. Its parent
/// is the table.
#[derive(Debug)]
struct EmbeddingBackward;

impl<B: EmbeddingOps> BackwardStep<B> for EmbeddingBackward {
    /// The `[batch, seq]` ids and the vocabulary size.
    type State = (IntTensor<B>, usize);

    fn backward(
        self,
        grad: FloatTensor<B>,
        (ids, vocab): <Self as BackwardStep<B>>::State,
        parents: &[Option<NodeId>],
        grads: &mut Gradients,
    ) {
        register(grads, parent(parents, 0), || {
            let grad = wrap::<B, 3>(grad);
            let [batch, seq, hidden] = grad.dims();
            let ids = Tensor::<B, 2, Int>::from_primitive(ids).reshape([batch * seq]);
            B::embedding_gradient(grad.reshape([batch * seq, hidden]), ids, vocab)
        });
    }
}

/// CubeCL backends: the gradient in one deterministic kernel (f64: the composition).
#[cfg(feature = "fused")]
mod cube {
    use burn::tensor::{DType, Int, Tensor};
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use burn_megatron_kernels::fused::embedding as kernels;

    use super::{EmbeddingOps, backward_composition};
    use crate::ops::primitive::{raw, wrap};

    impl<R, F, I, BT> EmbeddingOps for CubeBackend<R, F, I, BT>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        fn embedding_gradient(
            grad: Tensor<Self, 2>,
            ids: Tensor<Self, 1, Int>,
            vocab: usize,
        ) -> Tensor<Self, 2> {
            if grad.dtype() == DType::F64 {
                return backward_composition(grad, ids, vocab);
            }
            wrap(kernels::embedding_backward(
                raw(grad),
                ids.into_primitive(),
                vocab,
                kernels::BUCKETS,
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::{Int, Tensor, TensorData};
    use burn_megatron_testing::{assert_close, tolerance, values};

    use crate::init::{InitDistribution, init_full};

    type AD = Autodiff<NdArray>;

    /// Our node (ids kept, `EmbeddingOps::embedding_gradient` backward) against Burn's own
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
