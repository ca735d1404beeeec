//! Rotary position embeddings.

use burn::tensor::{Tensor, backend::Backend};

/// Rotates `x`: `[batch, heads, seq, head_dim]`, position `p` by angles `p · base^(-2i/head_dim)`
/// over the pairs `(i, i + head_dim / 2)` (the "rotate half" layout of GPT-NeoX and Llama).
pub fn apply_rope<B: Backend>(x: Tensor<B, 4>, base: f64) -> Tensor<B, 4> {
    let [_, _, seq, head_dim] = x.dims();
    let half = head_dim / 2;
    let device = x.device();
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| base.powf(-2.0 * i as f64 / head_dim as f64) as f32)
        .collect();
    let inv_freq = Tensor::<B, 1>::from_floats(inv_freq.as_slice(), &device).reshape([1, half]);
    let positions = Tensor::<B, 1, burn::tensor::Int>::arange(0..seq as i64, &device)
        .float()
        .reshape([seq, 1]);
    let angles = positions.matmul(inv_freq);
    let angles = Tensor::cat(vec![angles.clone(), angles], 1).reshape([1, 1, seq, head_dim]);
    let rotated = Tensor::cat(
        vec![
            x.clone().narrow(3, half, half).neg(),
            x.clone().narrow(3, 0, half),
        ],
        3,
    );
    x * angles.clone().cos() + rotated * angles.sin()
}
