//! One AdamW step over flat fp32 buffers ([`AdamWOps::flat_adamw`]): its inputs, its plain
//! Burn composition (the default on NdArray, and the reference the CubeCL kernel
//! `burn_megatron_kernels::fused::adamw` is tested against), and the kernel's wiring.
//!
//! Per element, with `t = step + 1`:
//!
//! ```text
//! g      = grad · grad_factor                     (clip coefficient / loss scale)
//! m      = β₁ m + (1 - β₁) g
//! v      = β₂ v + (1 - β₂) g²
//! update = (m / (1 - β₁ᵗ)) / (sqrt(v / (1 - β₂ᵗ)) + ε)
//! p      = p · (1 - lr · wd)   (decayed elements only)   - lr · update
//! ```
//!
//! the operations in the order of Burn's `AdamW` (so that, on the same inputs, both round
//! alike), except the bias corrections `1 - βᵗ`, computed as `-expm1(t · ln β)` from the
//! device-side step count: see [`one_minus_power`]. A non-zero `found_inf` leaves `p`, `m` and
//! `v` as they were.

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;

pub use burn_megatron_kernels::adamw_scalars::AdamWScalars;

/// One AdamW step over flat buffers.
pub trait AdamWOps: Backend {
    /// One AdamW step over flat fp32 buffers (see the [module docs](self)): the updated
    /// master weights and moments, and with `model_dtype` the master weights cast to it. The
    /// step is skipped on the device when `found_inf` is set. CubeCL backends run one kernel
    /// (`burn_megatron_kernels::fused::adamw`) for all of it.
    fn flat_adamw(
        buffers: FlatAdamWBuffers<Self>,
        scalars: &AdamWScalars,
        model_dtype: Option<DType>,
    ) -> FlatAdamWOutput<Self> {
        flat_adamw_composition(buffers, scalars, model_dtype)
    }
}

/// The device tensors of one step: `master`, `grad`, `exp_avg`, `exp_avg_sq` are `[n]` f32,
/// `decay` is `[n / block]` f32 (1: decayed block, 0: exempt), and `step`, `grad_factor`,
/// `found_inf` are `[1]` f32.
#[derive(Debug, Clone)]
pub struct FlatAdamWBuffers<B: Backend> {
    /// The fp32 master weights.
    pub master: Tensor<B, 1>,
    /// The fp32 gradients.
    pub grad: Tensor<B, 1>,
    /// The first moments.
    pub exp_avg: Tensor<B, 1>,
    /// The second moments.
    pub exp_avg_sq: Tensor<B, 1>,
    /// The weight-decay flag of each block of `block` elements.
    pub decay: Tensor<B, 1>,
    /// Steps taken before this one.
    pub step: Tensor<B, 1>,
    /// Multiplies every gradient: the clip coefficient over the loss scale (1 for neither).
    pub grad_factor: Tensor<B, 1>,
    /// Non-zero skips the step (the loss scaler's overflow flag).
    pub found_inf: Tensor<B, 1>,
}

/// The step's results: `master`, `exp_avg`, `exp_avg_sq` (`[n]` f32) and, when asked for, the
/// master weights in the model's dtype (`[n]`).
#[derive(Debug, Clone)]
pub struct FlatAdamWOutput<B: Backend> {
    /// The updated master weights.
    pub master: Tensor<B, 1>,
    /// The updated first moments.
    pub exp_avg: Tensor<B, 1>,
    /// The updated second moments.
    pub exp_avg_sq: Tensor<B, 1>,
    /// The updated weights cast to the model's dtype.
    pub model: Option<Tensor<B, 1>>,
}

/// `1 - βᵗ` from `x = t · ln β` (`[1]`, `x ≤ 0`) as `-expm1(x)`: `1 - exp(x)` cancels for
/// small `|x|` (for β₂ = 0.999 at `t = 1`, `1 - β₂` keeps only ~4 significant digits of an f32
/// `β₂ᵗ`), so for `x > -0.5` a Taylor series in Horner form (10 terms, truncation below 1e-10)
/// is used instead. The kernel computes the same expression.
pub fn one_minus_power<B: Backend>(x: Tensor<B, 1>) -> Tensor<B, 1> {
    let mut series = x.ones_like();
    for k in (2..=10).rev() {
        series = (x.clone().div_scalar(k as f32) * series).add_scalar(1.0);
    }
    let small = (x.clone() * series).neg();
    let large = x.clone().exp().neg().add_scalar(1.0);
    small.mask_where(x.lower_equal_elem(-0.5), large)
}

/// The step as Burn operations (see the [module docs](self)); `model_dtype` asks for the
/// updated weights cast to it as well.
pub fn flat_adamw_composition<B: Backend>(
    buffers: FlatAdamWBuffers<B>,
    s: &AdamWScalars,
    model_dtype: Option<DType>,
) -> FlatAdamWOutput<B> {
    let FlatAdamWBuffers {
        master,
        grad,
        exp_avg,
        exp_avg_sq,
        decay,
        step,
        grad_factor,
        found_inf,
    } = buffers;
    let n = master.dims()[0];
    let blocks = decay.dims()[0];
    let skip = found_inf.not_equal_elem(0.0).expand([n]);
    let g = grad * grad_factor;
    let m = exp_avg
        .clone()
        .mul_scalar(s.beta_1)
        .add(g.clone().mul_scalar(1.0f32 - s.beta_1));
    let v = exp_avg_sq
        .clone()
        .mul_scalar(s.beta_2)
        .add(g.square().mul_scalar(1.0f32 - s.beta_2));
    let t = step.add_scalar(1.0);
    let bias_1 = one_minus_power(t.clone().mul_scalar(s.ln_beta_1));
    let bias_2 = one_minus_power(t.mul_scalar(s.ln_beta_2));
    let update = (m.clone() / bias_1) / ((v.clone() / bias_2).sqrt().add_scalar(s.epsilon));
    let decayed = decay
        .not_equal_elem(0.0)
        .reshape([blocks, 1])
        .expand([blocks, s.block])
        .reshape([n]);
    let p = master.clone();
    let p = p.clone().mask_where(decayed, p.mul_scalar(s.decay_factor));
    let p = p - update.mul_scalar(s.lr);
    let master = p.mask_where(skip.clone(), master);
    let exp_avg = m.mask_where(skip.clone(), exp_avg);
    let exp_avg_sq = v.mask_where(skip, exp_avg_sq);
    let model = model_dtype.map(|dtype| master.clone().cast(dtype));
    FlatAdamWOutput {
        master,
        exp_avg,
        exp_avg_sq,
        model,
    }
}

/// The optimizer steps outside the graph: the composition.
impl<B: AdamWOps, C: CheckpointStrategy> AdamWOps for Autodiff<B, C> {}

/// CubeCL backends: the whole step in one kernel.
#[cfg(feature = "fused")]
mod cube {
    use burn::tensor::DType;
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use burn_megatron_kernels::fused::adamw::{AdamWBuffers, adamw_step};

    use super::{AdamWOps, AdamWScalars, FlatAdamWBuffers, FlatAdamWOutput};
    use crate::ops::primitive::{raw, wrap};

    impl<R, F, I, BT> AdamWOps for CubeBackend<R, F, I, BT>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        fn flat_adamw(
            buffers: FlatAdamWBuffers<Self>,
            scalars: &AdamWScalars,
            model_dtype: Option<DType>,
        ) -> FlatAdamWOutput<Self> {
            let out = adamw_step(
                AdamWBuffers {
                    master: raw(buffers.master),
                    grad: raw(buffers.grad),
                    exp_avg: raw(buffers.exp_avg),
                    exp_avg_sq: raw(buffers.exp_avg_sq),
                    decay: raw(buffers.decay),
                    step: raw(buffers.step),
                    grad_factor: raw(buffers.grad_factor),
                    found_inf: raw(buffers.found_inf),
                },
                *scalars,
                model_dtype,
            );
            FlatAdamWOutput {
                master: wrap(out.master),
                exp_avg: wrap(out.exp_avg),
                exp_avg_sq: wrap(out.exp_avg_sq),
                model: out.model.map(wrap),
            }
        }
    }
}
