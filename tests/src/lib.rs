//! Cross-crate tests: integration tests live in tests/tests/; the collective test bodies
//! shared by CPU, process and GPU runs live here.

pub mod collective_suite;

use burn::tensor::TensorData;

/// max |a - b| / max |b|: the relative difference of two tensors, as every GPU comparison
/// reports it.
pub fn max_relative_difference(ours: &TensorData, reference: &TensorData) -> f32 {
    assert_eq!(ours.shape, reference.shape, "shapes differ");
    relative_difference(&as_f32(ours), &as_f32(reference))
}

/// max |a - b| / max |b| of two equally long runs of values.
pub fn relative_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// The values of a tensor as f32.
pub fn as_f32(data: &TensorData) -> Vec<f32> {
    data.clone().convert::<f32>().to_vec().unwrap()
}
