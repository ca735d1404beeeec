//! Learning-rate schedules as Megatron's `OptimizerParamScheduler` computes them: linear
//! warm-up, then a constant, linear, cosine or warmup-stable-decay (WSD) decay to a minimum.
//!
//! A schedule is a pure function of the global step ([`LrSchedule::lr`]): every rank of every
//! layout computes the same learning rate, and the schedule advances once per global step
//! whatever the number of GPUs (Burn's DDP steps its scheduler on each worker instead).
//!
//! Megatron's `inverse-square-root` decay and its weight-decay increment schedule
//! (`--start-weight-decay`, `--end-weight-decay`) are not implemented.

use burn::config::Config;
use burn::optim::LearningRate;
use burn::optim::lr_scheduler::LrScheduler;
use burn::tensor::backend::Backend;

use crate::error::ConfigError;

/// How the learning rate falls from `max_lr` to `min_lr` after the warm-up: Megatron's
/// `--lr-decay-style`.
#[derive(Config, Debug, Copy, PartialEq)]
pub enum LrDecayStyle {
    /// `max_lr` for ever after the warm-up (`constant`).
    Constant,
    /// `min_lr + (1 - r) · (max_lr - min_lr)`, where `r` is the fraction of the decay done
    /// (`linear`).
    Linear,
    /// `min_lr + ½ (cos(π r) + 1) · (max_lr - min_lr)` (`cosine`).
    Cosine,
    /// Warmup-stable-decay (`WSD`): `max_lr` until the last `decay_steps` steps of the
    /// schedule, then an anneal of the given style to `min_lr`
    /// (`--lr-wsd-decay-iters`, `--lr-wsd-decay-style`).
    Wsd {
        /// Steps of the final anneal; at most the schedule's `decay_steps`.
        decay_steps: usize,
        /// The anneal's shape.
        style: WsdDecayStyle,
    },
}

/// The anneal of a [`LrDecayStyle::Wsd`] schedule, as a coefficient of `max_lr - min_lr` of
/// the anneal's progress `r` (from 0 to 1): Megatron's `--lr-wsd-decay-style`.
#[derive(Config, Debug, Copy, PartialEq)]
pub enum WsdDecayStyle {
    /// `1 - r`.
    Linear,
    /// `½ (cos(π r) + 1)`.
    Cosine,
    /// `2 · 0.5^r - 1`.
    Exponential,
    /// `1 - √r`.
    MinusSqrt,
}

impl WsdDecayStyle {
    fn coefficient(self, r: f64) -> f64 {
        match self {
            WsdDecayStyle::Linear => 1.0 - r,
            WsdDecayStyle::Cosine => cosine(r),
            WsdDecayStyle::Exponential => 2.0 * 0.5f64.powf(r) - 1.0,
            WsdDecayStyle::MinusSqrt => 1.0 - r.sqrt(),
        }
    }
}

fn cosine(r: f64) -> f64 {
    0.5 * ((core::f64::consts::PI * r).cos() + 1.0)
}

/// A learning-rate schedule in global steps: Megatron's `OptimizerParamScheduler`
/// (`megatron/core/optimizer_param_scheduler.py`), whose steps Megatron counts in samples
/// (iterations × global batch); the ratios, and so the learning rates, are the same.
#[derive(Config, Debug)]
pub struct LrScheduleConfig {
    /// The peak learning rate, reached at the end of the warm-up (`--lr`).
    pub max_lr: f64,
    /// The learning rate the decay ends at and stays at after `decay_steps` (`--min-lr`).
    #[config(default = 0.0)]
    pub min_lr: f64,
    /// The learning rate at step 0 of the warm-up (`--lr-warmup-init`).
    #[config(default = 0.0)]
    pub warmup_init_lr: f64,
    /// Steps of linear warm-up from `warmup_init_lr` to `max_lr` (`--lr-warmup-iters`); 0 for
    /// none.
    #[config(default = 0)]
    pub warmup_steps: usize,
    /// The step at which the decay reaches `min_lr` (`--lr-decay-iters`), counted from step 0
    /// (the warm-up included); more than `warmup_steps`. Ignored by the constant style.
    #[config(default = 0)]
    pub decay_steps: usize,
    /// The decay after the warm-up (`--lr-decay-style`).
    #[config(default = "LrDecayStyle::Cosine")]
    pub decay_style: LrDecayStyle,
}

impl LrScheduleConfig {
    /// The schedule, or a [`ConfigError`] saying which setting is inconsistent.
    pub fn init(&self) -> Result<LrSchedule, ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        for (name, value) in [
            ("max_lr (--lr)", self.max_lr),
            ("min_lr (--min-lr)", self.min_lr),
            ("warmup_init_lr", self.warmup_init_lr),
        ] {
            if !value.is_finite() || value < 0.0 {
                return invalid(format!(
                    "{name} is {value}: it must be a finite, non-negative learning rate"
                ));
            }
        }
        if self.min_lr > self.max_lr {
            return invalid(format!(
                "min_lr ({}) must not exceed max_lr ({})",
                self.min_lr, self.max_lr
            ));
        }
        if self.decay_style != LrDecayStyle::Constant && self.decay_steps <= self.warmup_steps {
            return invalid(format!(
                "decay_steps ({}) counts from step 0 and must exceed warmup_steps ({}): set \
                 it to the step at which the learning rate reaches min_lr",
                self.decay_steps, self.warmup_steps
            ));
        }
        if let LrDecayStyle::Wsd { decay_steps, .. } = self.decay_style
            && (decay_steps == 0 || decay_steps > self.decay_steps)
        {
            return invalid(format!(
                "the WSD anneal's decay_steps ({decay_steps}) must be in 1..={} (the \
                 schedule's decay_steps)",
                self.decay_steps
            ));
        }
        Ok(LrSchedule {
            config: self.clone(),
            step: 0,
        })
    }
}

/// A validated [`LrScheduleConfig`]: [`lr`](Self::lr) gives the learning rate of any global
/// step; as Burn's [`LrScheduler`] it yields step 0's, step 1's, … in turn.
///
/// ```
/// use burn_megatron::optimizer::{LrDecayStyle, LrScheduleConfig};
/// let schedule = LrScheduleConfig::new(1e-3)
///     .with_min_lr(1e-4)
///     .with_warmup_steps(10)
///     .with_decay_steps(110)
///     .with_decay_style(LrDecayStyle::Cosine)
///     .init()?;
/// assert_eq!(schedule.lr(0), 0.0);
/// assert_eq!(schedule.lr(10), 1e-3);
/// assert_eq!(schedule.lr(500), 1e-4);
/// # Ok::<_, burn_megatron::ConfigError>(())
/// ```
///
/// With Burn's optimizers: `model = optim.step(schedule.lr(step), model, grads)`, or
/// `LrScheduler::step(&mut schedule)` once per global step.
#[derive(Debug, Clone)]
pub struct LrSchedule {
    config: LrScheduleConfig,
    /// The step [`LrScheduler::step`] returns the learning rate of next.
    step: usize,
}

impl LrSchedule {
    /// The learning rate of global step `step` (0 is the first optimizer step).
    pub fn lr(&self, step: usize) -> f64 {
        let c = &self.config;
        let (max_lr, min_lr) = (c.max_lr, c.min_lr);
        if c.warmup_steps > 0 && step <= c.warmup_steps {
            return c.warmup_init_lr
                + (max_lr - c.warmup_init_lr) * step as f64 / c.warmup_steps as f64;
        }
        if c.decay_style == LrDecayStyle::Constant {
            return max_lr;
        }
        if step > c.decay_steps {
            return min_lr;
        }
        // Here warmup_steps < step <= decay_steps, so the ratio is in (0, 1].
        let decay_ratio = (step - c.warmup_steps) as f64 / (c.decay_steps - c.warmup_steps) as f64;
        let coefficient = match c.decay_style {
            LrDecayStyle::Constant => 1.0,
            LrDecayStyle::Linear => 1.0 - decay_ratio,
            LrDecayStyle::Cosine => cosine(decay_ratio),
            LrDecayStyle::Wsd { decay_steps, style } => {
                let anneal_start = c.decay_steps - decay_steps;
                if step <= anneal_start {
                    1.0
                } else {
                    style.coefficient((step - anneal_start) as f64 / decay_steps as f64)
                }
            }
        };
        min_lr + coefficient * (max_lr - min_lr)
    }

    /// The configuration.
    pub fn config(&self) -> &LrScheduleConfig {
        &self.config
    }

    /// The step whose learning rate [`LrScheduler::step`] returns next.
    pub fn next_step(&self) -> usize {
        self.step
    }

    /// The same schedule resumed at global step `step` (after loading a checkpoint).
    pub fn resumed_at(mut self, step: usize) -> Self {
        self.step = step;
        self
    }
}

/// Burn's scheduler interface: each call returns the learning rate of the next global step
/// (step 0 first, as Megatron's first iteration uses the rate of step 0), so call it once per
/// optimizer step, not once per microbatch or rank. The record is the next step.
impl LrScheduler for LrSchedule {
    type Record<B: Backend> = usize;

    fn step(&mut self) -> LearningRate {
        let lr = self.lr(self.step);
        self.step += 1;
        lr
    }

    fn to_record<B: Backend>(&self) -> Self::Record<B> {
        self.step
    }

    fn load_record<B: Backend>(self, record: Self::Record<B>) -> Self {
        self.resumed_at(record)
    }
}
