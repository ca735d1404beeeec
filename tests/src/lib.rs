//! Cross-crate tests: integration tests live in tests/tests/; the collective test bodies
//! shared by CPU, process and GPU runs live here.

pub mod collective_suite;

use burn::tensor::TensorData;

/// max |a - b| / max |b|: the relative difference of two tensors, as every GPU comparison
/// reports it.
pub fn max_relative_difference(ours: &TensorData, reference: &TensorData) -> f32 {
    assert_eq!(ours.shape, reference.shape, "shapes differ");
    let a: Vec<f32> = ours.clone().convert::<f32>().to_vec().unwrap();
    let b: Vec<f32> = reference.clone().convert::<f32>().to_vec().unwrap();
    let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    a.iter()
        .zip(&b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}
