//! The MoE dispatcher's row moves (`PermuteOps` on CubeCL: one row-gather kernel each) against
//! their Burn compositions: the permute's gather with zero rows, the weighted combine of `k`
//! rows, the backward sums over `c` readers, and the combine's input gradient; in f32
//! (products in the same order: equal to rounding) and in f16 for the plain gather (a copy:
//! bit for bit), on a strided source; and the inverse of an index (a thread an index) against
//! Burn's scatter.

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{Bool, DType, Int, Tensor, TensorData};
use burn_megatron::ops::permute::{
    gather_rows, gather_rows_summed, invert_rows_composition, unpermute_composition,
};
use burn_megatron::ops::{PermuteOps, RowIndex};
use burn_megatron_testing::{assert_close, tolerance, values};

use crate::helpers::{W, random};

const HIDDEN: usize = 24;

fn matrix(rows: usize, seed: u64, device: &WgpuDevice) -> Tensor<W, 2> {
    Tensor::from_data(
        TensorData::new(random(rows * HIDDEN, seed, 1.0), [rows, HIDDEN]),
        device,
    )
}

/// An index of `len` rows into `n` source rows, every fifth a zero row (its index still in
/// range, as the dispatcher's are).
fn index(len: usize, n: usize, device: &WgpuDevice) -> RowIndex<W> {
    let rows: Vec<i64> = (0..len).map(|i| ((i * 7 + 3) % n) as i64).collect();
    let zero: Vec<bool> = (0..len).map(|i| i % 5 == 4).collect();
    RowIndex::new(Tensor::<W, 1, Int>::from_data(
        TensorData::new(rows, [len]),
        device,
    ))
    .with_zero_rows(Tensor::<W, 1, Bool>::from_data(
        TensorData::new(zero, [len]),
        device,
    ))
}

#[test]
fn row_gather_kernels_equal_the_compositions() {
    let device = WgpuDevice::default();
    let (n, tokens, k) = (13, 9, 3);
    let x = matrix(n, 1, &device);
    assert_eq!(x.dtype(), DType::F32);
    let tol = tolerance::F32_SAME_ORDER;

    // The permute's gather, with and without zero rows.
    let forward = index(tokens * k, n, &device);
    let expected = values(gather_rows(x.clone(), &forward));
    assert_close(
        "permute",
        &values(W::permute_rows(x.clone(), &forward, &forward)),
        &expected,
        0.0,
    );
    let plain = RowIndex::new(forward.rows().clone());
    assert_close(
        "permute without zero rows",
        &values(W::permute_rows(x.clone(), &plain, &plain)),
        &values(gather_rows(x.clone(), &plain)),
        0.0,
    );

    // The weighted combine of each token's k rows.
    let weights = Tensor::<W, 2>::from_data(
        TensorData::new(random(tokens * k, 2, 1.0), [tokens, k]),
        &device,
    );
    assert_close(
        "unpermute",
        &values(W::unpermute_rows(
            x.clone(),
            &forward,
            &forward,
            weights.clone(),
        )),
        &values(unpermute_composition(x.clone(), &forward, weights.clone())),
        tol,
    );

    // The backward sums over c = 3 readers a row, and over one.
    let dy = matrix(tokens * k, 3, &device);
    let inverse = index(n * 3, tokens * k, &device);
    assert_close(
        "sum over readers",
        &values(W::sum_gathered_rows(dy.clone(), &inverse, n)),
        &values(gather_rows_summed(dy.clone(), &inverse, n)),
        tol,
    );

    // The combine's input gradient: dx[i] = weights[a] · dy[a / k], a = inverse[i].
    let dy = matrix(tokens, 4, &device);
    let inverse = index(n, tokens * k, &device);
    let d_rows = dy.clone().reshape([tokens, 1, HIDDEN]) * weights.clone().unsqueeze_dim::<3>(2);
    assert_close(
        "unpermute's input gradient",
        &values(W::unpermute_input_gradient(dy, weights, &inverse)),
        &values(gather_rows_summed(
            d_rows.reshape([tokens * k, HIDDEN]),
            &inverse,
            n,
        )),
        tol,
    );
}

#[test]
fn row_gather_copies_f16_rows_exactly_from_a_strided_source() {
    let device = WgpuDevice::default();
    let n = 11;
    let data = random(n * HIDDEN, 5, 1.0);
    let x = Tensor::<W, 2>::from_data(TensorData::new(data.clone(), [n, HIDDEN]), &device)
        .cast(DType::F16);
    // The same values stored column-major and viewed as rows: a column stride of n.
    let transposed: Vec<f32> = (0..n * HIDDEN)
        .map(|i| data[(i % n) * HIDDEN + i / n])
        .collect();
    let strided = Tensor::<W, 2>::from_data(TensorData::new(transposed, [HIDDEN, n]), &device)
        .cast(DType::F16)
        .transpose();
    let forward = index(17, n, &device);
    let expected = values(gather_rows(x, &forward));
    assert_close(
        "f16 permute",
        &values(W::permute_rows(strided.clone(), &forward, &forward)),
        &expected,
        0.0,
    );
}

#[test]
fn row_inverse_kernel_equals_the_scatter() {
    let device = WgpuDevice::default();
    // 40 distinct indices into 33 rows: 7 past the end (skipped), 0 rows never named.
    for (m, n) in [(40, 33), (5, 9), (300, 300)] {
        let rows: Vec<i64> = (0..m).map(|i| ((i * 17 + 5) % m) as i64).collect();
        let rows = Tensor::<W, 1, Int>::from_data(TensorData::new(rows, [m]), &device);
        let got = W::invert_rows(rows.clone(), n).into_data();
        let want = invert_rows_composition(rows, n).into_data();
        assert_eq!(
            got.convert::<i64>().to_vec::<i64>().unwrap(),
            want.convert::<i64>().to_vec::<i64>().unwrap(),
            "{m} indices into {n} rows"
        );
    }
}
