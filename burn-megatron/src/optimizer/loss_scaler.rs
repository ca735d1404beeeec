//! The dynamic loss scaler for fp16 training: Megatron's `DynamicGradScaler`
//! (`megatron/core/optimizer/grad_scaler.py`), kept on the device.
//!
//! fp16 gradients underflow unless the loss is scaled up before the backward pass. The scaler
//! multiplies the loss by `scale`; after the backward pass it checks every gradient for NaN
//! or ±∞ (over the model-parallel group) and divides the gradients by `scale` (before
//! clipping). A step whose gradients overflowed is skipped and the scale backs off; after
//! `growth_interval` clean steps in a row it grows.
//!
//! # No host read per step
//!
//! Megatron reads the overflow flag on the host (`found_inf.item()`) to decide whether to run
//! the optimizer, which makes every step wait for the device. Here the decision stays on the
//! device:
//!
//! - the flag ([`FoundInf`]) is a `[1]` device tensor, all-reduced (max) over the
//!   model-parallel group; DP ranks hold equal reduced gradients and so the same flag;
//! - the scale and its trackers are device tensors, updated by [`DynamicLossScaler::update`]
//!   with device-side selects;
//! - when the flag is set the gradients are zeroed (so no NaN or ∞ reaches the optimizer's
//!   state), the optimizer steps as usual, and [`FoundInf::select`] keeps every parameter's
//!   old value: the skipped step leaves the parameters bit for bit unchanged;
//! - the host reads the flag, the scale and the count of skipped steps only when it wants to
//!   (at the log interval): [`FoundInf::read`], [`DynamicLossScaler::skipped_steps`].
//!
//! One difference from Megatron remains, and is the price of not reading the flag: Burn's
//! optimizers keep their step count on the host and update their state for every step they
//! are given, so on a skipped step AdamW's moments see a zero gradient (they decay by β₁ and
//! β₂) and its bias-correction count advances. Where an exact skip of the optimizer state
//! matters more than a host read, branch on [`FoundInf::read`] (one sync per step, as
//! Megatron) and do not call the optimizer when it is `true`. Our flat-buffer optimizers have
//! no such difference: [`FlatAdamW::step_with`](super::FlatAdamW::step_with) takes the flag,
//! and with data parallelism
//! [`DistributedAdamW::step_scaled`](crate::optimizer::DistributedAdamW::step_scaled) does
//! the check itself on the reduced gradients, over every rank of the world.

use burn::config::Config;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Bool, DType, ElementConversion, Tensor, TensorData};
use burn_megatron_dist::{DistBackend, ProcessGroup, ReduceOp};

use super::grads::{Counted, Reduction, reduce_grads, scale_grads};
use crate::error::{ConfigError, DeviceError, read_scalar};

/// The dynamic loss scaler's settings; the defaults are Megatron's.
#[derive(Config, Debug, Copy, PartialEq)]
pub struct LossScalerConfig {
    /// The scale of the first step (`--initial-loss-scale`, 2³²). The scaled loss must not
    /// overflow its dtype: keep the loss in f32 (ours is); Megatron's 2³² assumes fp16
    /// activations with f32 loss and main gradients, so with fp16 gradients start lower
    /// (2¹⁶, say) and let the scaler find its level.
    #[config(default = 4294967296.0)]
    pub initial_scale: f64,
    /// The scale never backs off below this (`--min-loss-scale`).
    #[config(default = 1.0)]
    pub min_scale: f64,
    /// The scale is multiplied by this after `growth_interval` clean steps.
    #[config(default = 2.0)]
    pub growth_factor: f64,
    /// The scale is multiplied by this when an overflow backs it off.
    #[config(default = 0.5)]
    pub backoff_factor: f64,
    /// Clean steps in a row before the scale grows (`--loss-scale-window`).
    #[config(default = 1000)]
    pub growth_interval: usize,
    /// Overflowing steps (since the last growth) before the scale backs off (`--hysteresis`);
    /// 1 backs off at every overflow.
    #[config(default = 2)]
    pub hysteresis: usize,
}

impl LossScalerConfig {
    /// The scaler on `device`, or a [`ConfigError`] for an inconsistent setting.
    pub fn init<B: Backend>(
        &self,
        device: &B::Device,
    ) -> core::result::Result<DynamicLossScaler<B>, ConfigError> {
        self.validate()?;
        let scalar = |v: f64| {
            Tensor::<B, 1>::from_data(TensorData::new(vec![v as f32], [1]), (device, DType::F32))
        };
        Ok(DynamicLossScaler {
            config: *self,
            scale: scalar(self.initial_scale),
            growth_tracker: scalar(0.0),
            hysteresis_tracker: scalar(self.hysteresis as f64),
            skipped: scalar(0.0),
        })
    }

    /// A [`ConfigError`] for an inconsistent setting.
    pub fn validate(&self) -> core::result::Result<(), ConfigError> {
        let positive = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(ConfigError::Invalid(format!(
                    "the loss scaler's {name} ({v}) must be positive and finite"
                )))
            }
        };
        positive("initial_scale", self.initial_scale)?;
        positive("min_scale", self.min_scale)?;
        if self.growth_factor <= 1.0 || !self.growth_factor.is_finite() {
            return Err(ConfigError::Invalid(format!(
                "the loss scaler's growth_factor ({}) must be above 1",
                self.growth_factor
            )));
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return Err(ConfigError::Invalid(format!(
                "the loss scaler's backoff_factor ({}) must be in (0, 1)",
                self.backoff_factor
            )));
        }
        if self.growth_interval == 0 || self.hysteresis == 0 {
            return Err(ConfigError::Invalid(format!(
                "the loss scaler's growth_interval ({}) and hysteresis ({}) must be at least 1",
                self.growth_interval, self.hysteresis
            )));
        }
        Ok(())
    }
}

/// Megatron's `DynamicGradScaler` with its state on the device (see the [module
/// docs](self)). One step of a whole model (`chunks = [model]`):
///
/// ```ignore
/// let loss = scaler.scale_loss(loss); // before backward
/// let mut grads = vec![GradientsParams::from_grads(loss.backward(), &model)];
/// let found = scaler.unscale_and_check(std::slice::from_ref(&model), &mut grads,
///     state.model_parallel())?;
/// let norm = clip_grad_norm(std::slice::from_ref(&model), &mut grads, &state, &clip)?;
/// let stepped = optim.step(lr, model.clone(), grads.remove(0));
/// model = found.select(model, stepped); // the old parameters if the step overflowed
/// scaler.update(&found);
/// ```
#[derive(Debug, Clone)]
pub struct DynamicLossScaler<B: Backend> {
    config: LossScalerConfig,
    /// `[1]` f32: the current scale.
    scale: Tensor<B, 1>,
    /// `[1]` f32: clean steps since the last overflow or growth.
    growth_tracker: Tensor<B, 1>,
    /// `[1]` f32: overflows left before the scale backs off.
    hysteresis_tracker: Tensor<B, 1>,
    /// `[1]` f32: steps skipped so far.
    skipped: Tensor<B, 1>,
}

/// The scaler's state read to the host, for checkpoints (`TrainingState::loss_scaler`):
/// resuming with it continues the scale's schedule exactly where it stopped. The values are
/// the device's f32 values (exact in JSON: each is an f32).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossScalerState {
    /// The current scale.
    pub scale: f32,
    /// Clean steps since the last overflow or growth.
    pub growth_tracker: f32,
    /// Overflows left before the scale backs off.
    pub hysteresis_tracker: f32,
    /// Steps skipped so far.
    pub skipped_steps: f32,
}

/// Whether a step's gradients held a NaN or an infinity on any rank of the model-parallel
/// group: a `[1]` f32 device tensor, 1 if so and 0 if not.
#[derive(Debug, Clone)]
pub struct FoundInf<B: Backend> {
    flag: Tensor<B, 1>,
}

impl<B: Backend> FoundInf<B> {
    /// A flag from a `[1]` f32 tensor (1: overflow, 0: clean), for a check of one's own.
    pub fn new(flag: Tensor<B, 1>) -> Self {
        Self { flag }
    }

    /// The flag as a `[1]` f32 device tensor (1: overflow, 0: clean).
    pub fn flag(&self) -> Tensor<B, 1> {
        self.flag.clone()
    }

    /// Reads the flag on the host: a sync with the device. For logging, or for an exact
    /// Megatron skip (do not call the optimizer when `true`). A device error is a
    /// [`DeviceError`].
    pub fn read(&self) -> core::result::Result<bool, DeviceError> {
        let flag = read_scalar(self.flag.clone(), || "the found-inf flag".to_string())?;
        Ok(flag.elem::<f32>() > 0.0)
    }

    fn mask<const D: usize>(&self, shape: [usize; D]) -> Tensor<B, D, Bool> {
        self.flag
            .clone()
            .greater_elem(0.0)
            .reshape([1; D])
            .expand(shape)
    }

    /// `after`'s parameters, or `before`'s where the flag is set, selected on the device:
    /// apply it to the model the optimizer returned, with `before` the model it was given.
    /// The two must be the same module (the optimizer keeps parameter ids); a parameter of
    /// `after` missing from `before` keeps `after`'s value.
    pub fn select<BA, M>(&self, before: M, after: M) -> M
    where
        BA: AutodiffBackend<InnerBackend = B>,
        M: Module<BA>,
    {
        struct Collect(GradientsParams);
        impl<BA: AutodiffBackend> ModuleVisitor<BA> for Collect {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<BA, D>>) {
                self.0.register(param.id, param.val().inner());
            }
        }
        struct Select<'a, B: Backend> {
            before: GradientsParams,
            found: &'a FoundInf<B>,
        }
        impl<BA: AutodiffBackend> ModuleMapper<BA> for Select<'_, BA::InnerBackend> {
            fn map_float<const D: usize>(
                &mut self,
                param: Param<Tensor<BA, D>>,
            ) -> Param<Tensor<BA, D>> {
                let Some(old) = self.before.remove::<BA::InnerBackend, D>(param.id) else {
                    return param;
                };
                let found = self.found;
                param.map(|new| {
                    let require_grad = new.is_require_grad();
                    let new = new.inner();
                    let mask = found.mask(new.dims());
                    let kept = Tensor::from_inner(new.mask_where(mask, old));
                    if require_grad {
                        kept.require_grad()
                    } else {
                        kept
                    }
                })
            }
        }
        let mut collect = Collect(GradientsParams::new());
        before.visit(&mut collect);
        after.map(&mut Select {
            before: collect.0,
            found: self,
        })
    }
}

impl<B: DistBackend> DynamicLossScaler<B> {
    /// The settings.
    pub fn config(&self) -> &LossScalerConfig {
        &self.config
    }

    /// The current scale, `[1]` f32 on the device.
    pub fn scale(&self) -> Tensor<B, 1> {
        self.scale.clone()
    }

    /// Steps skipped so far, `[1]` f32 on the device: read it at the log interval.
    pub fn skipped_steps(&self) -> Tensor<B, 1> {
        self.skipped.clone()
    }

    /// The state, read to the host (one sync with the device): for a checkpoint. A device
    /// error is a [`DeviceError`] naming the value.
    pub fn state(&self) -> core::result::Result<LossScalerState, DeviceError> {
        let read = |t: &Tensor<B, 1>, name: &str| {
            let what = || format!("the loss scaler's {name}");
            Ok::<_, DeviceError>(read_scalar(t.clone(), what)?.elem::<f32>())
        };
        Ok(LossScalerState {
            scale: read(&self.scale, "scale")?,
            growth_tracker: read(&self.growth_tracker, "growth tracker")?,
            hysteresis_tracker: read(&self.hysteresis_tracker, "hysteresis tracker")?,
            skipped_steps: read(&self.skipped, "skipped-step count")?,
        })
    }

    /// Continues from `state` (a checkpoint's): the settings stay this scaler's. A scale that
    /// is not positive and finite is an error, as a corrupt checkpoint would give.
    pub fn load_state(&mut self, state: &LossScalerState) -> core::result::Result<(), ConfigError> {
        if !(state.scale.is_finite() && state.scale > 0.0) {
            return Err(ConfigError::Invalid(format!(
                "the saved loss scale ({}) must be positive and finite",
                state.scale
            )));
        }
        let device = self.scale.device();
        let scalar = |v: f32| {
            Tensor::<B, 1>::from_data(TensorData::new(vec![v], [1]), (&device, DType::F32))
        };
        self.scale = scalar(state.scale);
        self.growth_tracker = scalar(state.growth_tracker);
        self.hysteresis_tracker = scalar(state.hysteresis_tracker);
        self.skipped = scalar(state.skipped_steps);
        Ok(())
    }

    /// `loss · scale`, to call `backward` on. The scale is a constant of the graph.
    pub fn scale_loss<BA: AutodiffBackend<InnerBackend = B>>(
        &self,
        loss: Tensor<BA, 1>,
    ) -> Tensor<BA, 1> {
        let scale = self.scale.clone().cast(loss.dtype());
        loss * Tensor::from_inner(scale)
    }

    /// Checks the gradients of this rank's model chunks (`grads[i]` of `chunks[i]`) for NaN
    /// and ±∞, reduces the flag over `model_parallel` (every rank of it must call this), and
    /// divides the gradients by the scale. If any rank found an overflow, every gradient is
    /// set to zero, so that the optimizer's state stays finite (see the [module docs](self)).
    pub fn unscale_and_check<BA, M>(
        &self,
        chunks: &[M],
        grads: &mut [GradientsParams],
        model_parallel: &ProcessGroup,
    ) -> crate::Result<FoundInf<B>>
    where
        BA: AutodiffBackend<InnerBackend = B>,
        M: Module<BA>,
    {
        if chunks.len() != grads.len() {
            return Err(ConfigError::Invalid(format!(
                "{} model chunks but {} sets of gradients: pass one per chunk",
                chunks.len(),
                grads.len()
            ))
            .into());
        }
        let device = self.scale.device();
        let every = Counted::Every;
        let mut local = Tensor::<B, 1>::zeros([1], (&device, DType::F32));
        for (chunk, chunk_grads) in chunks.iter().zip(grads.iter()) {
            local =
                local + reduce_grads(chunk, chunk_grads, Reduction::NonFinite, &every, &device)?;
        }
        let flag = model_parallel
            .all_reduce(local, ReduceOp::Max)?
            .clamp_max(1.0);
        let found = FoundInf { flag };
        // 1/scale where clean, 0 where an overflow was found; the zeroing must not multiply
        // (∞ · 0 is NaN), so non-finite values are masked to zero first.
        let factor = self.scale.clone().recip() * (found.flag.clone().neg() + 1.0);
        for (chunk, chunk_grads) in chunks.iter().zip(grads.iter_mut()) {
            zero_non_finite(chunk, chunk_grads);
            scale_grads(chunk, chunk_grads, &factor);
        }
        Ok(found)
    }

    /// Advances the scale after a step with overflow flag `found`, on the device: an
    /// overflow resets the growth count and uses up one step of hysteresis, backing the scale
    /// off (× `backoff_factor`, not below `min_scale`) when none is left;
    /// `growth_interval` clean steps in a row grow it (× `growth_factor`) and restore the
    /// hysteresis.
    pub fn update(&mut self, found: &FoundInf<B>) {
        let c = self.config;
        let f = found.flag.clone();
        let clean = f.clone().neg() + 1.0;
        let growth = (self.growth_tracker.clone() + 1.0) * clean.clone();
        let hysteresis = self.hysteresis_tracker.clone() - f.clone();
        let back_off = f
            .clone()
            .greater_elem(0.0)
            .bool_and(hysteresis.clone().lower_equal_elem(0.0));
        let grow = clean
            .greater_elem(0.0)
            .bool_and(growth.clone().greater_equal_elem(c.growth_interval as f32));
        let backed_off = (self.scale.clone() * c.backoff_factor).clamp_min(c.min_scale);
        let grown = self.scale.clone() * c.growth_factor;
        self.scale = self
            .scale
            .clone()
            .mask_where(back_off, backed_off)
            .mask_where(grow.clone(), grown);
        self.growth_tracker = growth.mask_fill(grow.clone(), 0.0);
        self.hysteresis_tracker = hysteresis.mask_fill(grow, c.hysteresis as f32);
        self.skipped = self.skipped.clone() + f;
    }
}

/// Sets every NaN and ±∞ of `module`'s gradients in `grads` to zero.
fn zero_non_finite<BA: AutodiffBackend, M: Module<BA>>(module: &M, grads: &mut GradientsParams) {
    struct Zero<'a>(&'a mut GradientsParams);
    impl<BA: AutodiffBackend> ModuleVisitor<BA> for Zero<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<BA, D>>) {
            if let Some(grad) = self.0.remove::<BA::InnerBackend, D>(param.id) {
                let bad = grad.clone().is_finite().bool_not();
                self.0.register(param.id, grad.mask_fill(bad, 0.0));
            }
        }
    }
    module.visit(&mut Zero(grads));
}
