//! Several datasets mixed by weights (Megatron-Core's `BlendedDataset`).

use std::path::PathBuf;

use super::{DataError, SampleDataset};

/// Which dataset each blended sample comes from, and which of that dataset's samples it is
/// (Megatron's `build_blending_indices`): sample `i` goes to the dataset furthest behind its
/// share, the `d` that maximises `weights[d] · max(i, 1) - taken[d]` (the first on ties).
/// No randomness: after every prefix of `n` samples, dataset `d` has given `weights[d] · n`
/// samples to within one.
///
/// Returns `(dataset_index, dataset_sample_index)`, each of `size` entries (none when there
/// are no weights). `weights` must be normalised (sum 1).
pub fn blending_indices(weights: &[f64], size: usize) -> (Vec<usize>, Vec<usize>) {
    if weights.is_empty() {
        return (Vec::new(), Vec::new());
    }
    let mut taken = vec![0usize; weights.len()];
    let mut dataset_index = Vec::with_capacity(size);
    let mut dataset_sample_index = Vec::with_capacity(size);
    for i in 0..size {
        let at = (i as f64).max(1.0);
        let mut best = 0;
        let mut best_error = f64::NEG_INFINITY;
        for (d, w) in weights.iter().enumerate() {
            let error = w * at - taken[d] as f64;
            if error > best_error {
                best = d;
                best_error = error;
            }
        }
        dataset_index.push(best);
        dataset_sample_index.push(taken[best]);
        taken[best] += 1;
    }
    (dataset_index, dataset_sample_index)
}

/// Normalises blend weights to sum 1 (Megatron's `normalize`); an error for a negative,
/// non-finite or all-zero weight.
pub fn normalize_weights(weights: &[f64]) -> Result<Vec<f64>, DataError> {
    let sum: f64 = weights.iter().sum();
    if weights.is_empty() || weights.iter().any(|w| !w.is_finite() || *w < 0.0) || sum <= 0.0 {
        return Err(DataError::Invalid(format!(
            "blend weights {weights:?} must be non-negative, finite and not all 0"
        )));
    }
    Ok(weights.iter().map(|w| w / sum).collect())
}

/// How many samples to build per dataset for `size` blended samples: `ceil(ceil(size ·
/// weight) · (1 + surplus))` (Megatron's `_get_size_per_split_per_dataset`; its default
/// surplus is 0.005). The blending never asks a dataset for more than `ceil(size · weight)`.
pub fn samples_per_dataset(weights: &[f64], size: usize, surplus: f64) -> Vec<usize> {
    weights
        .iter()
        .map(|w| ((size as f64 * w).ceil() * (1.0 + surplus)).ceil() as usize)
        .collect()
}

/// Parses Megatron's `--data-path`: either prefixes alone (equal weights) or
/// `weight prefix weight prefix ...`, e.g. `["0.3", "wiki_text_document", "0.7",
/// "web_text_document"]`.
pub fn parse_data_path(words: &[String]) -> Result<Vec<(f64, PathBuf)>, DataError> {
    if words.is_empty() {
        return Err(DataError::Invalid("--data-path names no dataset".into()));
    }
    let weighted = words[0].parse::<f64>().is_ok();
    if !weighted {
        return Ok(words.iter().map(|p| (1.0, PathBuf::from(p))).collect());
    }
    if !words.len().is_multiple_of(2) {
        return Err(DataError::Invalid(format!(
            "--data-path {words:?}: weighted blends are pairs of `weight prefix`"
        )));
    }
    words
        .chunks(2)
        .map(|pair| match pair[0].parse::<f64>() {
            Ok(w) => Ok((w, PathBuf::from(&pair[1]))),
            Err(_) => Err(DataError::Invalid(format!(
                "--data-path: {:?} is not a weight (pairs of `weight prefix`)",
                pair[0]
            ))),
        })
        .collect()
}

/// Samples drawn from several datasets in proportion to weights (Megatron-Core's
/// `BlendedDataset`); the order is fixed by the weights alone ([`blending_indices`]), and
/// each dataset keeps its own shuffle.
#[derive(Debug, Clone)]
pub struct BlendedDataset<D> {
    datasets: Vec<D>,
    weights: Vec<f64>,
    dataset_index: Vec<usize>,
    dataset_sample_index: Vec<usize>,
}

impl<D: SampleDataset> BlendedDataset<D> {
    /// `size` samples from `datasets` in proportion to `weights` (normalised here). An error if
    /// the datasets disagree on the sequence length or one holds fewer samples than its share.
    pub fn new(datasets: Vec<D>, weights: &[f64], size: usize) -> Result<Self, DataError> {
        if datasets.len() != weights.len() {
            return Err(DataError::Invalid(format!(
                "{} datasets but {} blend weights",
                datasets.len(),
                weights.len()
            )));
        }
        let weights = normalize_weights(weights)?;
        if let Some(first) = datasets.first()
            && let Some(other) = datasets
                .iter()
                .find(|d| d.sequence_length() != first.sequence_length())
        {
            return Err(DataError::Invalid(format!(
                "blended datasets must share a sequence length: {} and {}",
                first.sequence_length(),
                other.sequence_length()
            )));
        }
        let (dataset_index, dataset_sample_index) = blending_indices(&weights, size);
        let mut needed = vec![0usize; datasets.len()];
        for (&d, &s) in dataset_index.iter().zip(&dataset_sample_index) {
            needed[d] = needed[d].max(s + 1);
        }
        for (d, (dataset, needed)) in datasets.iter().zip(&needed).enumerate() {
            if dataset.len() < *needed {
                return Err(DataError::Invalid(format!(
                    "blended dataset {d} (weight {:.4}) has {} samples but the blend of {size} \
                     needs {needed}: build it with samples_per_dataset",
                    weights[d],
                    dataset.len()
                )));
            }
        }
        Ok(BlendedDataset {
            datasets,
            weights,
            dataset_index,
            dataset_sample_index,
        })
    }

    /// The normalised weights.
    pub fn weights(&self) -> &[f64] {
        &self.weights
    }

    /// The datasets blended.
    pub fn datasets(&self) -> &[D] {
        &self.datasets
    }

    /// Which dataset sample `i` comes from; `None` past the end.
    pub fn dataset_of(&self, i: usize) -> Option<usize> {
        self.dataset_index.get(i).copied()
    }
}

impl<D: SampleDataset> SampleDataset for BlendedDataset<D> {
    fn len(&self) -> usize {
        self.dataset_index.len()
    }

    fn sequence_length(&self) -> usize {
        self.datasets.first().map_or(0, |d| d.sequence_length())
    }

    fn sample(&self, i: usize) -> Result<Vec<i64>, DataError> {
        let d = self.dataset_of(i).ok_or(DataError::IndexOutOfRange {
            what: "blended sample",
            index: i,
            len: self.len(),
        })?;
        self.datasets[d].sample(self.dataset_sample_index[i])
    }
}
