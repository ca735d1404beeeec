//! LayerNorm and RMSNorm over the last dimension, forward and backward, with f32 statistics
//! for any storage dtype (f64 stays f64).
//!
//! [`ModelBackend::norm_forward`] returns the output and each row's `mean` and `rstd` (the
//! reciprocal standard deviation); [`ModelBackend::norm_backward`] turns them, the input and
//! the output's gradient into the gradients of the input, the scale and the shift. Both are
//! where a fused kernel goes (`burn_megatron_kernels::fused::norm` on CubeCL backends);
//! their defaults here are the plain Burn compositions. `Autodiff<B>` records one node that
//! stores `x`, the scale and the two `[rows]` statistics (Megatron's `FusedLayerNormAffine`
//! does the same).
//!
//! With `x̂ = (x - mean) · rstd` (LayerNorm) or `x̂ = x · rstd` (RMSNorm), `y = x̂ · scale
//! (+ shift)`, and `ĝ = dy · scale`:
//! - `dx = rstd · (ĝ - mean(ĝ) - x̂ · mean(ĝ · x̂))` (RMSNorm: without `mean(ĝ)`);
//! - `dscale = Σ_rows dy · x̂`, `dshift = Σ_rows dy`.

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorPrimitive};
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use crate::backend::{ModelBackend, wrap};

/// Which normalisation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// `(x - mean) / sqrt(var + eps)`, then scale and (optionally) shift.
    LayerNorm,
    /// `x / sqrt(mean(x²) + eps)`, then scale (and, unusually, a shift).
    RmsNorm,
}

/// The forward's output and the statistics its backward needs.
#[derive(Debug, Clone)]
pub struct NormForward<B: Backend> {
    /// `[rows, hidden]`, in `x`'s dtype.
    pub output: Tensor<B, 2>,
    /// `[rows]`, f32 (f64 for f64 inputs); zero for RMSNorm.
    pub mean: Tensor<B, 1>,
    /// `[rows]`, `1 / sqrt(var + eps)` (RMSNorm: `1 / sqrt(mean(x²) + eps)`), f32 (f64 for
    /// f64 inputs).
    pub rstd: Tensor<B, 1>,
}

/// The gradients of [`ModelBackend::norm_backward`].
#[derive(Debug, Clone)]
pub struct NormGradients<B: Backend> {
    /// `[rows, hidden]`, in `x`'s dtype.
    pub x: Tensor<B, 2>,
    /// `[hidden]`, in the scale's dtype.
    pub scale: Tensor<B, 1>,
    /// `[hidden]`, in the scale's dtype; present when asked for.
    pub shift: Option<Tensor<B, 1>>,
}

/// The dtype of the statistics for inputs of `dtype`: f64 for f64, f32 otherwise.
pub fn statistics_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// The normalisation of `x` (`[.., hidden]`) over its last dimension, `scale` and `shift`
/// `[hidden]`; flattened to `[rows, hidden]` for [`ModelBackend::norm`], then reshaped back.
pub fn norm<B: ModelBackend, const D: usize>(
    x: Tensor<B, D>,
    scale: Tensor<B, 1>,
    shift: Option<Tensor<B, 1>>,
    kind: NormKind,
    epsilon: f64,
) -> Tensor<B, D> {
    let dims = x.dims();
    let hidden = dims[D - 1];
    let rows = dims[..D - 1].iter().product();
    B::norm(x.reshape([rows, hidden]), scale, shift, kind, epsilon).reshape(dims)
}

/// [`ModelBackend::norm_forward`] as Burn operations in the statistics' dtype.
pub fn forward_composition<B: Backend>(
    x: Tensor<B, 2>,
    scale: Tensor<B, 1>,
    shift: Option<Tensor<B, 1>>,
    kind: NormKind,
    epsilon: f64,
) -> NormForward<B> {
    let dtype = x.dtype();
    let stats = statistics_dtype(dtype);
    let x = x.cast(stats);
    let [rows, _] = x.dims();
    let (centred, mean) = match kind {
        NormKind::LayerNorm => {
            let mean = x.clone().mean_dim(1);
            (x - mean.clone(), mean.squeeze_dim::<1>(1))
        }
        NormKind::RmsNorm => (
            x.clone(),
            Tensor::<B, 1>::zeros([rows], &x.device()).cast(stats),
        ),
    };
    let variance = centred.clone().powi_scalar(2).mean_dim(1);
    let rstd = (variance + epsilon).sqrt().recip();
    let scaled = centred * rstd.clone() * scale.cast(stats).unsqueeze();
    let output = match shift {
        Some(shift) => scaled + shift.cast(stats).unsqueeze(),
        None => scaled,
    };
    NormForward {
        output: output.cast(dtype),
        mean,
        rstd: rstd.squeeze_dim::<1>(1),
    }
}

/// [`ModelBackend::norm_backward`] as Burn operations in the statistics' dtype.
pub fn backward_composition<B: Backend>(
    x: Tensor<B, 2>,
    scale: Tensor<B, 1>,
    mean: Tensor<B, 1>,
    rstd: Tensor<B, 1>,
    grad: Tensor<B, 2>,
    kind: NormKind,
    with_shift: bool,
) -> NormGradients<B> {
    let (dtype, scale_dtype) = (x.dtype(), scale.dtype());
    let stats = statistics_dtype(dtype);
    let rstd = rstd.cast(stats).unsqueeze_dim::<2>(1);
    let normalised = (x.cast(stats) - mean.cast(stats).unsqueeze_dim(1)) * rstd.clone();
    let grad = grad.cast(stats);
    let grad_normalised = grad.clone() * scale.cast(stats).unsqueeze();
    let projection = (grad_normalised.clone() * normalised.clone()).mean_dim(1);
    let mut grad_x = grad_normalised.clone() - normalised.clone() * projection;
    if kind == NormKind::LayerNorm {
        grad_x = grad_x - grad_normalised.mean_dim(1);
    }
    let column_sum = |t: Tensor<B, 2>| t.sum_dim(0).squeeze_dim::<1>(0).cast(scale_dtype);
    NormGradients {
        x: (grad_x * rstd).cast(dtype),
        scale: column_sum(grad.clone() * normalised),
        shift: with_shift.then(|| column_sum(grad)),
    }
}

/// [`ModelBackend::norm`] on `Autodiff<B>`: the inner backend's forward, and one
/// [`NormBackward`] node holding `x`, the scale and the statistics.
pub(crate) fn autodiff_norm<B: ModelBackend, C: CheckpointStrategy>(
    x: Tensor<Autodiff<B, C>, 2>,
    scale: Tensor<Autodiff<B, C>, 1>,
    shift: Option<Tensor<Autodiff<B, C>, 1>>,
    kind: NormKind,
    epsilon: f64,
) -> Tensor<Autodiff<B, C>, 2> {
    let x = x.into_primitive().tensor();
    let scale = scale.into_primitive().tensor();
    let shift = shift.map(|s| s.into_primitive().tensor());
    let forward = B::norm_forward(
        wrap::<B, 2>(x.primitive.clone()),
        wrap::<B, 1>(scale.primitive.clone()),
        shift.as_ref().map(|s| wrap::<B, 1>(s.primitive.clone())),
        kind,
        epsilon,
    );
    let output = forward.output.into_primitive().tensor();
    let state = NormState::<B> {
        x: x.primitive.clone(),
        scale: scale.primitive.clone(),
        mean: forward.mean.into_primitive().tensor(),
        rstd: forward.rstd.into_primitive().tensor(),
        kind,
    };
    let output = match &shift {
        Some(shift) => match NormBackward
            .prepare::<C>([x.node.clone(), scale.node.clone(), shift.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        },
        None => match NormBackward
            .prepare::<C>([x.node.clone(), scale.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        },
    };
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// The backward of `y = norm(x) · scale (+ shift)`, from [`ModelBackend::norm_backward`]. Its
/// parents are `[x, scale]` or `[x, scale, shift]`.
#[derive(Debug)]
struct NormBackward;

/// What the forward keeps for the backward.
#[derive(Debug, Clone)]
struct NormState<B: Backend> {
    x: FloatTensor<B>,
    scale: FloatTensor<B>,
    mean: FloatTensor<B>,
    rstd: FloatTensor<B>,
    kind: NormKind,
}

impl NormBackward {
    fn run<B: ModelBackend>(
        parents: &[Option<NodeId>],
        grad: FloatTensor<B>,
        state: NormState<B>,
        grads: &mut Gradients,
    ) {
        let with_shift = parents.len() == 3;
        let gradients = B::norm_backward(
            wrap(state.x),
            wrap(state.scale),
            wrap(state.mean),
            wrap(state.rstd),
            wrap(grad),
            state.kind,
            with_shift,
        );
        if let (Some(Some(id)), Some(dshift)) = (parents.get(2), gradients.shift) {
            grads.register::<B>(*id, dshift.into_primitive().tensor());
        }
        if let Some(id) = parents[1] {
            grads.register::<B>(id, gradients.scale.into_primitive().tensor());
        }
        if let Some(id) = parents[0] {
            grads.register::<B>(id, gradients.x.into_primitive().tensor());
        }
    }
}

impl<B: ModelBackend> Backward<B, 2> for NormBackward {
    type State = NormState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let parents = ops.parents.map(|p| p.map(|node| node.id));
        Self::run::<B>(&parents, grad, ops.state, grads);
    }
}

impl<B: ModelBackend> Backward<B, 3> for NormBackward {
    type State = NormState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let parents = ops.parents.map(|p| p.map(|node| node.id));
        Self::run::<B>(&parents, grad, ops.state, grads);
    }
}
