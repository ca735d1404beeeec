//! The metrics Megatron logs and burn-train lacks: tokens/s, TFLOP/s per device and MFU, the
//! global gradient norm, perplexity, the largest rank's memory and the MoE layers' losses,
//! load and dropped assignments, read from a step's [`LanguageModelStats`].
//!
//! Throughput is the step's tokens (or FLOPs) over the wall time since the previous step's
//! update; the first step after a [`clear`](Metric::clear) has no previous one and is given
//! no weight in the running value.

use std::sync::Arc;
use std::time::Instant;

use burn::train::metric::state::{FormatOptions, NumericMetricState};
use burn::train::metric::{
    Adaptor, Metric, MetricAttributes, MetricMetadata, MetricName, Numeric, NumericAttributes,
    NumericEntry, SerializedEntry,
};

use super::output::LanguageModelStats;

/// Peak dense bf16 throughput of one H100 SXM (989 TFLOP/s), the MFU denominator Megatron
/// and our benchmarks use.
pub const H100_BF16_PEAK_FLOPS: f64 = 989e12;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Stat {
    TokensPerSecond,
    TflopsPerDevice,
    Mfu { peak_flops_per_device: f64 },
    GradNorm,
    Perplexity,
    MemoryGib,
    LossScale,
    Moe(MoeStat),
}

/// A value of the step's [`MoeReport`](crate::training::MoeReport).
#[derive(Debug, Clone, Copy, PartialEq)]
enum MoeStat {
    LoadBalancingLoss,
    ZLoss,
    ExpertLoadMin,
    ExpertLoadMax,
    DroppedPercent,
}

impl Stat {
    fn needs_time(self) -> bool {
        matches!(
            self,
            Stat::TokensPerSecond | Stat::TflopsPerDevice | Stat::Mfu { .. }
        )
    }
}

/// Metric names are file names in burn-train's metric logs, so they hold no `/`.
///
/// A numeric metric of a language model's steps (burn-train `Metric` + `Numeric`); build one
/// with [`tokens_per_second`](Self::tokens_per_second), [`tflops_per_device`](Self::tflops_per_device),
/// [`mfu`](Self::mfu), [`grad_norm`](Self::grad_norm), [`perplexity`](Self::perplexity) or
/// [`memory`](Self::memory).
#[derive(Clone)]
pub struct LanguageModelMetric {
    name: MetricName,
    stat: Stat,
    unit: Option<&'static str>,
    state: NumericMetricState,
    previous: Option<Instant>,
}

impl LanguageModelMetric {
    fn new(name: &str, stat: Stat, unit: Option<&'static str>) -> Self {
        Self {
            name: Arc::new(name.to_string()),
            stat,
            unit,
            state: NumericMetricState::default(),
            previous: None,
        }
    }

    /// Tokens per second over the whole world.
    pub fn tokens_per_second() -> Self {
        Self::new("Tokens per second", Stat::TokensPerSecond, Some("tok/s"))
    }

    /// Model TFLOP/s per device (Megatron's FLOPs count over the step's wall time).
    pub fn tflops_per_device() -> Self {
        Self::new(
            "Model TFLOPS per device",
            Stat::TflopsPerDevice,
            Some("TFLOP/s"),
        )
    }

    /// Model FLOPs utilisation: TFLOP/s per device over `peak_flops_per_device` (FLOP/s), in
    /// percent ([`H100_BF16_PEAK_FLOPS`] for bf16 on an H100).
    pub fn mfu(peak_flops_per_device: f64) -> Self {
        Self::new(
            "MFU",
            Stat::Mfu {
                peak_flops_per_device,
            },
            Some("%"),
        )
    }

    /// The global gradient norm before clipping.
    pub fn grad_norm() -> Self {
        Self::new("Grad norm", Stat::GradNorm, None)
    }

    /// Device memory in use after the step, the largest over all ranks, in GiB (backends
    /// that track memory: GPUs).
    pub fn memory() -> Self {
        Self::new("Memory of the largest rank", Stat::MemoryGib, Some("GiB"))
    }

    /// fp16's loss scale of the step.
    pub fn loss_scale() -> Self {
        Self::new("Loss scale", Stat::LossScale, None)
    }

    /// `exp(loss)`: perplexity of the step's tokens.
    pub fn perplexity() -> Self {
        Self::new("Perplexity", Stat::Perplexity, None)
    }

    /// The MoE layers' load-balancing losses, summed over the layers (coefficients included),
    /// averaged over DP × CP ([`MoeReport::load_balancing_loss`](crate::training::MoeReport)).
    pub fn load_balancing_loss() -> Self {
        Self::new(
            "Load-balancing loss",
            Stat::Moe(MoeStat::LoadBalancingLoss),
            None,
        )
    }

    /// The MoE layers' z-losses, as [`load_balancing_loss`](Self::load_balancing_loss).
    pub fn z_loss() -> Self {
        Self::new("Z-loss", Stat::Moe(MoeStat::ZLoss), None)
    }

    /// The least-loaded expert of any MoE layer over the layer's mean (1: balanced).
    pub fn expert_load_min() -> Self {
        Self::new("Expert load min", Stat::Moe(MoeStat::ExpertLoadMin), None)
    }

    /// The most-loaded expert of any MoE layer over the layer's mean (1: balanced).
    pub fn expert_load_max() -> Self {
        Self::new("Expert load max", Stat::Moe(MoeStat::ExpertLoadMax), None)
    }

    /// The step's assignments dropped by over-full experts, in percent of those routed (MoE
    /// layers with a capacity).
    pub fn dropped_assignments() -> Self {
        Self::new(
            "Dropped assignments",
            Stat::Moe(MoeStat::DroppedPercent),
            Some("%"),
        )
    }

    /// The statistic of `stats` and its weight in the running value.
    fn measure(&mut self, stats: &LanguageModelStats) -> (f64, usize) {
        let seconds = if self.stat.needs_time() {
            let now = Instant::now();
            let previous = self.previous.replace(now);
            match previous {
                Some(then) => now.duration_since(then).as_secs_f64(),
                None => return (0.0, 0),
            }
        } else {
            0.0
        };
        let per_device = |flops: f64| flops / seconds / stats.devices.max(1) as f64;
        match self.stat {
            Stat::TokensPerSecond => (stats.tokens as f64 / seconds, 1),
            Stat::TflopsPerDevice => (per_device(stats.flops) / 1e12, 1),
            Stat::Mfu {
                peak_flops_per_device,
            } => (100.0 * per_device(stats.flops) / peak_flops_per_device, 1),
            Stat::GradNorm => match stats.grad_norm {
                Some(norm) => (norm, 1),
                None => (f64::NAN, 0),
            },
            Stat::Perplexity => (stats.loss.exp(), stats.tokens.max(1)),
            Stat::LossScale => match stats.loss_scale {
                Some(scale) => (scale, 1),
                None => (f64::NAN, 0),
            },
            Stat::MemoryGib => match stats.max_memory_bytes {
                Some(bytes) => (bytes / (1u64 << 30) as f64, 1),
                None => (f64::NAN, 0),
            },
            Stat::Moe(stat) => {
                let value = stats.moe.and_then(|m| match stat {
                    MoeStat::LoadBalancingLoss => Some(m.load_balancing_loss),
                    MoeStat::ZLoss => Some(m.z_loss),
                    MoeStat::ExpertLoadMin => Some(m.expert_load_min),
                    MoeStat::ExpertLoadMax => Some(m.expert_load_max),
                    MoeStat::DroppedPercent => m
                        .dropped_assignments
                        .map(|d| 100.0 * d / m.assignments.max(1.0)),
                });
                match value {
                    Some(v) => (v, 1),
                    None => (f64::NAN, 0),
                }
            }
        }
    }
}

impl Adaptor<LanguageModelStats> for LanguageModelStats {
    fn adapt(&self) -> LanguageModelStats {
        *self
    }
}

impl Metric for LanguageModelMetric {
    type Input = LanguageModelStats;

    fn name(&self) -> MetricName {
        self.name.clone()
    }

    fn update(&mut self, stats: &LanguageModelStats, _: &MetricMetadata) -> SerializedEntry {
        let (value, weight) = self.measure(stats);
        let mut format = FormatOptions::new(self.name.clone()).precision(2);
        if let Some(unit) = self.unit {
            format = format.unit(unit);
        }
        // A step with no measurement (the first one of a timed metric) does not count.
        let value = if weight == 0 { 0.0 } else { value };
        self.state.update(value, weight, format)
    }

    fn clear(&mut self) {
        self.state.reset();
        self.previous = None;
    }

    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: self.unit.map(str::to_string),
            higher_is_better: !matches!(
                self.stat,
                Stat::GradNorm | Stat::Perplexity | Stat::MemoryGib | Stat::Moe(_)
            ),
        }
        .into()
    }
}

impl Numeric for LanguageModelMetric {
    fn value(&self) -> NumericEntry {
        self.state.current_value()
    }

    fn running_value(&self) -> NumericEntry {
        self.state.running_value()
    }
}
