//! A burn-train renderer for logs (no terminal, CI, files): one line per `--log-interval`
//! training steps with every numeric metric's value for that step, and one line per
//! validation with its values, as Megatron's `training_log` prints. burn-train's own plain
//! renderer prints only the progress; its dashboard needs a terminal.

use std::collections::HashMap;

use burn::train::LearnerSummary;
use burn::train::metric::{MetricDefinition, MetricId, NumericEntry};
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};

/// Prints metric values every `interval` training steps and after each validation.
pub struct LogRenderer {
    interval: usize,
    names: HashMap<MetricId, String>,
    /// The latest values, in the order the metrics were registered.
    train: Vec<(MetricId, f64)>,
    valid: Vec<(MetricId, f64)>,
}

impl LogRenderer {
    /// A renderer that prints every `interval`-th training step (and the last one).
    pub fn new(interval: usize) -> Self {
        Self {
            interval: interval.max(1),
            names: HashMap::new(),
            train: Vec::new(),
            valid: Vec::new(),
        }
    }

    fn line(&self, values: &[(MetricId, f64)]) -> String {
        values
            .iter()
            .map(|(id, value)| {
                let name = self.names.get(id).map_or("?", String::as_str);
                format!("{name} {}", format_value(*value))
            })
            .collect::<Vec<_>>()
            .join(" | ")
    }
}

fn format_value(value: f64) -> String {
    if value != 0.0 && (value.abs() >= 1e5 || value.abs() < 1e-3) {
        format!("{value:.3e}")
    } else {
        format!("{value:.4}")
    }
}

fn record(values: &mut Vec<(MetricId, f64)>, state: MetricState) {
    let MetricState::Numeric(entry, numeric) = state else {
        return;
    };
    let value = match numeric {
        NumericEntry::Value(v) => v,
        NumericEntry::Aggregated {
            aggregated_value, ..
        } => aggregated_value,
    };
    match values.iter_mut().find(|(id, _)| *id == entry.metric_id) {
        Some(slot) => slot.1 = value,
        None => values.push((entry.metric_id, value)),
    }
}

impl MetricsRendererTraining for LogRenderer {
    fn update_train(&mut self, state: MetricState) {
        record(&mut self.train, state);
    }

    fn update_valid(&mut self, state: MetricState) {
        record(&mut self.valid, state);
    }

    fn render_train(&mut self, item: TrainingProgress, _: Vec<ProgressType>) {
        let Some(progress) = item.progress else {
            return;
        };
        let step = item.iteration.unwrap_or(progress.items_processed);
        let last = progress.items_processed == progress.items_total;
        if step.is_multiple_of(self.interval) || last {
            println!(
                " iteration {step:>6}/{:<6} | {}",
                progress.items_total,
                self.line(&self.train)
            );
        }
    }

    fn render_valid(&mut self, item: TrainingProgress, _: Vec<ProgressType>) {
        if let Some(progress) = item.progress
            && progress.items_processed == progress.items_total
        {
            let at = item
                .iteration
                .map(|i| format!(" at iteration {i}"))
                .unwrap_or_default();
            println!(" validation{at} | {}", self.line(&self.valid));
        }
    }

    fn on_train_end(
        &mut self,
        summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        if let Some(summary) = summary {
            println!("{summary}");
        }
        Ok(())
    }
}

impl MetricsRendererEvaluation for LogRenderer {
    fn update_test(&mut self, _: EvaluationName, _: MetricState) {}
    fn render_test(&mut self, _: EvaluationProgress, _: Vec<ProgressType>) {}
}

impl MetricsRenderer for LogRenderer {
    fn manual_close(&mut self) {}

    fn register_metric(&mut self, definition: MetricDefinition) {
        self.names.insert(definition.metric_id, definition.name);
    }
}
