//! LayerNorm and RMSNorm over the last dimension, forward and backward, with f32 statistics
//! for any storage dtype (f64 stays f64).
//!
//! [`NormOps::norm_forward`] returns the output and each row's `mean` and `rstd` (the
//! reciprocal standard deviation); [`NormOps::norm_backward`] turns them, the input and
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
use burn::tensor::{DType, Tensor};
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;

use super::autodiff::{BackwardStep, inner, parent, record, register};
use super::primitive::{raw, wrap};

/// LayerNorm and RMSNorm.
pub trait NormOps: Backend {
    /// `norm(x) · scale (+ shift)` for `x: [rows, hidden]`, `scale, shift: [hidden]`
    /// (LayerNorm or RMSNorm, see [`norm()`]), in `x`'s dtype. `Autodiff<B>` records one node
    /// that stores `x`, the scale and the statistics of [`norm_forward`](Self::norm_forward),
    /// and calls [`norm_backward`](Self::norm_backward).
    fn norm(
        x: Tensor<Self, 2>,
        scale: Tensor<Self, 1>,
        shift: Option<Tensor<Self, 1>>,
        kind: NormKind,
        epsilon: f64,
    ) -> Tensor<Self, 2> {
        Self::norm_forward(x, scale, shift, kind, epsilon).output
    }

    /// `x + residual` and [`norm`](Self::norm) of it: the residual stream's add fused with
    /// the norm that reads it (one kernel on CubeCL backends, where the sum is rounded to
    /// `x`'s dtype as the separate add rounds it). Returns the sum, then the norm's output.
    /// For inference: `Autodiff<B>` runs the composition (an add and [`norm`](Self::norm)).
    ///
    /// # Shapes
    /// - x, residual and both outputs: `[rows, hidden]`
    fn add_norm(
        x: Tensor<Self, 2>,
        residual: Tensor<Self, 2>,
        scale: Tensor<Self, 1>,
        shift: Option<Tensor<Self, 1>>,
        kind: NormKind,
        epsilon: f64,
    ) -> [Tensor<Self, 2>; 2] {
        add_norm_composition(x, residual, scale, shift, kind, epsilon)
    }

    /// [`norm`](Self::norm)'s output and each row's `mean` and `rstd` (`[rows]`, f32; f64 for
    /// f64 inputs). CubeCL backends run one kernel (`burn_megatron_kernels::fused::norm`).
    fn norm_forward(
        x: Tensor<Self, 2>,
        scale: Tensor<Self, 1>,
        shift: Option<Tensor<Self, 1>>,
        kind: NormKind,
        epsilon: f64,
    ) -> NormForward<Self> {
        forward_composition(x, scale, shift, kind, epsilon)
    }

    /// The gradients of [`norm`](Self::norm)'s `x`, scale and (with `with_shift`) shift given
    /// its output's gradient `grad: [rows, hidden]` and the forward's statistics. CubeCL
    /// backends run one kernel for `dx` and a two-stage column reduction for the scale and
    /// shift (deterministic: no atomics).
    #[allow(clippy::too_many_arguments)]
    fn norm_backward(
        x: Tensor<Self, 2>,
        scale: Tensor<Self, 1>,
        mean: Tensor<Self, 1>,
        rstd: Tensor<Self, 1>,
        grad: Tensor<Self, 2>,
        kind: NormKind,
        with_shift: bool,
    ) -> NormGradients<Self> {
        backward_composition(x, scale, mean, rstd, grad, kind, with_shift)
    }
}

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

/// The gradients of [`NormOps::norm_backward`].
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
/// `[hidden]`; flattened to `[rows, hidden]` for [`NormOps::norm`], then reshaped back.
///
/// # Shapes
/// - `x` and the output: `[..., hidden]`
/// - `scale`, `shift`: `[hidden]`
pub fn norm<B: NormOps, const D: usize>(
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

/// [`NormOps::add_norm`] as an add and [`NormOps::norm`].
pub fn add_norm_composition<B: NormOps>(
    x: Tensor<B, 2>,
    residual: Tensor<B, 2>,
    scale: Tensor<B, 1>,
    shift: Option<Tensor<B, 1>>,
    kind: NormKind,
    epsilon: f64,
) -> [Tensor<B, 2>; 2] {
    let sum = x + residual;
    [sum.clone(), B::norm(sum, scale, shift, kind, epsilon)]
}

/// [`NormOps::norm_forward`] as Burn operations in the statistics' dtype.
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

/// [`NormOps::norm_backward`] as Burn operations in the statistics' dtype.
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

/// The inner backend's forward, and one node holding `x`, the scale and the statistics.
impl<B: NormOps, C: CheckpointStrategy> NormOps for Autodiff<B, C> {
    fn norm(
        x: Tensor<Self, 2>,
        scale: Tensor<Self, 1>,
        shift: Option<Tensor<Self, 1>>,
        kind: NormKind,
        epsilon: f64,
    ) -> Tensor<Self, 2> {
        let (x, scale, shift) = (raw(x), raw(scale), shift.map(raw));
        let forward = B::norm_forward(
            inner(&x),
            inner(&scale),
            shift.as_ref().map(inner),
            kind,
            epsilon,
        );
        let state = NormState::<B> {
            x: x.primitive.clone(),
            scale: scale.primitive.clone(),
            mean: raw(forward.mean),
            rstd: raw(forward.rstd),
            kind,
        };
        let output = raw(forward.output);
        wrap(match &shift {
            Some(shift) => record::<B, C, _>(NormBackward, &[&x, &scale, shift], state, output),
            None => record::<B, C, _>(NormBackward, &[&x, &scale], state, output),
        })
    }
}

/// The backward of `y = norm(x) · scale (+ shift)`, from [`NormOps::norm_backward`]. Its
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

impl<B: NormOps> BackwardStep<B> for NormBackward {
    type State = NormState<B>;

    fn backward(
        self,
        grad: FloatTensor<B>,
        state: <Self as BackwardStep<B>>::State,
        parents: &[Option<NodeId>],
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
        if let Some(dshift) = gradients.shift {
            register(grads, parent(parents, 2), || dshift);
        }
        register(grads, parent(parents, 1), || gradients.scale);
        register(grads, parent(parents, 0), || gradients.x);
    }
}

/// CubeCL backends: one kernel forward, one for `dx` and a two-stage column reduction
/// backward (f64: the composition).
#[cfg(feature = "fused")]
mod cube {
    use burn::tensor::{DType, Tensor};
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use burn_megatron_kernels::fused::norm as kernels;

    use super::{
        NormForward, NormGradients, NormKind, NormOps, add_norm_composition, backward_composition,
        forward_composition,
    };
    use crate::ops::primitive::{raw, wrap};

    fn kernel_kind(kind: NormKind) -> kernels::Kind {
        match kind {
            NormKind::LayerNorm => kernels::Kind::LayerNorm,
            NormKind::RmsNorm => kernels::Kind::RmsNorm,
        }
    }

    impl<R, F, I, BT> NormOps for CubeBackend<R, F, I, BT>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        fn norm_forward(
            x: Tensor<Self, 2>,
            scale: Tensor<Self, 1>,
            shift: Option<Tensor<Self, 1>>,
            kind: NormKind,
            epsilon: f64,
        ) -> NormForward<Self> {
            let dtype = x.dtype();
            if dtype == DType::F64 {
                return forward_composition(x, scale, shift, kind, epsilon);
            }
            let parameter = |t: Tensor<Self, 1>| raw(t.cast(dtype));
            let out = kernels::forward(
                raw(x),
                parameter(scale),
                shift.map(parameter),
                kernel_kind(kind),
                epsilon,
            );
            NormForward {
                output: wrap(out.output),
                mean: wrap(out.mean),
                rstd: wrap(out.rstd),
            }
        }

        fn add_norm(
            x: Tensor<Self, 2>,
            residual: Tensor<Self, 2>,
            scale: Tensor<Self, 1>,
            shift: Option<Tensor<Self, 1>>,
            kind: NormKind,
            epsilon: f64,
        ) -> [Tensor<Self, 2>; 2] {
            let dtype = x.dtype();
            if dtype == DType::F64 || residual.dtype() != dtype {
                return add_norm_composition(x, residual, scale, shift, kind, epsilon);
            }
            let parameter = |t: Tensor<Self, 1>| raw(t.cast(dtype));
            let (sum, out) = kernels::add_forward(
                raw(x),
                raw(residual),
                parameter(scale),
                shift.map(parameter),
                kernel_kind(kind),
                epsilon,
            );
            [wrap(sum), wrap(out.output)]
        }

        fn norm_backward(
            x: Tensor<Self, 2>,
            scale: Tensor<Self, 1>,
            mean: Tensor<Self, 1>,
            rstd: Tensor<Self, 1>,
            grad: Tensor<Self, 2>,
            kind: NormKind,
            with_shift: bool,
        ) -> NormGradients<Self> {
            if x.dtype() == DType::F64 {
                return backward_composition(x, scale, mean, rstd, grad, kind, with_shift);
            }
            let (dtype, scale_dtype) = (x.dtype(), scale.dtype());
            let [mean, rstd] = [mean, rstd].map(|t| raw(t.cast(DType::F32)));
            let out = kernels::backward(
                raw(x),
                raw(scale.cast(dtype)),
                mean,
                rstd,
                raw(grad.cast(dtype)),
                kernel_kind(kind),
                with_shift,
            );
            let parameter = |t| wrap::<Self, 1>(t).cast(scale_dtype);
            NormGradients {
                x: wrap(out.x),
                scale: parameter(out.scale),
                shift: out.shift.map(parameter),
            }
        }
    }
}
