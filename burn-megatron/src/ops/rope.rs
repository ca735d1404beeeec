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

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use burn::backend::Autodiff;
use burn::tensor::backend::{Backend, DeviceId, DeviceOps};
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

    /// [`packed_rope`](Self::packed_rope) at the given positions instead of `0..seq`: token
    /// `t` of `qkv` is rotated by the angles of position `positions[t]` (`seq` values; see
    /// [`packed_rope_at`]). `Autodiff<B>` stores the positions; its backward is
    /// [`packed_rope_at_backward`](Self::packed_rope_at_backward).
    fn packed_rope_at(qkv: Tensor<Self, 5>, positions: &[usize], base: f64) -> Tensor<Self, 5> {
        packed_rope_at_composition(qkv, positions, base, false)
    }

    /// The gradient of [`packed_rope_at`](Self::packed_rope_at)'s input from its output's
    /// gradient: the rotation by `-angle` at the same positions.
    fn packed_rope_at_backward(
        grad: Tensor<Self, 5>,
        positions: &[usize],
        base: f64,
    ) -> Tensor<Self, 5> {
        packed_rope_at_composition(grad, positions, base, true)
    }
}

/// The cosines and sines of the angles `p · base^(-2i / head_dim)` for positions `p` in
/// `0..seq` and pairs `i` in `0..head_dim / 2`, computed in f64 and rounded to f32: `[cos,
/// sin]`, each `[seq, head_dim / 2]` row-major.
pub fn rotation_table(seq: usize, head_dim: usize, base: f64) -> [Vec<f32>; 2] {
    rotation_rows(0..seq, head_dim, base)
}

/// [`rotation_table`]'s rows of the given positions, in their order: `[cos, sin]`, each
/// `[positions, head_dim / 2]` row-major, the same values as the table's rows.
fn rotation_rows(
    positions: impl ExactSizeIterator<Item = usize>,
    head_dim: usize,
    base: f64,
) -> [Vec<f32>; 2] {
    let half = head_dim / 2;
    let frequencies: Vec<f64> = (0..half)
        .map(|i| base.powf(-2.0 * i as f64 / head_dim as f64))
        .collect();
    let mut cos = Vec::with_capacity(positions.len() * half);
    let mut sin = Vec::with_capacity(positions.len() * half);
    for p in positions {
        for frequency in &frequencies {
            let (s, c) = (p as f64 * frequency).sin_cos();
            cos.push(c as f32);
            sin.push(s as f32);
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
/// are in the whole sequence. From the same f64 angles as `packed_rope`, so equal to it at
/// positions `0..seq`; differentiable under `Autodiff<B>`, which stores the positions
/// ([`RopeOps::packed_rope_at`]). CubeCL backends run `packed_rope`'s kernel on a table of
/// these positions' rows; the others, the composition. Either way the table is built once per
/// device and positions, then kept for the process: every layer rotates the same positions,
/// in the forward pass and again when it is recomputed.
///
/// # Shapes
/// - `qkv`: `[batch, seq, groups, heads_per_group + 2, head_dim]`, returned alike;
/// - `positions`: `seq` values.
pub fn packed_rope_at<B: RopeOps>(
    qkv: Tensor<B, 5>,
    positions: &[usize],
    base: f64,
) -> Tensor<B, 5> {
    let dims = qkv.dims();
    check_shape(dims);
    assert_eq!(
        positions.len(),
        dims[1],
        "one position per token of qkv {dims:?}"
    );
    B::packed_rope_at(qkv, positions, base)
}

/// [`RopeOps::packed_rope_at`] (and with `inverse`, its backward) as a Burn composition.
pub fn packed_rope_at_composition<B: Backend>(
    qkv: Tensor<B, 5>,
    positions: &[usize],
    base: f64,
    inverse: bool,
) -> Tensor<B, 5> {
    let dims = qkv.dims();
    let [_, _, _, slots, head_dim] = dims;
    let half = check_shape(dims);
    let [cos, sin] = position_tables::<B>(positions, head_dim, base, &qkv.device(), qkv.dtype());
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

/// The `[1, seq, 1, 1, head_dim]` cosines and sines of `positions` for
/// [`packed_rope_at_composition`] (each pair's angle in both halves, "rotate half"), in `dtype`
/// on `device`: computed in f64 for these positions only, uploaded once per backend, device,
/// dtype, positions, head dim and base, then kept for the process.
///
/// Building the table at every call instead (`powf`, `sin` and `cos` in f64 for every position
/// up to the largest, four million angles at 128k tokens, then an upload from pageable memory)
/// kept the GPU waiting for the host at every layer.
fn position_tables<B: Backend>(
    positions: &[usize],
    head_dim: usize,
    base: f64,
    device: &B::Device,
    dtype: DType,
) -> [Tensor<B, 5>; 2] {
    type Key = (TypeId, DeviceId, DType, usize, u64, Vec<usize>);
    static TABLES: OnceLock<Mutex<HashMap<Key, Box<dyn Any + Send + Sync>>>> = OnceLock::new();
    let key = (
        TypeId::of::<B>(),
        DeviceOps::id(device),
        dtype,
        head_dim,
        base.to_bits(),
        positions.to_vec(),
    );
    let mut cache = TABLES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let seq = positions.len();
    let tables = cache.entry(key).or_insert_with(|| {
        let tables = rotation_rows(positions.iter().copied(), head_dim, base).map(|values| {
            let table = Tensor::<B, 2>::from_data(
                TensorData::new(values, [seq, head_dim / 2]),
                (device, DType::F32),
            );
            Tensor::cat(vec![table.clone(), table], 1)
                .reshape([1, seq, 1, 1, head_dim])
                .cast(dtype)
        });
        Box::new(tables)
    });
    tables
        .downcast_ref::<[Tensor<B, 5>; 2]>()
        .expect("the RoPE tables of this backend")
        .clone()
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

    fn packed_rope_at(qkv: Tensor<Self, 5>, positions: &[usize], base: f64) -> Tensor<Self, 5> {
        let mut qkv = raw(qkv);
        // As in `packed_rope`: the backward needs nothing of the input.
        let output = raw(B::packed_rope_at(wrap(qkv.primitive), positions, base));
        qkv.primitive = output.clone();
        let state = (base, positions.to_vec());
        wrap(record::<B, C, _>(RopeAtBackward, &[&qkv], state, output))
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

/// The backward of the rotation at given positions: the rotation by `-angle` of the gradient.
#[derive(Debug)]
struct RopeAtBackward;

impl<B: RopeOps> BackwardStep<B> for RopeAtBackward {
    type State = (f64, Vec<usize>);

    fn backward(
        self,
        grad: FloatTensor<B>,
        (base, positions): (f64, Vec<usize>),
        parents: &[Option<NodeId>],
        grads: &mut Gradients,
    ) {
        register(grads, parent(parents, 0), || {
            B::packed_rope_at_backward(wrap(grad), &positions, base)
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

    use super::{
        RopeOps, check_shape, packed_rope_at_composition, packed_rope_composition, rotation_rows,
    };
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

        fn packed_rope_at(qkv: Tensor<Self, 5>, positions: &[usize], base: f64) -> Tensor<Self, 5> {
            rotate_at(qkv, positions, base, false)
        }

        fn packed_rope_at_backward(
            grad: Tensor<Self, 5>,
            positions: &[usize],
            base: f64,
        ) -> Tensor<Self, 5> {
            rotate_at(grad, positions, base, true)
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
        let [_, seq, _, _, head_dim] = qkv.dims();
        let table = rope_table::<R, F, I, BT>(&qkv.device(), Rows::First(seq), head_dim, base);
        rotate_by(qkv, table, inverse)
    }

    /// [`RopeOps::packed_rope_at`] (with `inverse`, its backward) in the same kernel, on the
    /// table of `positions`' rows.
    fn rotate_at<R, F, I, BT>(
        qkv: Tensor<CubeBackend<R, F, I, BT>, 5>,
        positions: &[usize],
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
            return packed_rope_at_composition(qkv, positions, base, inverse);
        }
        let head_dim = qkv.dims()[4];
        let rows = Rows::At(positions.to_vec());
        let table = rope_table::<R, F, I, BT>(&qkv.device(), rows, head_dim, base);
        rotate_by(qkv, table, inverse)
    }

    /// `qkv` rotated by `table` (`[seq, head_dim / 2]` cosines and sines, row `t` for token
    /// `t`) in one kernel.
    fn rotate_by<R, F, I, BT>(
        qkv: Tensor<CubeBackend<R, F, I, BT>, 5>,
        table: [CubeTensor<R>; 2],
        inverse: bool,
    ) -> Tensor<CubeBackend<R, F, I, BT>, 5>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        let dims = qkv.dims();
        let [batch, seq, groups, slots, head_dim] = dims;
        check_shape(dims);
        let layout = kernels::PackedRows { seq, groups, slots };
        let rows = raw(qkv.reshape([batch * seq * groups * slots, head_dim]));
        wrap::<CubeBackend<R, F, I, BT>, 2>(kernels::rotate(rows, table, layout, inverse))
            .reshape(dims)
    }

    /// The positions a RoPE table holds the rows of, in order.
    #[derive(Debug, Clone, PartialEq, Eq, Hash)]
    enum Rows {
        /// `0..seq`.
        First(usize),
        /// These (context parallelism's chunks).
        At(Vec<usize>),
    }

    /// The RoPE table `[cos, sin]` (`[rows, head_dim / 2]` f32 each) on `device`, computed
    /// and uploaded once per runtime, device, rows, head dim and base, then kept for the
    /// process.
    fn rope_table<R, F, I, BT>(
        device: &R::Device,
        rows: Rows,
        head_dim: usize,
        base: f64,
    ) -> [CubeTensor<R>; 2]
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        type Key = (TypeId, DeviceId, Rows, usize, u64);
        static TABLES: OnceLock<Mutex<HashMap<Key, Box<dyn Any + Send + Sync>>>> = OnceLock::new();
        let key = (
            TypeId::of::<R>(),
            DeviceOps::id(device),
            rows.clone(),
            head_dim,
            base.to_bits(),
        );
        let mut tables = TABLES
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let table = tables.entry(key).or_insert_with(|| {
            let (table, seq) = match rows {
                Rows::First(seq) => (rotation_rows(0..seq, head_dim, base), seq),
                Rows::At(positions) => {
                    let seq = positions.len();
                    (rotation_rows(positions.into_iter(), head_dim, base), seq)
                }
            };
            let table = table.map(|values| {
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

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::Tensor;
    use burn_megatron_testing::values;

    use super::{packed_rope_at, packed_rope_at_composition, packed_rope_composition};
    use crate::init::{InitDistribution, init_full};

    type AD = Autodiff<NdArray>;

    fn normal(dims: [usize; 5], seed: u64) -> Tensor<AD, 5> {
        init_full::<AD, 5>(
            dims,
            InitDistribution::Normal { std: 1.0 },
            seed,
            &Default::default(),
        )
    }

    /// `packed_rope_at` rotates each token as the composition over the whole sequence
    /// rotates the token at its position, bit for bit, at the first call (which builds the
    /// tables) and at later ones (which reuse them).
    #[test]
    fn rotation_at_positions_is_the_whole_sequences_rotation_at_them() {
        let (seq, dims) = (12, [2, 12, 2, 4, 8]);
        let whole = normal(dims, 7);
        let rotated = packed_rope_composition(whole.clone(), 10_000.0, false);
        // The load-balanced split's positions of rank 1 of 3: chunks 1 and 4 of 6.
        let positions = [2, 3, 8, 9];
        let pick = |t: Tensor<AD, 5>| {
            let tokens = positions.iter().map(|&p| t.clone().narrow(1, p, 1));
            Tensor::cat(tokens.collect(), 1)
        };
        let want = values(pick(rotated.clone()));
        let all: Vec<usize> = (0..seq).collect();
        for _ in 0..2 {
            let ours = packed_rope_at(pick(whole.clone()), &positions, 10_000.0);
            assert_eq!(values(ours), want);
            let ours = packed_rope_at(whole.clone(), &all, 10_000.0);
            assert_eq!(values(ours), values(rotated.clone()));
        }
    }

    /// The node's backward (the rotation by `-angle`) gives the gradient Burn's autodiff gives
    /// through the composition.
    #[test]
    fn rotation_at_positions_backward_matches_the_compositions() {
        let dims = [1, 4, 2, 3, 8];
        let positions = [5, 6, 1, 2];
        let upstream = normal(dims, 3).detach();
        let gradient = |ours: bool| {
            let qkv = normal(dims, 4).require_grad();
            let out = match ours {
                true => packed_rope_at(qkv.clone(), &positions, 500_000.0),
                false => packed_rope_at_composition(qkv.clone(), &positions, 500_000.0, false),
            };
            let grads = (out * upstream.clone()).sum().backward();
            values(qkv.grad(&grads).expect("qkv has a gradient"))
        };
        let (ours, want) = (gradient(true), gradient(false));
        for (a, b) in ours.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }
}
