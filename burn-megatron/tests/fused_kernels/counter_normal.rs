//! The initialisation kernel: the host's normal values from the same global coordinates.

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{Tensor, TensorData};
use burn_megatron::ops::CounterNormalOps;
use burn_megatron::ops::counter_normal::counter_normal_host;
use burn_megatron_testing::{assert_close, tolerance, values};

use crate::helpers::W;

fn host<const D: usize>(
    full: [usize; D],
    ranges: [core::ops::Range<usize>; D],
    std: f64,
    seed: u64,
) -> Vec<f64> {
    let data: TensorData = counter_normal_host(full, ranges, std, seed);
    data.to_vec::<f32>()
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect()
}

/// `CounterNormalOps::counter_normal` on a CubeCL backend (one kernel) equals the host's
/// draw to f32 rounding (the uniforms are bit-equal; `ln`, `sqrt` and `cos` differ by ulps)
/// for blocks of 1 to 4 dimensions at offsets in the full tensor, of sizes that are not whole
/// thread groups; a block equals the full tensor drawn on the device and sliced; five
/// dimensions (drawn on the host) are bit-equal.
#[test]
fn the_kernel_draws_the_hosts_normal_values() {
    let device = WgpuDevice::default();
    let (std, seed) = (0.02, 0x5eed_0000_1234);
    let tail = || std::array::from_fn::<_, 1, _>(|_| 37..1000);
    let got = values(W::counter_normal([1000], tail(), std, seed, &device));
    assert_close("1D", &got, &host([1000], tail(), std, seed), tolerance::F32);

    let (full, ranges) = ([300, 130], [17..290, 64..130]);
    let block: Tensor<W, 2> = W::counter_normal(full, ranges.clone(), std, seed, &device);
    let want = host(full, ranges.clone(), std, seed);
    assert_close("2D block", &values(block.clone()), &want, tolerance::F32);
    let whole: Tensor<W, 2> = W::counter_normal(full, [0..300, 0..130], std, seed, &device);
    assert_eq!(
        values(whole.slice(ranges)),
        values(block),
        "2D: a block is the whole's slice"
    );

    let (full, ranges) = ([7, 33, 65], [1..6, 3..33, 0..65]);
    let got = values(W::counter_normal(full, ranges.clone(), 1.0, seed, &device));
    assert_close(
        "3D block",
        &got,
        &host(full, ranges, 1.0, seed),
        tolerance::F32,
    );
    let (full, ranges) = ([2, 3, 5, 7], [1..2, 0..3, 2..5, 0..7]);
    let got = values(W::counter_normal(full, ranges.clone(), 3.0, seed, &device));
    assert_close(
        "4D block",
        &got,
        &host(full, ranges, 3.0, seed),
        tolerance::F32,
    );

    let (full, ranges) = ([2, 2, 3, 2, 4], [0..2, 1..2, 0..3, 0..2, 1..4]);
    let got = values(W::counter_normal(full, ranges.clone(), 1.0, seed, &device));
    assert_eq!(got, host(full, ranges, 1.0, seed), "5D (the host's draw)");
}
