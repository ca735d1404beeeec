//! Rotary position embeddings (RoPE) applied to the packed QKV projection in one operation.
//!
//! `qkv: [batch, seq, groups, heads_per_group + 2, head_dim]` (Megatron's packed layout: per
//! query group its query heads, its key head, its value head) comes back in the same layout
//! with every query and key head rotated and the value heads unchanged, ready for
//! [`packed_flash_attention`](super::packed_flash_attention) or a split. Position `p` rotates
//! the pairs `(i, i + head_dim / 2)` (the "rotate half" layout of GPT-NeoX and Llama) by the
//! angle `p · base^(-2i / head_dim)`.
//!
//! Angles are f32 for every dtype: `f32(p) · f32(base^(-2i / head_dim))`, then f32 cosines and
//! sines. (Computing them in a bf16 model's own dtype, as a plain composition would, rounds
//! positions above 256 and angles to 8 bits.) The rotation is orthogonal, so the backward is
//! the rotation by `-angle` of the output's gradient and `Autodiff<B>` stores nothing. CubeCL
//! backends run one kernel each way (`burn_megatron_kernels::fused::rope`), which also replaces
//! the split, negate and concatenate copies of the composition.

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use crate::backend::{ModelBackend, wrap};

/// `base^(-2i / head_dim)` for `i` in `0..head_dim / 2`, computed in f64 and rounded to f32.
pub fn inverse_frequencies(head_dim: usize, base: f64) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| base.powf(-2.0 * i as f64 / head_dim as f64) as f32)
        .collect()
}

/// Checks the packed shape and returns `head_dim / 2`.
pub(crate) fn check_shape(dims: [usize; 5]) -> usize {
    assert!(
        dims[4] % 2 == 0,
        "RoPE needs an even head dimension, got {dims:?}"
    );
    assert!(
        dims[3] >= 2,
        "RoPE takes qkv [batch, seq, groups, heads_per_group + 2, head_dim], got {dims:?}"
    );
    dims[4] / 2
}

/// [`ModelBackend::packed_rope`] (and with `inverse`, its backward) as a Burn composition.
pub fn packed_rope_composition<B: Backend>(
    qkv: Tensor<B, 5>,
    base: f64,
    inverse: bool,
) -> Tensor<B, 5> {
    let dims = qkv.dims();
    let [_, seq, _, slots, head_dim] = dims;
    let half = check_shape(dims);
    let (device, dtype) = (qkv.device(), qkv.dtype());
    let frequencies = inverse_frequencies(head_dim, base);
    let angles: Vec<f32> = (0..seq)
        .flat_map(|p| frequencies.iter().map(move |f| p as f32 * f))
        .collect();
    let angles =
        Tensor::<B, 2>::from_data(TensorData::new(angles, [seq, half]), (&device, DType::F32));
    let full = |t: Tensor<B, 2>| {
        Tensor::cat(vec![t.clone(), t], 1)
            .reshape([1, seq, 1, 1, head_dim])
            .cast(dtype)
    };
    let cos = full(angles.clone().cos());
    let sin = full(if inverse {
        angles.sin().neg()
    } else {
        angles.sin()
    });
    let heads = qkv.clone().narrow(3, 0, slots - 1);
    let values = qkv.narrow(3, slots - 1, 1);
    let rotated_half = Tensor::cat(
        vec![
            heads.clone().narrow(4, half, half).neg(),
            heads.clone().narrow(4, 0, half),
        ],
        4,
    );
    Tensor::cat(vec![heads * cos + rotated_half * sin, values], 3)
}

/// [`ModelBackend::packed_rope`] on `Autodiff<B>`: the inner backend's forward and a node that
/// stores only `base`.
pub(crate) fn autodiff_packed_rope<B: ModelBackend, C: CheckpointStrategy>(
    qkv: Tensor<Autodiff<B, C>, 5>,
    base: f64,
) -> Tensor<Autodiff<B, C>, 5> {
    let qkv = qkv.into_primitive().tensor();
    let output = B::packed_rope(wrap::<B, 5>(qkv.primitive.clone()), base)
        .into_primitive()
        .tensor();
    let output = match RopeBackward
        .prepare::<C>([qkv.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(base, output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    };
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// The backward of the rotation: the rotation by `-angle` of the gradient.
#[derive(Debug)]
struct RopeBackward;

impl<B: ModelBackend> Backward<B, 1> for RopeBackward {
    type State = f64;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [Some(parent)] = ops.parents else { return };
        let grad = B::packed_rope_backward(wrap::<B, 5>(grad), ops.state);
        grads.register::<B>(parent.id, grad.into_primitive().tensor());
    }
}
