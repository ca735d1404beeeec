//! Tests of burn-megatron-dist on CPU thread ranks.

mod collectives;
mod dtensor;
mod failures;
mod launcher;
mod mappings;
mod parallel_state;

use std::time::Duration;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{Tensor, TensorData};
use burn_megatron_dist::{DistError, LaunchConfig, RankContext, launch};

pub type B = NdArray<f32>;
pub type AD = Autodiff<B>;

/// Runs `f` on `n` thread ranks with a short timeout and returns every rank's result.
pub fn run<T: Send>(n: usize, f: impl Fn(RankContext) -> Result<T, DistError> + Sync) -> Vec<T> {
    let config = LaunchConfig::new(n).with_timeout(Duration::from_secs(20));
    launch(config, f).unwrap_or_else(|e| panic!("launch failed: {e}\n{:#?}", e.failures))
}

/// A tensor of the given shape holding `values`.
pub fn tensor<Bk: burn::tensor::backend::Backend, const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
) -> Tensor<Bk, D> {
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

/// `0, 1, 2, …` times `scale` plus `offset`, shaped.
pub fn iota<Bk: burn::tensor::backend::Backend, const D: usize>(
    shape: [usize; D],
    scale: f32,
    offset: f32,
) -> Tensor<Bk, D> {
    let n: usize = shape.iter().product();
    tensor((0..n).map(|i| i as f32 * scale + offset).collect(), shape)
}

/// The tensor's values.
pub fn values<Bk: burn::tensor::backend::Backend, const D: usize>(t: Tensor<Bk, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec().unwrap()
}
