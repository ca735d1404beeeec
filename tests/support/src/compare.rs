//! Comparisons that cannot be fooled by NaN.
//!
//! A fold with `f32::max` drops NaN (`max(x, NaN) == x`), so a helper built on it lets a NaN
//! result pass every test. Here every value of both operands is checked first: any NaN or
//! infinity fails the comparison, naming the tensor and the flat index.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

/// The values of a tensor (any float dtype) as f64, row-major.
pub fn values<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Vec<f64> {
    data_values(&tensor.into_data())
}

/// The values of a tensor as f32, for exact comparisons (`assert_eq!` fails on NaN, as
/// `NaN != NaN`): collectives and copies move values without arithmetic.
pub fn values_f32<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Vec<f32> {
    tensor
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("converted data holds f32")
}

/// The values of tensor data (any float dtype) as f64, row-major.
pub fn data_values(data: &TensorData) -> Vec<f64> {
    data.clone()
        .convert::<f64>()
        .to_vec::<f64>()
        .expect("converted data holds f64")
}

/// `max |got - want| / max |want|` (the denominator at least `f64::MIN_POSITIVE`): the
/// relative difference of two whole tensors.
///
/// Panics, naming `name` and the index, if the lengths differ or either side holds a NaN or
/// an infinity.
pub fn relative_difference(name: &str, got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(
        got.len(),
        want.len(),
        "{name}: compared tensors differ in size ({} vs {})",
        got.len(),
        want.len()
    );
    for (side, list) in [("got", got), ("want", want)] {
        if let Some(i) = list.iter().position(|v| !v.is_finite()) {
            panic!(
                "{name}: {side}[{i}] is {} (every compared value must be finite)",
                list[i]
            );
        }
    }
    let scale = want.iter().fold(
        f64::MIN_POSITIVE,
        |m, v| if v.abs() > m { v.abs() } else { m },
    );
    let diff = got.iter().zip(want).fold(
        0.0f64,
        |m, (a, b)| if (a - b).abs() > m { (a - b).abs() } else { m },
    );
    diff / scale
}

/// Fails unless [`relative_difference`] of `got` and `want` is at most `tolerance` (see
/// [`tolerance`](crate::tolerance)); returns the difference.
pub fn assert_close(name: &str, got: &[f64], want: &[f64], tolerance: f64) -> f64 {
    let diff = relative_difference(name, got, want);
    assert!(
        diff <= tolerance,
        "{name}: relative difference {diff:.3e} exceeds {tolerance:.1e}"
    );
    diff
}

/// Fails unless every value of `got` is finite and at most `bound` in magnitude (a result that
/// must be exactly zero, up to rounding): a NaN or an infinity fails, naming `name` and the
/// index, where a fold with `f64::max` would drop it. Returns the largest magnitude.
pub fn assert_near_zero(name: &str, got: &[f64], bound: f64) -> f64 {
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!(
            "{name}: got[{i}] is {} (every compared value must be finite)",
            got[i]
        );
    }
    let largest = got.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    assert!(
        largest <= bound,
        "{name}: {largest:.3e} where 0 is exact (bound {bound:.1e})"
    );
    largest
}

/// `got` and `want`, lists of `(name, value)` (gradients by parameter path, results by op),
/// paired by position after checking that both hold the same names in the same order: a
/// missing, extra or reordered entry fails, naming `what`, where a bare `zip` would drop it.
pub fn paired<'a, N, T>(
    what: &str,
    got: &'a [(N, T)],
    want: &'a [(N, T)],
) -> Vec<(&'a str, &'a T, &'a T)>
where
    N: AsRef<str>,
{
    let names = |list: &'a [(N, T)]| list.iter().map(|(n, _)| n.as_ref()).collect::<Vec<_>>();
    assert_eq!(
        names(got),
        names(want),
        "{what}: the compared lists differ in their entries"
    );
    got.iter()
        .zip(want)
        .map(|((name, a), (_, b))| (name.as_ref(), a, b))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_values_have_no_difference() {
        assert_eq!(relative_difference("x", &[1.0, -2.0], &[1.0, -2.0]), 0.0);
        assert_eq!(relative_difference("zeros", &[0.0; 3], &[0.0; 3]), 0.0);
    }

    #[test]
    fn the_difference_is_relative_to_the_largest_reference_value() {
        let diff = relative_difference("x", &[1.0, 4.1], &[1.0, 4.0]);
        assert!((diff - 0.1 / 4.0).abs() < 1e-12, "{diff}");
    }

    /// The mutation test: the old helper (a fold with `f32::max`) returned 0 here.
    #[test]
    #[should_panic(expected = "grad: got[1] is NaN")]
    fn a_nan_result_fails() {
        relative_difference("grad", &[1.0, f64::NAN, 3.0], &[1.0, 2.0, 3.0]);
    }

    #[test]
    #[should_panic(expected = "logits: want[0] is NaN")]
    fn a_nan_reference_fails() {
        relative_difference("logits", &[1.0], &[f64::NAN]);
    }

    #[test]
    #[should_panic(expected = "loss: got[0] is inf")]
    fn an_infinite_result_fails() {
        relative_difference("loss", &[f64::INFINITY], &[1.0]);
    }

    #[test]
    #[should_panic(expected = "differ in size")]
    fn different_lengths_fail() {
        relative_difference("x", &[1.0], &[1.0, 2.0]);
    }

    #[test]
    #[should_panic(expected = "exceeds")]
    fn a_difference_above_the_tolerance_fails() {
        assert_close("x", &[1.1], &[1.0], crate::tolerance::F32);
    }

    #[test]
    #[should_panic(expected = "dq: got[1] is NaN")]
    fn a_nan_where_zero_is_exact_fails() {
        assert_near_zero("dq", &[0.0, f64::NAN], 1e-6);
    }

    #[test]
    #[should_panic(expected = "where 0 is exact")]
    fn a_value_above_the_zero_bound_fails() {
        assert_near_zero("dk", &[0.0, -1e-3], 1e-6);
    }

    #[test]
    fn values_near_zero_pass() {
        assert_eq!(assert_near_zero("dk", &[0.0, -1e-7], 1e-6), 1e-7);
    }

    #[test]
    #[should_panic(expected = "differ in their entries")]
    fn a_missing_entry_fails() {
        let got = [("a", 1.0), ("b", 2.0)];
        let want = [("a", 1.0), ("b", 2.0), ("c", 3.0)];
        paired("grads", &got, &want);
    }

    #[test]
    #[should_panic(expected = "differ in their entries")]
    fn a_renamed_entry_fails() {
        paired("grads", &[("a", 1.0)], &[("b", 1.0)]);
    }

    #[test]
    fn paired_entries_keep_their_order() {
        let got = [("a".to_string(), 1), ("b".to_string(), 2)];
        let want = [("a".to_string(), 3), ("b".to_string(), 4)];
        assert_eq!(paired("x", &got, &want), [("a", &1, &3), ("b", &2, &4)]);
    }

    /// A NaN poisoned into one element of a real tensor (as a broken kernel would leave it)
    /// is caught through `values` too.
    #[test]
    #[should_panic(expected = "poisoned: got[5] is NaN")]
    fn a_nan_inside_a_tensor_fails() {
        use burn::backend::NdArray;
        let device = Default::default();
        let want = Tensor::<NdArray, 2>::ones([3, 4], &device);
        let mut poisoned = vec![1.0f32; 12];
        poisoned[5] = f32::NAN;
        let got = Tensor::<NdArray, 2>::from_data(TensorData::new(poisoned, [3, 4]), &device);
        relative_difference("poisoned", &values(got), &values(want));
    }
}
