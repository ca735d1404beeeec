//! The column sums: the bias gradient and every layout of the two stages.

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{DType, Tensor};
use burn_megatron::ops::BiasOps;
use burn_megatron_testing::{assert_close, tolerance, values, values_f32};

use crate::helpers::{W, matrix, raw, vector, wrap};

/// `BiasOps::bias_gradient` (the two-stage column sums) against exact f64 sums of the
/// stored values, for f32 and f16 `dy`: no rows, one row, row counts that are not multiples
/// of the 32-row blocks or that need more than 512 blocks, strided views read element by
/// element and packed rows read as vectors. Every element of the output is first poisoned
/// with NaN, and two runs give the same bits.
#[test]
fn bias_gradient_equals_exact_sums_and_is_deterministic() {
    use burn_megatron_kernels::fused::column_sum;
    let device = WgpuDevice::default();
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        // (rows, columns, extra columns the view leaves out)
        for (rows, cols, extra) in [
            (0, 8, 0),
            (1, 1, 0),
            (70, 300, 0),
            (70, 300, 3),
            (33, 7, 1),
            (17_000, 12, 0),
        ] {
            let name = format!("{dtype:?} {rows}x{cols} (+{extra})");
            let dy = matrix(rows, cols + extra, 61, 2.0, &device)
                .cast(dtype)
                .narrow(1, 0, cols);
            let stored = values(dy.clone());
            let mut exact = vec![0.0f64; cols];
            for (i, v) in stored.iter().enumerate() {
                exact[i % cols] += v;
            }
            let got = W::bias_gradient(dy.clone());
            // (Burn's cast of an empty tensor keeps its dtype.)
            assert_eq!(got.dtype(), dy.dtype(), "{name}");
            let poisoned = raw(Tensor::<W, 1>::full([cols], f32::NAN, &device).cast(dy.dtype()));
            assert_close(
                &format!("bias gradient {name}"),
                &values(got.clone().cast(DType::F32)),
                &exact,
                bound,
            );
            column_sum::column_sums_into(raw(dy), None, Some(poisoned.clone()), None);
            let bits = |t: Tensor<W, 1>| -> Vec<u32> {
                values_f32(t.cast(DType::F32))
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            assert_eq!(
                bits(wrap(poisoned)),
                bits(got),
                "{name}: a second run into a poisoned buffer gives other bits"
            );
        }
    }
}

/// `dscale` and `dshift` come from a fixed-order two-stage sum, not atomics: two runs on the
/// same inputs give the same bits (1000 rows: 32 blocks of partial sums).
/// Every shape of the column sums' two stages (`ColumnSumLayout`: row lanes, loads in flight,
/// block sizes, second-stage lanes, CubeCL's bounds checks; `kernel_bench column_sum_layouts`
/// picks the default among them) gives the exact sums of `dy` and of `dy · x̂`, on strided views, with blocks that end
/// inside a group of loads, with columns past the last cube's, and with no rows.
#[test]
fn column_sum_layouts_all_give_the_exact_sums() {
    use burn_megatron_kernels::fused::column_sum::{
        ColumnSumLayout, Normalised, column_sums_into_with,
    };
    let device = WgpuDevice::default();
    let layouts = [
        ColumnSumLayout::default(),
        ColumnSumLayout {
            checked: false,
            ..ColumnSumLayout::default()
        },
        ColumnSumLayout {
            column_vectors: 32,
            row_lanes: 8,
            loads_in_flight: 4,
            min_rows_per_block: 8,
            max_blocks: 512,
            total_columns: 16,
            total_lanes: 16,
            checked: true,
        },
        ColumnSumLayout {
            column_vectors: 64,
            row_lanes: 4,
            loads_in_flight: 2,
            min_rows_per_block: 128,
            max_blocks: 4,
            total_columns: 4,
            total_lanes: 64,
            checked: false,
        },
        ColumnSumLayout {
            column_vectors: 16,
            row_lanes: 2,
            loads_in_flight: 3,
            min_rows_per_block: 7,
            max_blocks: 512,
            total_columns: 32,
            total_lanes: 8,
            checked: false,
        },
    ];
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        for (rows, cols, extra) in [(0, 8, 0), (1, 1, 0), (70, 300, 3), (1000, 260, 0)] {
            let dy = matrix(rows, cols + extra, 62, 2.0, &device)
                .cast(dtype)
                .narrow(1, 0, cols);
            let x = matrix(rows, cols, 63, 3.0, &device).cast(dtype);
            let mean = vector(rows, 64, 0.5, &device);
            let rstd = vector(rows, 65, 1.5, &device);
            let (dy_v, x_v) = (values(dy.clone()), values(x.clone()));
            let (mean_v, rstd_v) = (values(mean.clone()), values(rstd.clone()));
            let mut exact_dy = vec![0.0f64; cols];
            let mut exact_dyx = vec![0.0f64; cols];
            for (i, g) in dy_v.iter().enumerate() {
                let (row, col) = (i / cols, i % cols);
                exact_dy[col] += g;
                exact_dyx[col] += g * (x_v[i] - mean_v[row]) * rstd_v[row];
            }
            for (l, layout) in layouts.iter().enumerate() {
                let name = format!("{dtype:?} {rows}x{cols} (+{extra}) layout {l}");
                let poisoned = || raw(Tensor::<W, 1>::full([cols], f32::NAN, &device));
                let (sum_dy, sum_dyx) = (poisoned(), poisoned());
                let normalised = Normalised {
                    x: raw(x.clone()),
                    mean: raw(mean.clone()),
                    rstd: raw(rstd.clone()),
                    centred: true,
                };
                column_sums_into_with(
                    *layout,
                    raw(dy.clone()),
                    Some(normalised),
                    Some(sum_dy.clone()),
                    Some(sum_dyx.clone()),
                );
                assert_close(
                    &format!("Σ dy {name}"),
                    &values(wrap::<1>(sum_dy)),
                    &exact_dy,
                    bound,
                );
                assert_close(
                    &format!("Σ dy·x̂ {name}"),
                    &values(wrap::<1>(sum_dyx)),
                    &exact_dyx,
                    bound,
                );
            }
        }
    }
}
