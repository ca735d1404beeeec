//! The router's top-k kernel against the arg-max composition: ties, −∞ scores (group-limited
//! routing's masked experts), strided scores, ragged row counts, f16, and rows of NaN.

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_megatron::ops::TopKOps;
use burn_megatron::ops::top_k::top_k_composition;

use crate::helpers::{W, random};

fn ints(t: Tensor<W, 2, Int>) -> Vec<i64> {
    t.into_data().convert::<i64>().to_vec::<i64>().unwrap()
}

/// Scores rounded to a coarse grid, so that many rows hold ties, and a few −∞.
fn scores(rows: usize, columns: usize, seed: u64, device: &WgpuDevice) -> Tensor<W, 2> {
    let values: Vec<f32> = random(rows * columns, seed, 2.0)
        .into_iter()
        .enumerate()
        .map(|(i, v)| match i % 17 {
            3 => f32::NEG_INFINITY,
            _ => (v * 4.0).round() / 4.0,
        })
        .collect();
    Tensor::from_data(TensorData::new(values, [rows, columns]), device)
}

#[test]
fn top_k_kernel_equals_the_arg_max_rounds() {
    let device = WgpuDevice::default();
    for (rows, columns, k) in [
        (1, 8, 2),
        (300, 64, 6),
        (129, 16, 1),
        (70, 64, 8),
        (5, 6, 5),
    ] {
        let s = scores(rows, columns, rows as u64, &device);
        assert_eq!(s.to_data().dtype, DType::F32);
        let expected = ints(top_k_composition(s.clone(), k));
        let got = ints(W::top_k_indices(s.clone(), k));
        assert_eq!(got, expected, "{rows}x{columns}, k = {k}");
        // The same from a transposed view (strided rows), and in f16 (lavapipe has no bf16), whose grid holds the
        // scores exactly.
        let values = s.to_data().convert::<f32>().to_vec::<f32>().unwrap();
        let transposed: Vec<f32> = (0..columns * rows)
            .map(|i| values[(i % rows) * columns + i / rows])
            .collect();
        let strided =
            Tensor::<W, 2>::from_data(TensorData::new(transposed, [columns, rows]), &device)
                .transpose();
        assert_eq!(ints(W::top_k_indices(strided, k)), expected, "strided");
        let half = s.cast(DType::F16);
        assert_eq!(ints(W::top_k_indices(half, k)), expected, "f16");
    }
}

#[test]
fn top_k_kernel_gives_distinct_columns_for_rows_of_nan() {
    let device = WgpuDevice::default();
    let mut values = vec![f32::NAN; 3 * 8];
    // Row 1: two numbers among NaNs; row 2: all −∞ but one NaN.
    values[8 + 5] = 1.0;
    values[8 + 2] = -3.0;
    for v in &mut values[16..24] {
        *v = f32::NEG_INFINITY;
    }
    values[16 + 1] = f32::NAN;
    let s = Tensor::<W, 2>::from_data(TensorData::new(values, [3, 8]), &device);
    assert_eq!(
        ints(W::top_k_indices(s, 3)),
        [0, 1, 2, 5, 2, 0, 0, 2, 3],
        "NaN ranks below every number, −∞ included; ties to the lower column"
    );
}
