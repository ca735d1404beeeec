//! Normal initial values drawn from each element's global coordinates, where the tensor
//! lives: in one kernel on CubeCL backends (`burn_megatron_kernels::fused::counter_normal`),
//! on the host's cores otherwise (the reference, and NdArray's path).
//!
//! Element `c` of a full tensor is `std · standard_normal(stream_key(seed), c)`
//! (`burn_megatron_kernels::counter_rng`): two uniforms from 32-bit hashes of the coordinates,
//! Box-Muller in f32. The coordinates are the full tensor's, outermost first, padded with
//! leading zeros to four (a tensor of more dimensions folds its leading ones into the first),
//! so a rank's slice of a parameter holds the whole parameter's numbers. The uniforms are
//! bit-equal on the host and in the kernel; the normal numbers differ only by `ln`, `sqrt`
//! and `cos` (a few ulps), and every rank of a run draws on the same kind of device.

use core::ops::Range;

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_megatron_kernels::counter_rng::{standard_normal, stream_key};

/// Normal values drawn from global coordinates.
pub trait CounterNormalOps: Backend {
    /// The block `ranges` of the `full`-shaped tensor of normal values with standard deviation
    /// `std` drawn from `seed` (see the [module docs](self)), in the device's default float
    /// dtype. CubeCL backends draw it on the device; others on the host's cores.
    fn counter_normal<const D: usize>(
        full: [usize; D],
        ranges: [Range<usize>; D],
        std: f64,
        seed: u64,
        device: &Self::Device,
    ) -> Tensor<Self, D> {
        Tensor::from_data(counter_normal_host(full, ranges, std, seed), device)
    }
}

/// [`CounterNormalOps::counter_normal`] on the host: the rows drawn on every core.
pub fn counter_normal_host<const D: usize>(
    full: [usize; D],
    ranges: [Range<usize>; D],
    std: f64,
    seed: u64,
) -> TensorData {
    let key = stream_key(seed);
    let std = std as f32;
    counter_slice(full, ranges, |linear| {
        standard_normal(key, coordinates(full, linear)) * std
    })
}

/// The slice `ranges` of a full tensor of shape `full` whose element at row-major index `i`
/// is `value(i)`.
///
/// A 7B model draws billions of values at start-up, so the rows of the slice (runs along its
/// last dimension, contiguous in the full tensor too) are drawn on every core; each value
/// depends on its index alone, so the threads change nothing but the time.
fn counter_slice<const D: usize>(
    full: [usize; D],
    ranges: [Range<usize>; D],
    value: impl Fn(u64) -> f32 + Sync,
) -> TensorData {
    let shape: [usize; D] = std::array::from_fn(|d| ranges[d].len());
    let count: usize = shape.iter().product();
    let mut values = vec![0f32; count];
    if count > 0 {
        let row_len = shape[D - 1];
        // The full tensor's row-major index of the first element of the slice's `row`.
        let row_start = |mut row: usize| -> u64 {
            let mut stride = 1u64;
            let mut linear = ranges[D - 1].start as u64;
            for d in (0..D - 1).rev() {
                stride *= full[d + 1] as u64;
                linear += (ranges[d].start + row % shape[d]) as u64 * stride;
                row /= shape[d];
            }
            linear
        };
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        // Enough rows a thread that spawning costs nothing next to the drawing.
        let rows_per_chunk = (count / threads / row_len).max((1 << 16) / row_len).max(1);
        std::thread::scope(|scope| {
            for (chunk_index, chunk) in values.chunks_mut(rows_per_chunk * row_len).enumerate() {
                let (value, row_start) = (&value, &row_start);
                scope.spawn(move || {
                    let first_row = chunk_index * rows_per_chunk;
                    for (r, row) in chunk.chunks_mut(row_len).enumerate() {
                        let start = row_start(first_row + r);
                        for (j, out) in row.iter_mut().enumerate() {
                            *out = value(start + j as u64);
                        }
                    }
                });
            }
        });
    }
    TensorData::new(values, shape)
}

/// The generator's four coordinates of the element at row-major index `linear` of a
/// `full`-shaped tensor: its own, padded with leading zeros, or with its leading dimensions
/// folded into the first where it has more than four.
pub fn coordinates<const D: usize>(full: [usize; D], linear: u64) -> [u32; 4] {
    let mut out = [0u32; 4];
    let mut rest = linear;
    // The last three dimensions (or all of fewer) are coordinates 3, 2 and 1 from the end;
    // what is left is coordinate 0: the first of four dimensions, or the leading ones folded.
    for k in 0..D.min(3) {
        let n = full[D - 1 - k] as u64;
        out[3 - k] = (rest % n) as u32;
        rest /= n;
    }
    if D >= 4 {
        out[0] = rest as u32;
    }
    out
}

impl<B: CounterNormalOps, C: CheckpointStrategy> CounterNormalOps for Autodiff<B, C> {
    fn counter_normal<const D: usize>(
        full: [usize; D],
        ranges: [Range<usize>; D],
        std: f64,
        seed: u64,
        device: &Self::Device,
    ) -> Tensor<Self, D> {
        Tensor::from_inner(B::counter_normal(full, ranges, std, seed, device))
    }
}

/// CubeCL backends: one kernel, then a cast to the device's default float dtype.
#[cfg(feature = "fused")]
mod cube {
    use core::ops::Range;

    use burn::tensor::{DType, Tensor, get_device_settings};
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use burn_megatron_kernels::fused::counter_normal as kernels;

    use super::{CounterNormalOps, counter_normal_host};
    use crate::ops::primitive::wrap;

    /// A block's shape and offset in the generator's four coordinates, where it is one block
    /// there: tensors of up to four dimensions (more fall back to the host).
    fn block4<const D: usize>(ranges: &[Range<usize>; D]) -> Option<([usize; 4], [usize; 4])> {
        if D > 4 {
            return None;
        }
        let (mut dims, mut offset) = ([1usize; 4], [0usize; 4]);
        for (d, range) in ranges.iter().enumerate() {
            dims[4 - D + d] = range.len();
            offset[4 - D + d] = range.start;
        }
        Some((dims, offset))
    }

    impl<R, F, I, BT> CounterNormalOps for CubeBackend<R, F, I, BT>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        fn counter_normal<const D: usize>(
            full: [usize; D],
            ranges: [Range<usize>; D],
            std: f64,
            seed: u64,
            device: &Self::Device,
        ) -> Tensor<Self, D> {
            let fits = full.iter().all(|&n| u32::try_from(n).is_ok())
                && u32::try_from(ranges.iter().map(|r| r.len()).product::<usize>()).is_ok();
            let Some((dims, offset)) = block4(&ranges).filter(|_| fits) else {
                return Tensor::from_data(counter_normal_host(full, ranges, std, seed), device);
            };
            let shape: [usize; D] = core::array::from_fn(|d| ranges[d].len());
            let values = kernels::counter_normal::<R>(device, dims, offset, seed, std as f32);
            let dtype: DType = get_device_settings::<Self>(device).float_dtype.into();
            wrap::<Self, 4>(values).reshape(shape).cast(dtype)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn_megatron_testing::values_f32 as values;

    /// The rows drawn on several threads hold the values of a one-by-one walk of the slice's
    /// elements in row-major order (a 3D slice of ~200k elements: several threads' chunks).
    #[test]
    fn threads_draw_the_row_major_walk() {
        let (full, ranges) = ([7, 300, 130], [1..6, 17..290, 3..128]);
        let drawn = counter_slice(full, ranges.clone(), |i| i as f32 * 0.5 + 1.0);
        let mut expected = Vec::new();
        for a in ranges[0].clone() {
            for b in ranges[1].clone() {
                for c in ranges[2].clone() {
                    let linear = (a * full[1] + b) * full[2] + c;
                    expected.push(linear as f32 * 0.5 + 1.0);
                }
            }
        }
        assert_eq!(drawn.shape.to_vec(), vec![5, 273, 125]);
        assert_eq!(drawn.to_vec::<f32>().unwrap(), expected);
    }

    /// Coordinates padded with leading zeros up to four dimensions, the leading ones folded
    /// beyond.
    #[test]
    fn coordinates_are_the_elements_own() {
        assert_eq!(coordinates([10], 7), [0, 0, 0, 7]);
        assert_eq!(coordinates([4, 5], 13), [0, 0, 2, 3]);
        assert_eq!(coordinates([2, 3, 4], 23), [0, 1, 2, 3]);
        assert_eq!(coordinates([2, 3, 4, 5], 119), [1, 2, 3, 4]);
        // [1, 2, 0, 1, 3] of [2, 3, 2, 2, 4]: the first two folded into 1 · 3 + 2 = 5.
        let linear = (((3 + 2) * 2) * 2 + 1) * 4 + 3;
        assert_eq!(coordinates([2, 3, 2, 2, 4], linear), [5, 0, 1, 3]);
    }

    /// The host's values: mean 0 and the standard deviation asked for, a block of a tensor is
    /// the whole tensor's slice, and seeds give other numbers.
    #[test]
    fn host_values_are_normal_and_layout_free() {
        let dev = Default::default();
        let draw = |full: [usize; 2], ranges: [Range<usize>; 2], seed| {
            values(NdArray::<f32>::counter_normal(
                full, ranges, 2.0, seed, &dev,
            ))
        };
        let v = draw([200, 100], [0..200, 0..100], 1);
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32;
        assert!(mean.abs() < 0.05, "mean {mean}");
        assert!((var.sqrt() - 2.0).abs() < 0.05, "std {}", var.sqrt());
        let block = draw([200, 100], [50..60, 30..100], 1);
        let sliced: Vec<f32> = (50..60)
            .flat_map(|r| v[r * 100 + 30..r * 100 + 100].to_vec())
            .collect();
        assert_eq!(block, sliced);
        assert_ne!(draw([200, 100], [0..1, 0..4], 2)[..], v[..4]);
    }
}
