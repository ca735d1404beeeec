//! A renderer and a metric logger that drop everything: what the ranks other than the
//! logging rank give burn-train, so that one rank draws the dashboard and writes the metric
//! files.

use burn::train::LearnerSummary;
use burn::train::logger::MetricLogger;
use burn::train::metric::store::{EpochSummary, MetricsUpdate, Split};
use burn::train::metric::{MetricDefinition, NumericEntry};
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};

/// A renderer that shows nothing.
pub struct QuietRenderer;

impl MetricsRendererTraining for QuietRenderer {
    fn update_train(&mut self, _: MetricState) {}
    fn update_valid(&mut self, _: MetricState) {}
    fn render_train(&mut self, _: TrainingProgress, _: Vec<ProgressType>) {}
    fn render_valid(&mut self, _: TrainingProgress, _: Vec<ProgressType>) {}
    fn on_train_end(
        &mut self,
        _: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        Ok(())
    }
}

impl MetricsRendererEvaluation for QuietRenderer {
    fn update_test(&mut self, _: EvaluationName, _: MetricState) {}
    fn render_test(&mut self, _: EvaluationProgress, _: Vec<ProgressType>) {}
    fn on_test_end(
        &mut self,
        _: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        Ok(())
    }
}

impl MetricsRenderer for QuietRenderer {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _: MetricDefinition) {}
}

/// A metric logger that writes nothing.
pub struct QuietLogger;

impl MetricLogger for QuietLogger {
    fn log(&mut self, _: MetricsUpdate, _: usize, _: &Split) {}

    fn read_numeric(&mut self, _: &str, _: usize, _: &Split) -> Result<Vec<NumericEntry>, String> {
        Ok(Vec::new())
    }

    fn log_metric_definition(&mut self, _: MetricDefinition) {}

    fn log_epoch_summary(&mut self, _: EpochSummary) {}
}
