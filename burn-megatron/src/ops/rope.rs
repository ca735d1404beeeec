//! Rotary position embeddings (RoPE) applied to the packed QKV projection in one operation.
//!
//! `qkv: [batch, seq, groups, heads_per_group + 2, head_dim]` (Megatron's packed layout: per
//! query group its query heads, its key head, its value head) comes back in the same layout
//! with every query and key head rotated and the value heads unchanged, ready for
//! [`packed_flash_attention`](super::packed_flash_attention) or a split. Position `p` rotates
//! the pairs `(i, i + head_dim / 2)` (the "rotate half" layout of GPT-NeoX and Llama) by the
//! angle `p · base^(-2i / head_dim)`.
//!
//! The cosines and sines are a `[seq, head_dim / 2]` table computed in f64 and rounded to f32
//! ([`rotation_table`]), for every dtype. (Computing the angles in a bf16 model's own dtype,
//! as a plain composition would, rounds positions above 256 and angles to 8 bits.) The
//! rotation is orthogonal, so the backward is the rotation by `-angle` of the output's
//! gradient and `Autodiff<B>` stores nothing. CubeCL backends run one kernel each way
//! (`burn_megatron_kernels::fused::rope`) on a table uploaded once per device and shape,
//! which also replaces the split, negate and concatenate copies of the composition.

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use crate::backend::{ModelBackend, wrap};

/// The cosines and sines of the angles `p · base^(-2i / head_dim)` for positions `p` in
/// `0..seq` and pairs `i` in `0..head_dim / 2`, computed in f64 and rounded to f32: `[cos,
/// sin]`, each `[seq, head_dim / 2]` row-major.
pub fn rotation_table(seq: usize, head_dim: usize, base: f64) -> [Vec<f32>; 2] {
    let half = head_dim / 2;
    let mut cos = Vec::with_capacity(seq * half);
    let mut sin = Vec::with_capacity(seq * half);
    for p in 0..seq {
        for i in 0..half {
            let angle = p as f64 * base.powf(-2.0 * i as f64 / head_dim as f64);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    [cos, sin]
}

/// Checks the packed shape and returns `head_dim / 2`.
pub(crate) fn check_shape(dims: [usize; 5]) -> usize {
    assert!(
        dims[4].is_multiple_of(2),
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
    let [cos, sin] = rotation_table(seq, head_dim, base).map(|values| {
        let table =
            Tensor::<B, 2>::from_data(TensorData::new(values, [seq, half]), (&device, DType::F32));
        Tensor::cat(vec![table.clone(), table], 1)
            .reshape([1, seq, 1, 1, head_dim])
            .cast(dtype)
    });
    let sin = if inverse { sin.neg() } else { sin };
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
    // The backward needs nothing of the input: hand its buffer over, so that the kernel can
    // rotate it in place when nothing else holds it.
    let (input, node) = (qkv.primitive, qkv.node);
    let output = B::packed_rope(wrap::<B, 5>(input), base)
        .into_primitive()
        .tensor();
    let output = match RopeBackward.prepare::<C>([node]).compute_bound().stateful() {
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
