//! A burn-train metric logger whose values stay readable after the run: what examples and
//! tests compare (burn-train's own in-memory logger is moved into the run and not returned).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use burn::train::logger::MetricLogger;
use burn::train::metric::store::{EpochSummary, MetricsUpdate, Split};
use burn::train::metric::{MetricDefinition, MetricId, NumericEntry};

#[derive(Default)]
struct Log {
    names: HashMap<MetricId, String>,
    values: Vec<(String, bool, f64)>,
}

/// Records every numeric metric value burn-train logs; clones share the record, so keep one
/// and give another to `SupervisedTraining::with_metric_logger`.
#[derive(Clone, Default)]
pub struct MetricRecorder {
    log: Arc<Mutex<Log>>,
}

impl MetricRecorder {
    /// An empty record.
    pub fn new() -> Self {
        Self::default()
    }

    /// The values of the metric called `name` (e.g. `"Loss"`), in the order logged, on the
    /// training split (`train`) or the validation split.
    pub fn values(&self, name: &str, train: bool) -> Vec<f64> {
        self.lock()
            .values
            .iter()
            .filter(|(n, t, _)| n == name && *t == train)
            .map(|(_, _, v)| *v)
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl MetricLogger for MetricRecorder {
    fn log(&mut self, update: MetricsUpdate, _: usize, split: &Split) {
        let mut log = self.lock();
        for entry in update.entries_numeric {
            let name = log.names.get(&entry.entry.metric_id).cloned();
            let value = match entry.numeric_entry {
                NumericEntry::Value(v) => v,
                NumericEntry::Aggregated {
                    aggregated_value, ..
                } => aggregated_value,
            };
            let train = matches!(split, Split::Train);
            log.values.push((name.unwrap_or_default(), train, value));
        }
    }

    fn read_numeric(&mut self, _: &str, _: usize, _: &Split) -> Result<Vec<NumericEntry>, String> {
        Ok(Vec::new())
    }

    fn log_metric_definition(&mut self, definition: MetricDefinition) {
        self.lock()
            .names
            .insert(definition.metric_id, definition.name);
    }

    fn log_epoch_summary(&mut self, _: EpochSummary) {}
}
