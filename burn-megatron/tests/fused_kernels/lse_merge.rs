//! Ring attention's merge of two partial results by log-sum-exp: the kernel against Burn's
//! composition.

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{DType, Tensor, TensorData};
use burn_megatron::ops::ring_flash_attention::lse_merge_composition;
use burn_megatron_kernels::fused::lse_merge::lse_merge;
use burn_megatron_testing::{assert_close, values};

use crate::helpers::{W, random, random_4d, raw, wrap};

/// `[batch, heads, len]` log-sum-exps around `offset`.
fn lse(shape: [usize; 3], seed: u64, offset: f32, device: &WgpuDevice) -> Tensor<W, 3> {
    let n = shape.iter().product();
    Tensor::<W, 3>::from_data(TensorData::new(random(n, seed, 4.0), shape), device)
        .add_scalar(offset)
}

/// The merged output and log-sum-exp equal the composition's (f32, 1e-6 relative), for
/// outputs in f32 and f16 (mixed too: the ring's first pair stays in q's dtype), head
/// dimensions read 4, 2 or 1 elements at a time, and log-sum-exps far apart (one side's
/// weight underflows to 0) as well as close.
#[test]
fn lse_merge_equals_the_composition() {
    let device = WgpuDevice::default();
    for (shape, dtypes, offset) in [
        ([2, 3, 5, 8], [DType::F32, DType::F32], 0.0),
        ([1, 4, 7, 6], [DType::F16, DType::F32], 1.5),
        ([2, 2, 3, 5], [DType::F16, DType::F16], -2.0),
        ([1, 2, 9, 16], [DType::F32, DType::F16], 120.0),
    ] {
        let name = format!("{shape:?} {dtypes:?} offset {offset}");
        let rows = [shape[0], shape[1], shape[2]];
        let out_a = random_4d(shape, 1, 2.0, dtypes[0], &device);
        let out_b = random_4d(shape, 2, 2.0, dtypes[1], &device);
        let lse_a = lse(rows, 3, 0.0, &device);
        let lse_b = lse(rows, 4, offset, &device);
        let (want_out, want_lse) = lse_merge_composition(
            (out_a.clone(), lse_a.clone()),
            (out_b.clone(), lse_b.clone()),
            DType::F32,
        );
        let (out, merged) = lse_merge(
            (raw(out_a), raw(lse_a)),
            (raw(out_b), raw(lse_b)),
            DType::F32,
        );
        let (out, merged): (Tensor<W, 4>, Tensor<W, 3>) = (wrap(out), wrap(merged));
        assert_eq!(out.dtype(), DType::F32, "{name}: the merged output is f32");
        assert_close(
            &format!("{name}: out"),
            &values(out),
            &values(want_out),
            1e-6,
        );
        assert_close(
            &format!("{name}: lse"),
            &values(merged),
            &values(want_lse),
            1e-6,
        );
    }
}

/// Partial outputs stored sequence-major (`[batch, len, heads, head_dim]` in memory, as the
/// fused attention writes them) are read where they lie: the same merge as the composition.
#[test]
fn lse_merge_reads_sequence_major_outputs() {
    let device = WgpuDevice::default();
    let [batch, heads, len, head_dim] = [2, 3, 5, 8];
    let sequence_major = |seed| {
        random_4d(
            [batch, len, heads, head_dim],
            seed,
            2.0,
            DType::F32,
            &device,
        )
        .swap_dims(1, 2)
    };
    let (out_a, out_b) = (sequence_major(5), sequence_major(6));
    let lse_a = lse([batch, heads, len], 7, 0.0, &device);
    let lse_b = lse([batch, heads, len], 8, 0.5, &device);
    let (want_out, want_lse) = lse_merge_composition(
        (out_a.clone(), lse_a.clone()),
        (out_b.clone(), lse_b.clone()),
        DType::F32,
    );
    let (out, merged) = lse_merge(
        (raw(out_a), raw(lse_a)),
        (raw(out_b), raw(lse_b)),
        DType::F32,
    );
    let (out, merged): (Tensor<W, 4>, Tensor<W, 3>) = (wrap(out), wrap(merged));
    assert_close("sequence-major: out", &values(out), &values(want_out), 1e-6);
    assert_close(
        "sequence-major: lse",
        &values(merged),
        &values(want_lse),
        1e-6,
    );
}
