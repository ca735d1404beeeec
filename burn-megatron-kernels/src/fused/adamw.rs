//! AdamW over flat fp32 buffers in one kernel: Megatron's fused Adam (apex's
//! `multi_tensor_adam`, or PyTorch's `fused=True`) for a model whose parameters, gradients and
//! moments each live in one contiguous buffer (`burn_megatron::distributed::ParamAndGradBuffer`).
//!
//! Per element `i` of the `[n]` buffers, with `t = step + 1` (`step` a `[1]` f32 device
//! scalar: the steps taken so far):
//!
//! ```text
//! g      = grad[i] · grad_factor                  (clip coefficient / loss scale)
//! m      = β₁ m + (1 - β₁) g
//! v      = β₂ v + (1 - β₂) g²
//! update = (m / (1 - β₁ᵗ)) / (sqrt(v / (1 - β₂ᵗ)) + ε)
//! p      = p · (1 - lr · wd)   (decayed elements only)   - lr · update
//! ```
//!
//! When `found_inf` (a `[1]` f32 device scalar) is non-zero the step is skipped: `m`, `v` and
//! the parameters keep their values, whatever the gradients hold. The bias corrections
//! `1 - βᵗ` are computed as `-expm1(t · ln β)`, accurate to f32 rounding for every `t` (the
//! plain `1 - β.powi(t)` of Burn's AdamW loses up to ~6e-5 of its relative precision to
//! cancellation for β₂ = 0.999 early in training). Every value the kernel reads from the
//! device (`step`, `grad_factor`, `found_inf`) stays there: no host sync.
//!
//! Weight decay is per block of `block` elements (`decay[i / block]` is 1 or 0): the buffer
//! aligns each parameter's start to `block`, so a block never holds two parameters.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

pub use crate::adamw_scalars::AdamWScalars;

/// Threads per cube.
const THREADS: u32 = 256;

/// The flat buffers of one step. `master`, `grad`, `exp_avg`, `exp_avg_sq` are `[n]` f32,
/// `decay` is `[n / block]` f32 (1: decay, 0: exempt); `step`, `grad_factor` and `found_inf`
/// are `[1]` f32.
pub struct AdamWBuffers<R: CubeRuntime> {
    /// The fp32 master weights.
    pub master: CubeTensor<R>,
    /// The fp32 gradients.
    pub grad: CubeTensor<R>,
    /// The first moments.
    pub exp_avg: CubeTensor<R>,
    /// The second moments.
    pub exp_avg_sq: CubeTensor<R>,
    /// The weight-decay flag of each block.
    pub decay: CubeTensor<R>,
    /// Steps taken before this one.
    pub step: CubeTensor<R>,
    /// Multiplies every gradient (clip coefficient over loss scale; 1 for neither).
    pub grad_factor: CubeTensor<R>,
    /// Non-zero skips the step.
    pub found_inf: CubeTensor<R>,
}

/// The updated buffers: `master`, `exp_avg`, `exp_avg_sq` (`[n]` f32) and, when asked for,
/// the parameters in the model's dtype (`[n]`).
pub struct AdamWOutput<R: CubeRuntime> {
    /// The updated fp32 master weights.
    pub master: CubeTensor<R>,
    /// The updated first moments.
    pub exp_avg: CubeTensor<R>,
    /// The updated second moments.
    pub exp_avg_sq: CubeTensor<R>,
    /// The updated master weights cast to the model's dtype.
    pub model: Option<CubeTensor<R>>,
}

/// `1 - βᵗ = -expm1(x)` for `x = t · ln β ≤ 0`, without the cancellation of `1 - exp(x)` for
/// small `|x|`: a Taylor series (Horner form) up to `x¹⁰` for `x > -0.5` (truncation below
/// 1e-10), `1 - exp(x)` beyond.
#[cube]
fn one_minus_power(x: f32) -> f32 {
    let one = f32::new(1.0);
    let mut series = one;
    series = one + x / f32::new(10.0) * series;
    series = one + x / f32::new(9.0) * series;
    series = one + x / f32::new(8.0) * series;
    series = one + x / f32::new(7.0) * series;
    series = one + x / f32::new(6.0) * series;
    series = one + x / f32::new(5.0) * series;
    series = one + x / f32::new(4.0) * series;
    series = one + x / f32::new(3.0) * series;
    series = one + x / f32::new(2.0) * series;
    if x > f32::new(-0.5) {
        f32::new(0.0) - x * series
    } else {
        one - x.exp()
    }
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn adamw_kernel<P: Float>(
    master: &Tensor<f32>,
    grad: &Tensor<f32>,
    exp_avg: &mut Tensor<f32>,
    exp_avg_sq: &mut Tensor<f32>,
    decay: &Tensor<f32>,
    step: &Tensor<f32>,
    grad_factor: &Tensor<f32>,
    found_inf: &Tensor<f32>,
    master_out: &mut Tensor<f32>,
    model_out: &mut Tensor<P>,
    lr: f32,
    beta_1: f32,
    beta_2: f32,
    ln_beta_1: f32,
    ln_beta_2: f32,
    epsilon: f32,
    decay_factor: f32,
    block: u32,
    n: u32,
    #[comptime] in_place: bool,
    #[comptime] write_model: bool,
    #[define(P)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= n as usize {
        terminate!();
    }
    // In place, `master_out` holds the old weights and `master` is a placeholder.
    let mut p = if in_place { master_out[i] } else { master[i] };
    if found_inf[0] == f32::new(0.0) {
        let g = grad[i] * grad_factor[0];
        let m = exp_avg[i] * beta_1 + g * (f32::new(1.0) - beta_1);
        let v = exp_avg_sq[i] * beta_2 + g * g * (f32::new(1.0) - beta_2);
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        let t = step[0] + f32::new(1.0);
        let bias_1 = one_minus_power(t * ln_beta_1);
        let bias_2 = one_minus_power(t * ln_beta_2);
        let update = (m / bias_1) / ((v / bias_2).sqrt() + epsilon);
        if decay[i / block as usize] != f32::new(0.0) {
            p *= decay_factor;
        }
        p -= update * lr;
    }
    // A skipped step writes the old value back (in place, a no-op).
    master_out[i] = p;
    if write_model {
        model_out[i] = P::cast_from(p);
    }
}

/// One AdamW step over the flat buffers (see the [module docs](self)).
///
/// `exp_avg` and `exp_avg_sq` are updated in place (copied first if another tensor shares
/// them). `master` is updated in place when no other tensor shares it, else written to a new
/// buffer (an f32 model whose parameters are views of it). With `model_dtype`, the kernel also
/// writes the updated weights in that dtype, the buffer the model's parameters become views
/// of: one launch in all.
pub fn adamw_step<R: CubeRuntime>(
    buffers: AdamWBuffers<R>,
    scalars: AdamWScalars,
    model_dtype: Option<DType>,
) -> AdamWOutput<R> {
    let AdamWBuffers {
        master,
        grad,
        exp_avg,
        exp_avg_sq,
        decay,
        step,
        grad_factor,
        found_inf,
    } = buffers;
    let n = master.meta.shape()[0];
    let client = master.client.clone();
    let device = master.device.clone();
    let empty = |len: usize, dtype: DType| {
        empty_device_contiguous_dtype::<R>(client.clone(), device.clone(), Shape::new([len]), dtype)
    };
    // The moments are written in place: a copy first if anything else holds them.
    let unique = |t: CubeTensor<R>| if t.can_mut() { t } else { t.copy() };
    let (exp_avg, exp_avg_sq) = (unique(exp_avg), unique(exp_avg_sq));
    let in_place = master.can_mut();
    let (master_in, master_out) = match in_place {
        true => (empty(1, DType::F32), master),
        false => (master, empty(n, DType::F32)),
    };
    let model = model_dtype.map(|dtype| empty(n, dtype));
    let output = AdamWOutput {
        master: master_out.clone(),
        exp_avg: exp_avg.clone(),
        exp_avg_sq: exp_avg_sq.clone(),
        model: model.clone(),
    };
    if n == 0 {
        return output;
    }
    let write_model = model.is_some();
    let model_out = model.unwrap_or_else(|| empty(1, DType::F32));
    let cubes = n.div_ceil(THREADS as usize) as u32;
    // A 2D grid keeps each dimension of the launch within the hardware's limit.
    let (x, y) = match cubes > 65_535 {
        true => (65_535, cubes.div_ceil(65_535)),
        false => (cubes, 1),
    };
    let dtype = model_out.dtype.into();
    adamw_kernel::launch::<R>(
        &client,
        CubeCount::Static(x, y, 1),
        CubeDim::new_1d(THREADS),
        master_in.into_tensor_arg(),
        grad.into_tensor_arg(),
        exp_avg.into_tensor_arg(),
        exp_avg_sq.into_tensor_arg(),
        decay.into_tensor_arg(),
        step.into_tensor_arg(),
        grad_factor.into_tensor_arg(),
        found_inf.into_tensor_arg(),
        master_out.into_tensor_arg(),
        model_out.into_tensor_arg(),
        scalars.lr,
        scalars.beta_1,
        scalars.beta_2,
        scalars.ln_beta_1,
        scalars.ln_beta_2,
        scalars.epsilon,
        scalars.decay_factor,
        scalars.block as u32,
        n as u32,
        in_place,
        write_model,
        dtype,
    );
    output
}
