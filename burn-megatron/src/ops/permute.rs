//! Megatron's MoE `permute` and `unpermute`: rows gathered by an index whose inverse the
//! caller knows, so that the gradient is a gather too.
//!
//! The MoE dispatcher moves each token's copies into expert-major order and back. Each row of
//! the source is read by at most `c` rows of the output (`c = 1` for a permutation, `top_k`
//! for the copies of a token), so the gradient `dx[j] = Σ_{i: rows[i] = j} dy[i]` is a gather
//! of `dy` by an index that lists, for each `j`, its `c` readers (a zero row where it has
//! fewer), then a sum over `c`: no scatter-add, no atomics, no kernel that walks every index
//! for each row. The gradient of Burn's `select` is a `select_assign` whose CubeCL kernel
//! loops over every index for each column; the embedding's gradient kernel
//! ([`super::embedding`]) is deterministic but walks every index in each of its 256 buckets.
//!
//! [`PermuteOps::invert_rows`] builds such an inverse on the device, `inverse[rows[i]] = i`:
//! CubeCL's `scatter` gives one thread to each column and loops over the indices (for a 1-D
//! index, one thread for all of them), so CubeCL backends run a kernel of a thread an index.
//! They also run each row move as one kernel (a cube an output row).
//!
//! [`unpermute_rows`] is the way back with the router's weights, Megatron's `unpermute`: each
//! token's `top_k` rows gathered, weighted and summed, one node whose backward is a product
//! and a gather (Burn's `sum_dim` would materialise a tensor of ones of the rows' size for
//! its gradient, and its product another).
//!
//! `Autodiff<B>` records one node for [`permute_rows`], holding the inverse index only.

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{BoolTensor, FloatTensor, IntTensor};
use burn::tensor::{Bool, IndexingUpdateOp, Int, Tensor, TensorData};
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;

use super::autodiff::{BackwardStep, inner, parent, record, register};
use super::primitive::{raw, wrap};

/// Which row of a source each output row reads: `rows[i]`, or a zero row where `zero[i]`.
///
/// # Shapes
/// - rows: `[m]`, each in `0..n` (the source's rows), whatever `zero` says
/// - zero: `[m]`, `None` where no output row is zero
#[derive(Debug, Clone)]
pub struct RowIndex<B: Backend> {
    rows: Tensor<B, 1, Int>,
    zero: Option<Tensor<B, 1, Bool>>,
}

impl<B: Backend> RowIndex<B> {
    /// Output row `i` reads source row `rows[i]` (each in `0..n`).
    pub fn new(rows: Tensor<B, 1, Int>) -> Self {
        Self { rows, zero: None }
    }

    /// The same index with the output rows where `zero` (`[m]`) is true set to zero (and so
    /// giving no gradient); `rows` must still be in range there.
    pub fn with_zero_rows(self, zero: Tensor<B, 1, Bool>) -> Self {
        Self {
            zero: Some(zero),
            ..self
        }
    }

    /// An index from the host: `Some(j)` reads row `j`, `None` is a zero row (its index 0).
    /// Uploaded without a kernel; no mask where every row reads one.
    pub fn from_host(rows: &[Option<usize>], device: &B::Device) -> Self {
        let m = rows.len();
        let values: Vec<i64> = rows.iter().map(|r| r.unwrap_or(0) as i64).collect();
        let index = Self::new(Tensor::from_data(TensorData::new(values, [m]), device));
        match rows.iter().any(Option::is_none) {
            true => {
                let zero: Vec<bool> = rows.iter().map(Option::is_none).collect();
                index.with_zero_rows(Tensor::from_data(TensorData::new(zero, [m]), device))
            }
            false => index,
        }
    }

    /// Output rows.
    pub fn len(&self) -> usize {
        self.rows.dims()[0]
    }

    /// Whether the index has no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The source row of each output row, `[m]` (anything in range for a zero row).
    pub fn rows(&self) -> &Tensor<B, 1, Int> {
        &self.rows
    }

    /// `[m]`: which output rows are zero, if any.
    pub fn zero_rows(&self) -> Option<&Tensor<B, 1, Bool>> {
        self.zero.as_ref()
    }
}

/// Row gathers whose gradient is a gather through a known inverse.
pub trait PermuteOps: Backend {
    /// `y[i] = x[forward.rows[i]]`, zero where `forward` says. `backward` is the inverse:
    /// `[n · c]` rows, `c` for each row `j` of `x` (in order), listing the output rows that
    /// read `j` and zero for the rest, so that `dx[j] = Σ_c dy[backward[j · c + c']]`.
    /// `Autodiff<B>` records one node holding `backward`, whose backward pass is that gather
    /// and sum ([`sum_gathered_rows`](Self::sum_gathered_rows)); the default forward is
    /// [`gather_rows`].
    ///
    /// # Shapes
    /// - x: `[n, hidden]`
    /// - forward: `[m]`; backward: `[n · c]`
    /// - output: `[m, hidden]`
    fn permute_rows(
        x: Tensor<Self, 2>,
        forward: &RowIndex<Self>,
        backward: &RowIndex<Self>,
    ) -> Tensor<Self, 2> {
        let _ = backward;
        gather_rows(x, forward)
    }

    /// `y[t] = Σ_j weights[t, j] · x[forward.rows[t · k + j]]` (Megatron's `unpermute`, with
    /// `forward`'s zero rows zero): each token's `k` rows gathered, weighted and summed.
    /// `backward` is the inverse, one output row of `forward` (a row `t · k + j`) for each row
    /// of `x` or a zero row. `Autodiff<B>` gathers the rows ([`permute_rows`](Self::permute_rows),
    /// kept for the weights' gradient), weights and sums them as Burn operations, and records
    /// one node holding the gathered rows, the weights and `backward`: `dx[i] = weights[a] ·
    /// dy[a / k]` for the row `a` that reads `i`
    /// ([`unpermute_input_gradient`](Self::unpermute_input_gradient)), and `dweights[t, j] =
    /// dy[t] · x[rows[t · k + j]]`. The default forward (what this method runs without
    /// autodiff) is [`unpermute_composition`].
    ///
    /// # Shapes
    /// - x: `[n, hidden]`
    /// - forward: `[tokens · k]`; backward: `[n]`
    /// - weights: `[tokens, k]`
    /// - output: `[tokens, hidden]`
    fn unpermute_rows(
        x: Tensor<Self, 2>,
        forward: &RowIndex<Self>,
        backward: &RowIndex<Self>,
        weights: Tensor<Self, 2>,
    ) -> Tensor<Self, 2> {
        let _ = backward;
        unpermute_composition(x, forward, weights)
    }

    /// `dx[j] = Σ_c dy[inverse[j · c + c']]` for the `n` rows of `x`: the backward pass of
    /// [`permute_rows`](Self::permute_rows). The default is [`gather_rows_summed`].
    ///
    /// # Shapes
    /// - dy: `[m, hidden]`; inverse: `[n · c]`
    /// - output: `[n, hidden]`
    fn sum_gathered_rows(
        dy: Tensor<Self, 2>,
        inverse: &RowIndex<Self>,
        n: usize,
    ) -> Tensor<Self, 2> {
        gather_rows_summed(dy, inverse, n)
    }

    /// `dx[i] = weights[a] · dy[a / k]` for the output row `a = inverse[i]` of the forward
    /// index that read row `i` of `x` (zero where `inverse` says): the input gradient of
    /// [`unpermute_rows`](Self::unpermute_rows), `k` being the weights' columns. The default
    /// is [`unpermute_input_gradient_composition`].
    ///
    /// # Shapes
    /// - dy: `[tokens, hidden]`; weights: `[tokens, k]`; inverse: `[n]`
    /// - output: `[n, hidden]`
    fn unpermute_input_gradient(
        dy: Tensor<Self, 2>,
        weights: Tensor<Self, 2>,
        inverse: &RowIndex<Self>,
    ) -> Tensor<Self, 2> {
        unpermute_input_gradient_composition(dy, weights, inverse)
    }

    /// The inverse of an injective index: `inverse[rows[i]] = i` for every `rows[i] < n`
    /// (indices of `n` or more are skipped); a row no index names gets 0. Every value is
    /// clamped into `0..m`, so that an index named twice (a token that chose one expert twice,
    /// as the router's top-k does for a row of NaN scores) gives wrong rows, not rows past the
    /// buffers. The default is [`invert_rows_composition`]; CubeCL backends run a kernel of
    /// a thread an index.
    ///
    /// # Shapes
    /// - rows: `[m]`, distinct where below `n`
    /// - output: `[n]`
    fn invert_rows(rows: Tensor<Self, 1, Int>, n: usize) -> Tensor<Self, 1, Int> {
        invert_rows_composition(rows, n)
    }
}

/// [`PermuteOps::permute_rows`] after checking that `backward` has a whole number of rows
/// for each row of `x`.
///
/// # Shapes
/// As [`PermuteOps::permute_rows`].
///
/// # Panics
/// If `backward`'s length is not a multiple of `x`'s rows.
pub fn permute_rows<B: PermuteOps>(
    x: Tensor<B, 2>,
    forward: &RowIndex<B>,
    backward: &RowIndex<B>,
) -> Tensor<B, 2> {
    let n = x.dims()[0];
    assert!(
        n > 0 && backward.len().is_multiple_of(n),
        "permute_rows: an inverse of {} rows for a source of {n}",
        backward.len()
    );
    B::permute_rows(x, forward, backward)
}

/// [`PermuteOps::unpermute_rows`] after checking the shapes.
///
/// # Shapes
/// As [`PermuteOps::unpermute_rows`].
///
/// # Panics
/// If `forward` does not have `k` rows for each token, or `backward` one for each row of `x`.
pub fn unpermute_rows<B: PermuteOps>(
    x: Tensor<B, 2>,
    forward: &RowIndex<B>,
    backward: &RowIndex<B>,
    weights: Tensor<B, 2>,
) -> Tensor<B, 2> {
    let n = x.dims()[0];
    let [tokens, k] = weights.dims();
    assert!(
        forward.len() == tokens * k && backward.len() == n,
        "unpermute_rows: {} rows for {tokens} tokens × {k}, an inverse of {} rows for {n}",
        forward.len(),
        backward.len()
    );
    B::unpermute_rows(x, forward, backward, weights)
}

/// `Σ_j weights[t, j] · rows[t, j]`: the weighted sum over each token's `k` rows.
///
/// # Shapes
/// - rows: `[tokens, k, hidden]`; weights: `[tokens, k]`
/// - output: `[tokens, hidden]`
fn weighted_sum<B: Backend>(rows: Tensor<B, 3>, weights: Tensor<B, 2>) -> Tensor<B, 2> {
    let [tokens, _, hidden] = rows.dims();
    (rows * weights.unsqueeze_dim::<3>(2))
        .sum_dim(1)
        .reshape([tokens, hidden])
}

/// [`PermuteOps::unpermute_rows`] as plain Burn operations: [`gather_rows`], a product and a
/// sum over `k`.
pub fn unpermute_composition<B: Backend>(
    x: Tensor<B, 2>,
    forward: &RowIndex<B>,
    weights: Tensor<B, 2>,
) -> Tensor<B, 2> {
    let hidden = x.dims()[1];
    let [tokens, k] = weights.dims();
    weighted_sum(
        gather_rows(x, forward).reshape([tokens, k, hidden]),
        weights,
    )
}

/// `x[index.rows]` with `index`'s zero rows zeroed: Burn's `select`, and a mask.
///
/// # Shapes
/// - x: `[n, hidden]`; index: `[m]`
/// - output: `[m, hidden]`
pub fn gather_rows<B: Backend>(x: Tensor<B, 2>, index: &RowIndex<B>) -> Tensor<B, 2> {
    let hidden = x.dims()[1];
    let y = x.select(0, index.rows.clone());
    match &index.zero {
        None => y,
        Some(zero) => {
            let m = zero.dims()[0];
            y.mask_fill(zero.clone().reshape([m, 1]).expand([m, hidden]), 0.0)
        }
    }
}

/// `dx[j] = Σ_c dy[inverse[j · c + c']]` for the `n` rows of `x`: [`gather_rows`] and a sum
/// over each row's `c` readers, in their order.
///
/// # Shapes
/// - dy: `[m, hidden]`; inverse: `[n · c]`
/// - output: `[n, hidden]`
pub fn gather_rows_summed<B: Backend>(
    dy: Tensor<B, 2>,
    inverse: &RowIndex<B>,
    n: usize,
) -> Tensor<B, 2> {
    let gathered = gather_rows(dy, inverse);
    let [len, hidden] = gathered.dims();
    match len / n {
        1 => gathered,
        c => gathered
            .reshape([n, c, hidden])
            .sum_dim(1)
            .reshape([n, hidden]),
    }
}

/// [`PermuteOps::unpermute_input_gradient`] as Burn operations: the product `dy ⊗ weights`
/// (`[tokens · k, hidden]`) and [`gather_rows_summed`] through the inverse.
pub fn unpermute_input_gradient_composition<B: Backend>(
    dy: Tensor<B, 2>,
    weights: Tensor<B, 2>,
    inverse: &RowIndex<B>,
) -> Tensor<B, 2> {
    let ([tokens, hidden], [_, k]) = (dy.dims(), weights.dims());
    let d_rows = dy.reshape([tokens, 1, hidden]) * weights.unsqueeze_dim::<3>(2);
    gather_rows_summed(d_rows.reshape([tokens * k, hidden]), inverse, inverse.len())
}

/// [`PermuteOps::invert_rows`] as Burn computes it: a zero vector and a `scatter` of the
/// positions (on CubeCL one thread for the whole index).
pub fn invert_rows_composition<B: Backend>(rows: Tensor<B, 1, Int>, n: usize) -> Tensor<B, 1, Int> {
    let m = rows.dims()[0];
    let device = rows.device();
    let positions = Tensor::<B, 1, Int>::arange(0..m as i64, &device);
    Tensor::<B, 1, Int>::zeros([n + 1], &device)
        .scatter(
            0,
            rows.clamp_max(n as i64),
            positions,
            IndexingUpdateOp::Add,
        )
        .narrow(0, 0, n)
        .clamp(0, m.max(1) as i64 - 1)
}

/// The inner backend's gather, and one node holding the inverse.
impl<B: PermuteOps, C: CheckpointStrategy> PermuteOps for Autodiff<B, C> {
    fn permute_rows(
        x: Tensor<Self, 2>,
        forward: &RowIndex<Self>,
        backward: &RowIndex<Self>,
    ) -> Tensor<Self, 2> {
        let n = x.dims()[0];
        let x = raw(x);
        let (forward, backward) = (to_inner::<B, C>(forward), to_inner::<B, C>(backward));
        let output = B::permute_rows(inner(&x), &forward, &backward);
        let state = (
            backward.rows.into_primitive(),
            backward.zero.map(Tensor::into_primitive),
            n,
        );
        wrap(record::<B, C, _>(
            PermuteBackward,
            &[&x],
            state,
            raw(output),
        ))
    }

    fn unpermute_rows(
        x: Tensor<Self, 2>,
        forward: &RowIndex<Self>,
        backward: &RowIndex<Self>,
        weights: Tensor<Self, 2>,
    ) -> Tensor<Self, 2> {
        let [n, hidden] = x.dims();
        let [tokens, k] = weights.dims();
        let (x, weights) = (raw(x), raw(weights));
        let (forward, backward) = (to_inner::<B, C>(forward), to_inner::<B, C>(backward));
        let rows = B::permute_rows(inner(&x), &forward, &backward).reshape([tokens, k, hidden]);
        let output = weighted_sum(rows.clone(), inner(&weights));
        let state = UnpermuteState {
            rows: raw(rows),
            weights: weights.primitive.clone(),
            inverse: backward.rows.into_primitive(),
            zero: backward.zero.map(Tensor::into_primitive),
            n,
        };
        wrap(record::<B, C, _>(
            UnpermuteBackward,
            &[&x, &weights],
            state,
            raw(output),
        ))
    }

    fn invert_rows(rows: Tensor<Self, 1, Int>, n: usize) -> Tensor<Self, 1, Int> {
        let rows = Tensor::<B, 1, Int>::from_primitive(rows.into_primitive());
        Tensor::from_primitive(B::invert_rows(rows, n).into_primitive())
    }
}

/// The inner backend's tensors of an index (integer and bool tensors are the same there).
fn to_inner<B: Backend, C: CheckpointStrategy>(index: &RowIndex<Autodiff<B, C>>) -> RowIndex<B> {
    RowIndex {
        rows: Tensor::from_primitive(index.rows.clone().into_primitive()),
        zero: index
            .zero
            .clone()
            .map(|zero| Tensor::from_primitive(zero.into_primitive())),
    }
}

/// The backward of [`permute_rows`]: [`PermuteOps::sum_gathered_rows`] through the inverse. Its parent
/// is the source.
#[derive(Debug)]
struct PermuteBackward;

impl<B: PermuteOps> BackwardStep<B> for PermuteBackward {
    /// The inverse's rows and zero rows, and the source's row count.
    type State = (IntTensor<B>, Option<BoolTensor<B>>, usize);

    fn backward(
        self,
        grad: FloatTensor<B>,
        (rows, zero, n): <Self as BackwardStep<B>>::State,
        parents: &[Option<NodeId>],
        grads: &mut Gradients,
    ) {
        register(grads, parent(parents, 0), || {
            let inverse = RowIndex::<B> {
                rows: Tensor::from_primitive(rows),
                zero: zero.map(Tensor::from_primitive),
            };
            B::sum_gathered_rows(wrap::<B, 2>(grad), &inverse, n)
        });
    }
}

/// What the backward of [`unpermute_rows`] keeps.
#[derive(Debug, Clone)]
struct UnpermuteState<B: Backend> {
    /// `[tokens, k, hidden]`: the rows gathered.
    rows: FloatTensor<B>,
    /// `[tokens, k]`: the weights.
    weights: FloatTensor<B>,
    /// The inverse's rows and zero rows.
    inverse: IntTensor<B>,
    zero: Option<BoolTensor<B>>,
    /// The source's rows.
    n: usize,
}

/// The backward of [`unpermute_rows`]: `d_rows = dy ⊗ weights` gathered through the inverse,
/// `d_weights = Σ_hidden dy · rows`. Its parents are `[x, weights]`.
#[derive(Debug)]
struct UnpermuteBackward;

impl<B: PermuteOps> BackwardStep<B> for UnpermuteBackward {
    type State = UnpermuteState<B>;

    fn backward(
        self,
        grad: FloatTensor<B>,
        state: <Self as BackwardStep<B>>::State,
        parents: &[Option<NodeId>],
        grads: &mut Gradients,
    ) {
        let rows = wrap::<B, 3>(state.rows);
        let [tokens, k, hidden] = rows.dims();
        let dy = wrap::<B, 2>(grad);
        let weights = wrap::<B, 2>(state.weights);
        register(grads, parent(parents, 0), || {
            let inverse = RowIndex::<B> {
                rows: Tensor::from_primitive(state.inverse),
                zero: state.zero.map(Tensor::from_primitive),
            };
            debug_assert_eq!(inverse.len(), state.n);
            B::unpermute_input_gradient(dy.clone(), weights.clone(), &inverse)
        });
        let dy = dy.reshape([tokens, 1, hidden]);
        register(grads, parent(parents, 1), || {
            (dy * rows).sum_dim(2).reshape([tokens, k])
        });
    }
}

/// CubeCL backends: the row moves as one kernel each (`burn_megatron_kernels::fused::
/// row_gather`: a cube a row, 16-byte vectors, sums in f32), f64 by the compositions; the
/// inverse by a thread an index (`fused::row_inverse`).
#[cfg(feature = "fused")]
mod cube {
    use burn::tensor::{DType, Int, Tensor};
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use burn_megatron_kernels::fused::row_gather::{RowWeights, row_gather};
    use burn_megatron_kernels::fused::row_inverse::row_inverse;

    use super::{
        PermuteOps, RowIndex, gather_rows, gather_rows_summed, unpermute_composition,
        unpermute_input_gradient_composition,
    };
    use crate::ops::primitive::{raw, wrap};

    /// The kernel's index and zero flags.
    fn index<B: burn::tensor::backend::Backend>(
        index: &RowIndex<B>,
    ) -> (
        burn::tensor::ops::IntTensor<B>,
        Option<burn::tensor::ops::BoolTensor<B>>,
    ) {
        (
            index.rows.clone().into_primitive(),
            index.zero.clone().map(Tensor::into_primitive),
        )
    }

    impl<R, F, I, BT> PermuteOps for CubeBackend<R, F, I, BT>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        fn permute_rows(
            x: Tensor<Self, 2>,
            forward: &RowIndex<Self>,
            _backward: &RowIndex<Self>,
        ) -> Tensor<Self, 2> {
            if x.dtype() == DType::F64 {
                return gather_rows(x, forward);
            }
            let (rows, zero) = index(forward);
            wrap(row_gather(raw(x), rows, zero, RowWeights::None, 1))
        }

        fn unpermute_rows(
            x: Tensor<Self, 2>,
            forward: &RowIndex<Self>,
            _backward: &RowIndex<Self>,
            weights: Tensor<Self, 2>,
        ) -> Tensor<Self, 2> {
            if x.dtype() == DType::F64 || weights.dtype() != x.dtype() {
                return unpermute_composition(x, forward, weights);
            }
            let k = weights.dims()[1];
            let (rows, zero) = index(forward);
            wrap(row_gather(
                raw(x),
                rows,
                zero,
                RowWeights::ByOutput(raw(weights)),
                k,
            ))
        }

        fn sum_gathered_rows(
            dy: Tensor<Self, 2>,
            inverse: &RowIndex<Self>,
            n: usize,
        ) -> Tensor<Self, 2> {
            if dy.dtype() == DType::F64 || n == 0 {
                return gather_rows_summed(dy, inverse, n);
            }
            let c = inverse.len() / n;
            let (rows, zero) = index(inverse);
            wrap(row_gather(raw(dy), rows, zero, RowWeights::None, c))
        }

        fn unpermute_input_gradient(
            dy: Tensor<Self, 2>,
            weights: Tensor<Self, 2>,
            inverse: &RowIndex<Self>,
        ) -> Tensor<Self, 2> {
            if dy.dtype() == DType::F64 || weights.dtype() != dy.dtype() {
                return unpermute_input_gradient_composition(dy, weights, inverse);
            }
            let (rows, zero) = index(inverse);
            wrap(row_gather(
                raw(dy),
                rows,
                zero,
                RowWeights::ByIndex(raw(weights)),
                1,
            ))
        }

        fn invert_rows(rows: Tensor<Self, 1, Int>, n: usize) -> Tensor<Self, 1, Int> {
            Tensor::from_primitive(row_inverse(rows.into_primitive(), n))
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::{Int, Tensor, TensorData};
    use burn_megatron_testing::{assert_close, tolerance, values};

    use super::{PermuteOps, RowIndex, permute_rows, unpermute_rows};
    use crate::init::{InitDistribution, init_full};
    use crate::ops::embedding::gather_rows_or_zero;

    type AD = Autodiff<NdArray>;

    fn ints(values: &[i64]) -> Tensor<AD, 1, Int> {
        Tensor::from_data(
            TensorData::new(values.to_vec(), [values.len()]),
            &Default::default(),
        )
    }

    /// The inverse of an index with a skipped entry (past the end) and a row nobody names.
    #[test]
    fn invert_rows_inverts_and_skips_indices_past_the_end() {
        let inverse = AD::invert_rows(ints(&[3, 0, 6, 4, 1]), 6);
        let got: Vec<i64> = inverse.into_data().convert::<i64>().to_vec().unwrap();
        assert_eq!(got, [1, 4, 0, 0, 3, 0]);
    }

    /// Each token's `c = 2` copies gathered (one of token 1's missing) and a zero row, against the row gather through
    /// Burn's autodiff (`gather_rows_or_zero`, its dropped index past the table): output and
    /// the source's gradient.
    #[test]
    fn permute_rows_equals_the_row_gather_and_its_gradient() {
        let device = Default::default();
        let (n, hidden) = (4, 3);
        // Output rows: 7 copies of 4 tokens, token t's at rows `readers[t]`, and a zero row 7.
        let readers: [[Option<usize>; 2]; 4] = [
            [Some(2), Some(5)],
            [Some(0), None],
            [Some(6), Some(1)],
            [Some(3), Some(4)],
        ];
        let mut forward = vec![None; 8];
        for (t, pair) in readers.iter().enumerate() {
            for row in pair.iter().flatten() {
                forward[*row] = Some(t);
            }
        }
        let backward: Vec<Option<usize>> = readers.iter().flatten().copied().collect();
        let x = init_full::<AD, 2>(
            [n, hidden],
            InitDistribution::Normal { std: 1.0 },
            1,
            &device,
        );
        let probe = init_full::<AD, 2>(
            [8, hidden],
            InitDistribution::Normal { std: 1.0 },
            2,
            &device,
        );
        let run = |ours: bool| {
            let x = x.clone().require_grad();
            let y = match ours {
                true => permute_rows(
                    x.clone(),
                    &RowIndex::from_host(&forward, &device),
                    &RowIndex::from_host(&backward, &device),
                ),
                false => {
                    let rows: Vec<i64> = forward.iter().map(|r| r.unwrap_or(n) as i64).collect();
                    gather_rows_or_zero(x.clone(), ints(&rows))
                }
            };
            let grads = (y.clone() * probe.clone()).sum().backward();
            [values(y.inner()), values(x.grad(&grads).unwrap())]
        };
        let [ours, reference] = [run(true), run(false)];
        assert_close("output", &ours[0], &reference[0], 0.0);
        assert_close("dx", &ours[1], &reference[1], tolerance::F32_SAME_ORDER);
    }

    /// 3 tokens' 2 rows each (one a zero row) from 6 rows (one never read), weighted and
    /// summed, against Burn's autodiff of the same gather, product and sum: output, and the
    /// gradients of the rows and of the weights.
    #[test]
    fn unpermute_rows_equals_the_weighted_gather_and_its_gradients() {
        let device = Default::default();
        let (tokens, k, n, hidden) = (3, 2, 6, 4);
        let forward = [Some(4), Some(0), None, Some(5), Some(2), Some(1)];
        let mut backward = vec![None; n];
        for (a, row) in forward.iter().enumerate() {
            if let Some(row) = row {
                backward[*row] = Some(a);
            }
        }
        let normal = |shape: [usize; 2], seed| {
            init_full::<AD, 2>(shape, InitDistribution::Normal { std: 1.0 }, seed, &device)
        };
        let (x, w, probe) = (
            normal([n, hidden], 3),
            normal([tokens, k], 4),
            normal([tokens, hidden], 5),
        );
        let run = |ours: bool| {
            let (x, w) = (x.clone().require_grad(), w.clone().require_grad());
            let y = match ours {
                true => unpermute_rows(
                    x.clone(),
                    &RowIndex::from_host(&forward, &device),
                    &RowIndex::from_host(&backward, &device),
                    w.clone(),
                ),
                false => {
                    let rows: Vec<i64> = forward.iter().map(|r| r.unwrap_or(n) as i64).collect();
                    let rows = gather_rows_or_zero(x.clone(), ints(&rows));
                    (rows.reshape([tokens, k, hidden]) * w.clone().unsqueeze_dim::<3>(2))
                        .sum_dim(1)
                        .reshape([tokens, hidden])
                }
            };
            let grads = (y.clone() * probe.clone()).sum().backward();
            [
                values(y.inner()),
                values(x.grad(&grads).unwrap()),
                values(w.grad(&grads).unwrap()),
            ]
        };
        let [ours, reference] = [run(true), run(false)];
        assert_close("output", &ours[0], &reference[0], 0.0);
        assert_close("dx", &ours[1], &reference[1], tolerance::F32_SAME_ORDER);
        assert_close("dw", &ours[2], &reference[2], tolerance::F32_SAME_ORDER);
    }
}
