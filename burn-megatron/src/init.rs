//! Seeded initialisation that does not depend on the parallel layout.
//!
//! Element `c` of a full parameter is a function of `(seed, c)` alone (a counter-based
//! generator, as Philox is in cuRAND), so a rank generates exactly its own slice and a model
//! built with TP = k holds the same numbers as the TP = 1 model built from the same seed.
//! That is what lets layouts be compared and checkpoints be resharded. The normal values are
//! drawn where the tensor lives ([`CounterNormalOps`]): on the GPU a 7B model's take
//! milliseconds, where the host's cores took tens of seconds.

use std::ops::Range;

use burn::tensor::Tensor;

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
