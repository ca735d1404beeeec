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
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorData};
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;

use super::autodiff::{BackwardStep, parent, record, register};
use super::primitive::{raw, wrap};

/// Rotary position embeddings on the packed QKV.
pub trait RopeOps: Backend {
    /// Rotary position embeddings on the packed `qkv: [batch, seq, groups, heads_per_group + 2,
    /// head_dim]` (see the [module docs](self)): query and key heads rotated, value heads
    /// unchanged, in qkv's dtype with f32 angles. `Autodiff<B>` stores nothing; its backward is
    /// [`packed_rope_backward`](Self::packed_rope_backward). CubeCL backends run one kernel
    /// (`burn_megatron_kernels::fused::rope`).
    fn packed_rope(qkv: Tensor<Self, 5>, base: f64) -> Tensor<Self, 5> {
        packed_rope_composition(qkv, base, false)
    }

    /// The gradient of [`packed_rope`](Self::packed_rope)'s input from its output's gradient:
    /// the rotation by `-angle`.
    fn packed_rope_backward(grad: Tensor<Self, 5>, base: f64) -> Tensor<Self, 5> {
        packed_rope_composition(grad, base, true)
    }
}

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
fn check_shape(dims: [usize; 5]) -> usize {
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

/// [`RopeOps::packed_rope`] (and with `inverse`, its backward) as a Burn composition.
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

/// [`RopeOps::packed_rope`] at the given positions instead of `0..seq`: token `t` of `qkv`
/// is rotated by the angles of position `positions[t]`. Context parallelism needs it: a rank
/// holds two chunks of the sequence, not its start, and its tokens must be rotated as they
/// are in the whole sequence. A Burn composition (differentiable under `Autodiff<B>`, where
/// it stores the two `[seq, head_dim]` tables), from the same f64 table as `packed_rope`, so
/// equal to it at positions `0..seq`.
///
/// # Shapes
/// - `qkv`: `[batch, seq, groups, heads_per_group + 2, head_dim]`, returned alike;
/// - `positions`: `seq` values.
pub fn packed_rope_at<B: Backend>(
    qkv: Tensor<B, 5>,
    positions: &[usize],
    base: f64,
) -> Tensor<B, 5> {
    let dims = qkv.dims();
    let [_, seq, _, slots, head_dim] = dims;
    let half = check_shape(dims);
    assert_eq!(
        positions.len(),
        seq,
        "one position per token of qkv {dims:?}"
    );
    let (device, dtype) = (qkv.device(), qkv.dtype());
    let rows = positions.iter().copied().max().map_or(0, |p| p + 1);
    let [cos, sin] = rotation_table(rows, head_dim, base).map(|table| {
        let values: Vec<f32> = positions
            .iter()
            .flat_map(|&p| table[p * half..(p + 1) * half].iter().copied())
            .collect();
        let table =
            Tensor::<B, 2>::from_data(TensorData::new(values, [seq, half]), (&device, DType::F32));
        Tensor::cat(vec![table.clone(), table], 1)
            .reshape([1, seq, 1, 1, head_dim])
            .cast(dtype)
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

/// The inner backend's forward and a node that stores only `base`.
impl<B: RopeOps, C: CheckpointStrategy> RopeOps for Autodiff<B, C> {
    fn packed_rope(qkv: Tensor<Self, 5>, base: f64) -> Tensor<Self, 5> {
        let mut qkv = raw(qkv);
        // The backward needs nothing of the input: hand its buffer over, so that the kernel
        // can rotate it in place when nothing else holds it.
        let output = raw(B::packed_rope(wrap(qkv.primitive), base));
        qkv.primitive = output.clone();
        wrap(record::<B, C, _>(RopeBackward, &[&qkv], base, output))
    }
}

/// The backward of the rotation: the rotation by `-angle` of the gradient.
#[derive(Debug)]
struct RopeBackward;

impl<B: RopeOps> BackwardStep<B> for RopeBackward {
    type State = f64;

    fn backward(
        self,
        grad: FloatTensor<B>,
        base: f64,
        parents: &[Option<NodeId>],
        grads: &mut Gradients,
    ) {
        register(grads, parent(parents, 0), || {
            B::packed_rope_backward(wrap(grad), base)
        });
    }
}

/// CubeCL backends: one kernel each way on a table uploaded once per device and shape (f64:
/// the composition).
#[cfg(feature = "fused")]
mod cube {
    use std::any::{Any, TypeId};
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};

    use burn::tensor::backend::{DeviceId, DeviceOps};
    use burn::tensor::{DType, Tensor, TensorData};
    use burn_cubecl::tensor::CubeTensor;
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use burn_megatron_kernels::fused::rope as kernels;

    use super::{RopeOps, check_shape, packed_rope_composition, rotation_table};
    use crate::ops::primitive::{raw, wrap};

    impl<R, F, I, BT> RopeOps for CubeBackend<R, F, I, BT>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        fn packed_rope(qkv: Tensor<Self, 5>, base: f64) -> Tensor<Self, 5> {
            rotate(qkv, base, false)
        }

        fn packed_rope_backward(grad: Tensor<Self, 5>, base: f64) -> Tensor<Self, 5> {
            rotate(grad, base, true)
        }
    }

    /// [`RopeOps::packed_rope`] (with `inverse`, its backward) in one kernel.
    fn rotate<R, F, I, BT>(
        qkv: Tensor<CubeBackend<R, F, I, BT>, 5>,
        base: f64,
        inverse: bool,
    ) -> Tensor<CubeBackend<R, F, I, BT>, 5>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        if qkv.dtype() == DType::F64 {
            return packed_rope_composition(qkv, base, inverse);
        }
        let dims = qkv.dims();
        let [batch, seq, groups, slots, head_dim] = dims;
        check_shape(dims);
        let table = rope_table::<R, F, I, BT>(&qkv.device(), seq, head_dim, base);
        let layout = kernels::PackedRows { seq, groups, slots };
        let rows = raw(qkv.reshape([batch * seq * groups * slots, head_dim]));
        wrap::<CubeBackend<R, F, I, BT>, 2>(kernels::rotate(rows, table, layout, inverse))
            .reshape(dims)
    }

    /// The RoPE table `[cos, sin]` (`[seq, head_dim / 2]` f32 each) on `device`, computed
    /// and uploaded once per runtime, device, shape and base, then kept for the process.
    fn rope_table<R, F, I, BT>(
        device: &R::Device,
        seq: usize,
        head_dim: usize,
        base: f64,
    ) -> [CubeTensor<R>; 2]
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        type Key = (TypeId, DeviceId, usize, usize, u64);
        static TABLES: OnceLock<Mutex<HashMap<Key, Box<dyn Any + Send + Sync>>>> = OnceLock::new();
        let key = (
            TypeId::of::<R>(),
            DeviceOps::id(device),
            seq,
            head_dim,
            base.to_bits(),
        );
        let mut tables = TABLES
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let table = tables.entry(key).or_insert_with(|| {
            let table = rotation_table(seq, head_dim, base).map(|values| {
                raw(Tensor::<CubeBackend<R, F, I, BT>, 2>::from_data(
                    TensorData::new(values, [seq, head_dim / 2]),
                    (device, DType::F32),
                ))
            });
            Box::new(table)
        });
        table
            .downcast_ref::<[CubeTensor<R>; 2]>()
            .expect("a RoPE table of this runtime")
            .clone()
    }
}
