//! The router's top-k: the columns of each row's `k` largest scores, best first.
//!
//! The composition is `k` rounds of an arg-max, a comparison and a masked fill, then a
//! concatenation: about `4k` small launches a router, which the host must issue one after
//! another (an MoE step at top-6 spent more of its time waiting for them than running them).
//! CubeCL backends run one kernel instead (`burn_megatron_kernels::fused::top_k`), a thread
//! a row. Indices have no gradient, so `Autodiff<B>` runs the inner backend's.
//!
//! Both give the same columns wherever a row has no NaN and at least `k` scores above −∞: the
//! larger score first, of equal scores the lower column. The kernel always gives `k` distinct
//! columns (a NaN counts as below every number, −∞ included). The composition masks a taken
//! column to −∞, so in a row with fewer than `k` finite scores it may take one twice, and with
//! NaN it follows its backend's arg-max; the dispatcher clamps and tolerates both. The router
//! never asks for more columns than a token may choose (group-limited routing checks it).

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;

use super::autodiff::inner;
use super::primitive::raw;

/// The top-k columns of each row.
pub trait TopKOps: Backend {
    /// The columns of the `k` largest values of each row of `scores`, best first, ties to
    /// the lower column. Needs `1 ≤ k ≤ columns` ([`top_k_indices`] checks it).
    ///
    /// # Shapes
    /// - scores: `[rows, columns]`
    /// - output: `[rows, k]`, each in `0..columns`
    fn top_k_indices(scores: Tensor<Self, 2>, k: usize) -> Tensor<Self, 2, Int> {
        top_k_composition(scores, k)
    }
}

/// [`TopKOps::top_k_indices`] after checking `k`.
///
/// # Panics
/// If `k` is 0 or more than the columns.
pub fn top_k_indices<B: TopKOps>(scores: Tensor<B, 2>, k: usize) -> Tensor<B, 2, Int> {
    let [_, columns] = scores.dims();
    assert!(
        k >= 1 && k <= columns,
        "top_k_indices: k = {k} of {columns} columns"
    );
    B::top_k_indices(scores, k)
}

/// [`TopKOps::top_k_indices`] as `k` rounds of Burn's arg-max, each taken column masked to
/// −∞ before the next (Burn's `topk_with_indices` sorts, which CubeCL does on the host). The
/// result is clamped into `0..columns` once, at the end: CubeCL's arg-max returns `u32::MAX`
/// (`-1` as i32) for a row without a largest value (NaN scores), which masks nothing, and the
/// indices address buffers.
pub fn top_k_composition<B: Backend>(mut scores: Tensor<B, 2>, k: usize) -> Tensor<B, 2, Int> {
    let [rows, columns] = scores.dims();
    let indices = Tensor::<B, 1, Int>::arange(0..columns as i64, &scores.device())
        .reshape([1, columns])
        .expand([rows, columns]);
    let mut chosen = Vec::with_capacity(k);
    for j in 0..k {
        let best = scores.clone().argmax(1);
        if j + 1 < k {
            let taken = indices.clone().equal(best.clone().expand([rows, columns]));
            scores = scores.mask_fill(taken, f32::NEG_INFINITY);
        }
        chosen.push(best);
    }
    let chosen = match k {
        1 => chosen.remove(0),
        _ => Tensor::cat(chosen, 1),
    };
    chosen.clamp(0, columns as i64 - 1)
}

/// Indices have no gradient: the inner backend's top-k on the scores' values.
impl<B: TopKOps, C: CheckpointStrategy> TopKOps for Autodiff<B, C> {
    fn top_k_indices(scores: Tensor<Self, 2>, k: usize) -> Tensor<Self, 2, Int> {
        let scores = inner::<B, 2>(&raw(scores));
        Tensor::from_primitive(B::top_k_indices(scores, k).into_primitive())
    }
}

/// CubeCL backends: one thread a row (f64 scores: the composition, whose ties the kernel's
/// f32 comparison could break differently).
#[cfg(feature = "fused")]
mod cube {
    use burn::tensor::{DType, Int, Tensor};
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use burn_megatron_kernels::fused::top_k as kernels;

    use super::{TopKOps, top_k_composition};
    use crate::ops::primitive::raw;

    impl<R, F, I, BT> TopKOps for CubeBackend<R, F, I, BT>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        fn top_k_indices(scores: Tensor<Self, 2>, k: usize) -> Tensor<Self, 2, Int> {
            if scores.dtype() == DType::F64 {
                return top_k_composition(scores, k);
            }
            Tensor::from_primitive(kernels::top_k(raw(scores), k, I::dtype()))
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::{Int, Tensor, TensorData};

    use super::top_k_indices;

    type AD = Autodiff<NdArray>;

    fn ints(t: Tensor<AD, 2, Int>) -> Vec<i64> {
        t.into_data().convert::<i64>().to_vec::<i64>().unwrap()
    }

    #[test]
    fn top_k_takes_the_largest_first_and_ties_to_the_lower_column() {
        let scores = Tensor::<AD, 2>::from_data(
            TensorData::new(
                vec![
                    0.5f32,
                    2.0,
                    0.5,
                    -1.0, // 2.0, then the tie 0.5 at 0 before 2
                    f32::NEG_INFINITY,
                    -2.0,
                    f32::NEG_INFINITY,
                    -3.0, // −∞ last, lower first
                ],
                [2, 4],
            ),
            &Default::default(),
        )
        .require_grad();
        assert_eq!(ints(top_k_indices(scores.clone(), 3)), [1, 0, 2, 1, 3, 0]);
        assert_eq!(ints(top_k_indices(scores, 1)), [1, 1]);
    }

    #[test]
    #[should_panic(expected = "k = 5 of 4 columns")]
    fn top_k_refuses_more_than_the_columns() {
        let scores = Tensor::<AD, 2>::zeros([2, 4], &Default::default());
        let _ = top_k_indices(scores, 5);
    }
}
