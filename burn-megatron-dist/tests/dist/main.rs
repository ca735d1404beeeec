//! Tests of burn-megatron-dist on CPU thread ranks.

mod collectives;
mod failures;
mod launcher;
mod mappings;
mod parallel_state;
mod ranks;
mod rendezvous;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{Tensor, TensorData};
pub use burn_megatron_testing::{run, values_f32 as values};

pub type B = NdArray<f32>;
pub type AD = Autodiff<B>;

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
