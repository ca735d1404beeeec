//! AdamW over flat buffers with fp32 master weights: Megatron's mixed-precision optimizer
//! (`Float16OptimizerWithFloat16Params` with a fused Adam) for one model chunk.
//!
//! [`FlatAdamW`] owns a [`ParamAndGradBuffer`] (fp32 master weights and gradients) and the fp32
//! moments as buffers of the same layout. One step:
//!
//! 1. the step's gradients are copied into the flat fp32 gradient buffer (per parameter: a cast
//!    if it is not f32, and a `slice_assign`);
//! 2. [`AdamWOps::flat_adamw`] updates master weights and moments: one kernel on CubeCL
//!    backends, which also writes the weights in the model's dtype (bf16, f16) when that is not
//!    f32; the plain Burn composition elsewhere;
//! 3. the step count (a device scalar) advances unless the step was skipped;
//! 4. every parameter of the model becomes a slice of the updated buffer (a view where the
//!    backend's alignment allows: no launch).
//!
//! The weight-decay policy applies per parameter (no decay on biases and norms by default),
//! the gradients may be scaled by a device scalar (a clip coefficient from
//! [`clip_coefficient`](super::clip_coefficient), a loss scale's reciprocal), and a loss
//! scaler's [`FoundInf`] flag skips the step on the device: parameters, moments and step count
//! stay exactly as they were, with no host read.
//!
//! ```ignore
//! let mut optim = FlatAdamWConfig::new().init(&model)?;
//! for step in 0.. {
//!     let grads = GradientsParams::from_grads(loss.backward(), &model);
//!     model = optim.step(schedule.lr(step), model, &grads)?;
//! }
//! ```

use std::collections::{BTreeMap, HashMap};

use burn::config::Config;
use burn::module::{AutodiffModule, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor, TensorData};

use super::check_indexable;
use super::state::{OptimizerState, ParamState};
use super::{FoundInf, WeightDecayPolicy};
use crate::ModelBackend;
use crate::distributed::{BufferConfig, BufferLayout, ParamAndGradBuffer};
use crate::error::{ConfigError, DeviceError, read_data, unshared};
use crate::ops::adamw::{AdamWOps, AdamWScalars, FlatAdamWBuffers};
use crate::tensor_parallel::DeclarePlacements;

/// The optimizer state's name in checkpoints, with the master weights saved next to the
/// moments as `main_param`.
pub const FLAT_ADAMW: &str = "adamw";

/// AdamW over flat buffers (see the [module docs](self)). The defaults are Burn's AdamW's
/// except `epsilon` (Megatron's and PyTorch's 1e-8).
#[derive(Config, Debug, Copy, PartialEq)]
pub struct FlatAdamWConfig {
    /// Decay of the first moment (`--adam-beta1`).
    #[config(default = 0.9)]
    pub beta_1: f64,
    /// Decay of the second moment (`--adam-beta2`).
    #[config(default = 0.999)]
    pub beta_2: f64,
    /// Added to `sqrt(v̂)` (`--adam-eps`).
    #[config(default = 1e-8)]
    pub epsilon: f64,
    /// Decoupled weight decay (`--weight-decay`), for the parameters the policy decays.
    #[config(default = 1e-4)]
    pub weight_decay: f64,
    /// Which parameter kinds decay (biases and norms are exempt by default).
    #[config(default = "WeightDecayPolicy::new()")]
    pub decay_policy: WeightDecayPolicy,
    /// The flat buffers' layout (alignment, DP shards).
    #[config(default = "BufferConfig::new()")]
    pub buffer: BufferConfig,
}

impl FlatAdamWConfig {
    /// Checks the betas (in `[0, 1)`), epsilon (positive and finite) and weight decay (finite,
    /// non-negative); NaN fails every check. Each error names the setting, its
    /// `pretrain_gpt` option and the valid range.
    pub fn validate(&self) -> core::result::Result<(), ConfigError> {
        for (name, option, beta) in [
            ("beta_1", "--adam-beta1", self.beta_1),
            ("beta_2", "--adam-beta2", self.beta_2),
        ] {
            if !(0.0..1.0).contains(&beta) {
                return Err(ConfigError::Invalid(format!(
                    "AdamW's {name} ({option}) is {beta}: it must be in [0, 1)"
                )));
            }
        }
        if !(self.epsilon.is_finite() && self.epsilon > 0.0) {
            return Err(ConfigError::Invalid(format!(
                "AdamW's epsilon (--adam-eps) is {}: it must be positive and finite",
                self.epsilon
            )));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(ConfigError::Invalid(format!(
                "AdamW's weight_decay (--weight-decay) is {}: it must be finite and at least 0",
                self.weight_decay
            )));
        }
        self.buffer.validate()
    }

    /// The optimizer for `model` (one model chunk): its buffers laid out from the model's
    /// parameters, the master weights copied from them, the moments zero. Its one flat buffer
    /// must stay within [`MAX_FLAT_NUMEL`](super::MAX_FLAT_NUMEL) elements (32-bit indices):
    /// past that it is refused before anything is allocated, as
    /// [`DistributedAdamW`](super::DistributedAdamW), which cuts its buffers into parts below
    /// the limit, is the optimizer for such a rank.
    pub fn init<B, M>(&self, model: &M) -> crate::Result<FlatAdamW<B>>
    where
        B: AutodiffBackend,
        B::InnerBackend: ModelBackend,
        M: AutodiffModule<B> + DeclarePlacements,
    {
        self.validate()?;
        let infos = crate::tensor_parallel::try_param_infos(model)?;
        check_indexable(
            BufferLayout::new(&infos, self.buffer)?.numel(),
            "FlatAdamW's flat buffer",
            "--tensor-model-parallel-size or --pipeline-model-parallel-size; or step it with \
             DistributedAdamW, which cuts its flat buffers into parts below the limit",
        )?;
        let buffer = ParamAndGradBuffer::from_module(model, self.buffer)?;
        let layout = buffer.layout();
        let device = buffer.main_params().device();
        let policy = self.decay_policy;
        let flags = layout.block_flags(|slot| policy.decays(slot.kind));
        let f32_tensor = |values: Vec<f32>| {
            let len = values.len();
            Tensor::from_data(TensorData::new(values, [len]), (&device, DType::F32))
        };
        let zeros = || Tensor::zeros([layout.numel()], (&device, DType::F32));
        Ok(FlatAdamW {
            config: *self,
            exp_avg: zeros(),
            exp_avg_sq: zeros(),
            decay: f32_tensor(flags),
            step: f32_tensor(vec![0.0]),
            one: f32_tensor(vec![1.0]),
            zero: f32_tensor(vec![0.0]),
            buffer,
        })
    }
}

/// What else a step takes, all on the device.
#[derive(Debug, Clone)]
pub struct StepScalars<B: burn::tensor::backend::Backend> {
    /// `[1]` f32 multiplying every gradient in the kernel: a clip coefficient
    /// ([`clip_coefficient`](super::clip_coefficient) of the global norm), the reciprocal of a
    /// loss scale, or their product. `None`: 1.
    pub grad_factor: Option<Tensor<B, 1>>,
    /// The loss scaler's overflow flag: set, the step changes nothing. `None`: never skip.
    pub found_inf: Option<FoundInf<B>>,
}

impl<B: burn::tensor::backend::Backend> Default for StepScalars<B> {
    fn default() -> Self {
        Self {
            grad_factor: None,
            found_inf: None,
        }
    }
}

/// AdamW over a model chunk's flat buffers, with fp32 master weights and moments (see the
/// [module docs](self)). `B` is the autodiff backend the model trains on.
#[derive(Debug, Clone)]
pub struct FlatAdamW<B: AutodiffBackend> {
    config: FlatAdamWConfig,
    buffer: ParamAndGradBuffer<B::InnerBackend>,
    /// `[numel]` f32 first moments.
    exp_avg: Tensor<B::InnerBackend, 1>,
    /// `[numel]` f32 second moments.
    exp_avg_sq: Tensor<B::InnerBackend, 1>,
    /// `[numel / param_alignment]` f32 weight-decay flags.
    decay: Tensor<B::InnerBackend, 1>,
    /// `[1]` f32: steps taken (skipped ones not counted).
    step: Tensor<B::InnerBackend, 1>,
    one: Tensor<B::InnerBackend, 1>,
    zero: Tensor<B::InnerBackend, 1>,
}

impl<B> FlatAdamW<B>
where
    B: AutodiffBackend,
    B::InnerBackend: ModelBackend,
{
    /// The settings.
    pub fn config(&self) -> &FlatAdamWConfig {
        &self.config
    }

    /// The flat buffers (layout, master weights, last gradients).
    pub fn buffer(&self) -> &ParamAndGradBuffer<B::InnerBackend> {
        &self.buffer
    }

    /// Steps taken, `[1]` f32 on the device (skipped steps not counted).
    pub fn step_count(&self) -> Tensor<B::InnerBackend, 1> {
        self.step.clone()
    }

    /// One AdamW step at learning rate `lr` with `model`'s gradients `grads`; returns the
    /// updated model. Every parameter of `model` needs a gradient of its shape.
    pub fn step<M: AutodiffModule<B>>(
        &mut self,
        lr: f64,
        model: M,
        grads: &GradientsParams,
    ) -> crate::Result<M> {
        self.step_with(lr, model, grads, StepScalars::default())
    }

    /// [`step`](Self::step) with gradients scaled by `scalars.grad_factor` and skipped when
    /// `scalars.found_inf` is set, both read on the device.
    pub fn step_with<M: AutodiffModule<B>>(
        &mut self,
        lr: f64,
        model: M,
        grads: &GradientsParams,
        scalars: StepScalars<B::InnerBackend>,
    ) -> crate::Result<M> {
        self.buffer.gather_grads(&model, grads)?;
        let c = &self.config;
        let hyper = AdamWScalars::new(
            lr,
            c.beta_1,
            c.beta_2,
            c.epsilon,
            c.weight_decay,
            c.buffer.param_alignment,
        );
        let found_inf = scalars.found_inf.map(|f| f.flag());
        let model_dtype = self.buffer.model_dtype();
        // Moved out so that the kernel may update them in place.
        let take = |t: &mut Tensor<B::InnerBackend, 1>| {
            let device = t.device();
            std::mem::replace(t, Tensor::empty([0], (&device, DType::F32)))
        };
        let buffers = FlatAdamWBuffers {
            master: self.buffer.take_main_params(),
            grad: self.buffer.grads(),
            exp_avg: take(&mut self.exp_avg),
            exp_avg_sq: take(&mut self.exp_avg_sq),
            decay: self.decay.clone(),
            step: self.step.clone(),
            grad_factor: scalars.grad_factor.unwrap_or_else(|| self.one.clone()),
            found_inf: found_inf.clone().unwrap_or_else(|| self.zero.clone()),
        };
        // The master weights are unique to the buffer unless an f32 model views them.
        let master_out = {
            let out = <B::InnerBackend as AdamWOps>::flat_adamw(
                buffers,
                &hyper,
                (model_dtype != DType::F32).then_some(model_dtype),
            );
            self.exp_avg = out.exp_avg;
            self.exp_avg_sq = out.exp_avg_sq;
            self.buffer.set_main_params(out.master.clone());
            self.buffer.release_grads();
            out.model.unwrap_or(out.master)
        };
        self.step = match found_inf {
            Some(flag) => self.step.clone() + flag.neg().add_scalar(1.0),
            None => self.step.clone().add_scalar(1.0),
        };
        Ok(self.buffer.write_params(model, master_out))
    }

    /// The state of every parameter, keyed by id as the checkpoint code takes it
    /// (`checkpointing::OptimizerState`, kind `"adamw"`): `exp_avg`, `exp_avg_sq` and the fp32
    /// master weights `main_param`, each of the parameter's local shape, f32. Reads the
    /// buffers back to the host: a device error is a [`DeviceError`] naming the buffer.
    pub fn state(&self) -> core::result::Result<OptimizerState, DeviceError> {
        let step = read_buffer(&self.step, "the optimizer's step count")?;
        let step = step.first().copied().unwrap_or(0.0) as u64;
        let host = |t: &Tensor<B::InnerBackend, 1>, name: &str| {
            read_buffer(
                t,
                &format!("the optimizer's {name} buffer for a checkpoint"),
            )
        };
        let buffers = [
            (
                "main_param",
                host(&self.buffer.main_params(), "main_param")?,
            ),
            ("exp_avg", host(&self.exp_avg, "exp_avg")?),
            ("exp_avg_sq", host(&self.exp_avg_sq, "exp_avg_sq")?),
        ];
        let params = self
            .buffer
            .layout()
            .params()
            .iter()
            .map(|slot| {
                let tensors = buffers
                    .iter()
                    .map(|(name, values)| {
                        let data =
                            TensorData::new(values[slot.range()].to_vec(), slot.shape.clone());
                        (name.to_string(), data)
                    })
                    .collect::<BTreeMap<_, _>>();
                (
                    slot.id,
                    ParamState {
                        step,
                        tensors,
                        range: None,
                    },
                )
            })
            .collect::<HashMap<ParamId, ParamState>>();
        Ok(OptimizerState {
            kind: FLAT_ADAMW.to_string(),
            params,
            dp_sharded: false,
        })
    }

    /// Loads `state` (as [`state`](Self::state) gives it, keyed by this model's parameter ids)
    /// into the buffers: each tensor found replaces its parameter's slice; a parameter or
    /// tensor absent from `state` keeps its values. The step count is the largest saved one.
    /// A tensor of the wrong shape is a [`ConfigError`] naming it. Load the model's parameters
    /// from the same checkpoint: they are not written here.
    pub fn load_state(&mut self, state: &OptimizerState) -> crate::Result<()> {
        let device = self.step.device();
        let host = |t: &Tensor<B::InnerBackend, 1>, name: &str| {
            read_buffer(
                t,
                &format!("the optimizer's {name} buffer to load a checkpoint into"),
            )
        };
        let mut buffers = [
            (
                "main_param",
                host(&self.buffer.main_params(), "main_param")?,
            ),
            ("exp_avg", host(&self.exp_avg, "exp_avg")?),
            ("exp_avg_sq", host(&self.exp_avg_sq, "exp_avg_sq")?),
        ];
        let mut step = 0;
        for slot in self.buffer.layout().params() {
            let Some(saved) = state.params.get(&slot.id) else {
                continue;
            };
            step = step.max(saved.step);
            for (name, values) in buffers.iter_mut() {
                let Some(data) = saved.tensors.get(*name) else {
                    continue;
                };
                let loaded = data
                    .clone()
                    .convert::<f32>()
                    .to_vec::<f32>()
                    .expect("converted to f32");
                if data.shape.as_slice() != slot.shape.as_slice() {
                    return Err(ConfigError::Invalid(format!(
                        "the saved {name} of {} has shape {:?}, the parameter {:?}",
                        slot.path, data.shape, slot.shape
                    ))
                    .into());
                }
                values[slot.range()].copy_from_slice(&loaded);
            }
        }
        let tensor = |values: Vec<f32>| {
            let len = values.len();
            Tensor::from_data(TensorData::new(values, [len]), (&device, DType::F32))
        };
        let [(_, main), (_, m), (_, v)] = buffers;
        self.buffer.set_main_params(tensor(main));
        self.exp_avg = tensor(m);
        self.exp_avg_sq = tensor(v);
        self.step = tensor(vec![step as f32]);
        Ok(())
    }
}
/// A flat buffer's values on the host, as f32; a device error names `what`.
fn read_buffer<B: burn::tensor::backend::Backend>(
    buffer: &Tensor<B, 1>,
    what: &str,
) -> core::result::Result<Vec<f32>, DeviceError> {
    let data = read_data(unshared(buffer.clone().cast(DType::F32)), || {
        what.to_string()
    })?;
    data.convert::<f32>()
        .to_vec::<f32>()
        .map_err(|e| DeviceError {
            rank: None,
            what: what.to_string(),
            message: format!("{e:?}"),
        })
}
