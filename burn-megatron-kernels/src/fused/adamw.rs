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

use super::vectors::vector_width;

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

/// A thread updates one vector of `N` elements (16 bytes of each f32 buffer on CUDA): the
/// per-element arithmetic is the scalar update's, in the same order.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn adamw_kernel<P: Float, N: Size>(
    master: &Tensor<Vector<f32, N>>,
    grad: &Tensor<Vector<f32, N>>,
    exp_avg: &mut Tensor<Vector<f32, N>>,
    exp_avg_sq: &mut Tensor<Vector<f32, N>>,
    decay: &Tensor<f32>,
    step: &Tensor<f32>,
    grad_factor: &Tensor<f32>,
    found_inf: &Tensor<f32>,
    master_out: &mut Tensor<Vector<f32, N>>,
    model_out: &mut Tensor<Vector<P, N>>,
    lr: f32,
    beta_1: f32,
    beta_2: f32,
    ln_beta_1: f32,
    ln_beta_2: f32,
    epsilon: f32,
    decay_factor: f32,
    block: u32,
    vectors: u32,
    #[comptime] in_place: bool,
    #[comptime] write_model: bool,
    #[define(P)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= vectors as usize {
        terminate!();
    }
    // In place, `master_out` holds the old weights and `master` is a placeholder.
    let mut p = if in_place { master_out[i] } else { master[i] };
    if found_inf[0] == f32::new(0.0) {
        let factor = grad_factor[0];
        let g = grad[i];
        let mut m = exp_avg[i];
        let mut v = exp_avg_sq[i];
        let t = step[0] + f32::new(1.0);
        let bias_1 = one_minus_power(t * ln_beta_1);
        let bias_2 = one_minus_power(t * ln_beta_2);
        // A vector never straddles two blocks: the launch makes `block` a multiple of `N`.
        let decayed = decay[i * N::value() / block as usize] != f32::new(0.0);
        #[unroll]
        for k in 0..N::value() {
            let gk = g[k] * factor;
            let mk = m[k] * beta_1 + gk * (f32::new(1.0) - beta_1);
            let vk = v[k] * beta_2 + gk * gk * (f32::new(1.0) - beta_2);
            m[k] = mk;
            v[k] = vk;
            let update = (mk / bias_1) / ((vk / bias_2).sqrt() + epsilon);
            let mut pk = p[k];
            if decayed {
                pk *= decay_factor;
            }
            p[k] = pk - update * lr;
        }
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
    }
    // A skipped step writes the old value back (in place, a no-op).
    master_out[i] = p;
    if write_model {
        model_out[i] = Vector::<P, N>::cast_from(p);
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
        true => (None, master),
        false => (Some(master), empty(n, DType::F32)),
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
    // The widest vector every buffer takes (4 f32 on CUDA), within one weight-decay block.
    let mut width = vector_width(&[&grad, &exp_avg, &exp_avg_sq, &master_out]);
    if let Some(model) = &model {
        width = width.min(vector_width(&[model]));
    }
    while !scalars.block.is_multiple_of(width) {
        width /= 2;
    }
    // Placeholders (never read or written) hold one vector.
    let master_in = master_in.unwrap_or_else(|| empty(width, DType::F32));
    let model_out = model.unwrap_or_else(|| empty(width, DType::F32));
    let vectors = n / width;
    let cubes = vectors.div_ceil(THREADS as usize) as u32;
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
        width,
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
        vectors as u32,
        in_place,
        write_model,
        dtype,
    );
    output
}
