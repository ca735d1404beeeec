//! Seeded initialisation that does not depend on the parallel layout.
//!
//! Element `c` of a full parameter is a function of `(seed, c)` alone (a counter-based
//! generator, as Philox is in cuRAND), so a rank generates exactly its own slice and a model
//! built with TP = k holds the same numbers as the TP = 1 model built from the same seed.
//! That is what lets layouts be compared and checkpoints be resharded. The normal values are
//! drawn where the tensor lives ([`CounterNormalOps`]): on the GPU a 7B model's take
//! milliseconds, where the host's cores took tens of seconds.

use std::ops::Range;

use burn::tensor::{Tensor, TensorData};

use crate::ops::CounterNormalOps;

/// How a parameter's values are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum InitDistribution {
    /// Normal with mean 0 and the given standard deviation.
    Normal {
        /// Standard deviation.
        std: f64,
    },
    /// A constant.
    Constant(f64),
}

/// Seeds for the parameters of a model: each parameter's seed is derived from the model seed
/// and the parameter's name, so adding a parameter does not shift the others.
pub fn param_seed(model_seed: u64, name: &str) -> u64 {
    // Mixing byte by byte keeps the seed a pure function of the name.
    name.bytes()
        .fold(splitmix64(model_seed), |h, b| splitmix64(h ^ b as u64))
}

/// The slice `ranges` of a full tensor of shape `full` drawn from `dist` with `seed`.
pub fn init_slice<B: CounterNormalOps, const D: usize>(
    full: [usize; D],
    ranges: [Range<usize>; D],
    dist: InitDistribution,
    seed: u64,
    device: &B::Device,
) -> Tensor<B, D> {
    match dist {
        InitDistribution::Normal { std } => B::counter_normal(full, ranges, std, seed, device),
        InitDistribution::Constant(c) => Tensor::full(ranges.map(|r| r.len()), c as f32, device),
    }
}

/// The slice `ranges` of a full tensor of shape `full` whose element at row-major index `i`
/// is `value(i)`.
///
/// A 7B model draws billions of values at start-up, so the rows of the slice (runs along its
/// last dimension, contiguous in the full tensor too) are drawn on every core; each value
/// depends on its index alone, so the threads change nothing but the time.
pub(crate) fn counter_slice<const D: usize>(
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

/// The whole tensor: [`init_slice`] over every index.
pub fn init_full<B: CounterNormalOps, const D: usize>(
    full: [usize; D],
    dist: InitDistribution,
    seed: u64,
    device: &B::Device,
) -> Tensor<B, D> {
    init_slice(full, full.map(|n| 0..n), dist, seed, device)
}

/// SplitMix64's finaliser: a bijective 64-bit mix with good avalanche.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn_megatron_testing::values_f32 as values;

    #[test]
    fn slices_equal_the_full_tensor_sliced() {
        let dist = InitDistribution::Normal { std: 0.02 };
        let dev = Default::default();
        let full = init_full::<NdArray, 2>([6, 8], dist, 7, &dev);
        let slice = init_slice::<NdArray, 2>([6, 8], [2..5, 4..8], dist, 7, &dev);
        assert_eq!(values(full.slice([2..5, 4..8])), values(slice));
    }

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

    #[test]
    fn normal_statistics_and_seeds() {
        let dev = Default::default();
        let v = values(init_full::<NdArray, 1>(
            [20_000],
            InitDistribution::Normal { std: 2.0 },
            1,
            &dev,
        ));
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32;
        assert!(mean.abs() < 0.05, "mean {mean}");
        assert!((var.sqrt() - 2.0).abs() < 0.05, "std {}", var.sqrt());
        let other = values(init_full::<NdArray, 1>(
            [4],
            InitDistribution::Normal { std: 2.0 },
            2,
            &dev,
        ));
        assert_ne!(other[..], v[..4]);
        assert_ne!(param_seed(0, "fc1.weight"), param_seed(0, "fc2.weight"));
    }
}
