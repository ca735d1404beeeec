//! GPT samples from an indexed dataset (Megatron-Core's `GPTDataset`): documents
//! concatenated, cut into samples of `sequence_length + 1` tokens, shuffled with a seed.

use std::ops::Range;
use std::sync::Arc;

use burn::config::Config;

use super::rng::SplitMix64;
use super::{DataError, IndexedDataset};

/// How a [`GptDataset`] cuts and shuffles its documents.
#[derive(Config, Debug, PartialEq)]
pub struct GptDatasetConfig {
    /// Input tokens per sample (`--seq-length`); a sample holds one more, for the shifted
    /// targets.
    pub sequence_length: usize,
    /// Seed of the document and sample shuffles (`--seed`).
    #[config(default = 1234)]
    pub random_seed: u64,
}

/// A source of fixed-length token samples that training can index directly: sample `i` is
/// the same whatever was read before, so a run restarted after `n` consumed samples reads
/// samples `n, n + 1, ...` exactly as the uninterrupted run would.
pub trait SampleDataset {
    /// Number of samples.
    fn len(&self) -> usize;

    /// Whether there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Input tokens per sample; [`sample`](Self::sample) gives one more.
    fn sequence_length(&self) -> usize;

    /// Sample `i`: `sequence_length + 1` token ids.
    fn sample(&self, i: usize) -> Result<Vec<i64>, DataError>;
}

/// Samples of `sequence_length + 1` tokens over a range of an [`IndexedDataset`]'s sequences
/// (Megatron-Core's `GPTDataset`; a GPT corpus has one sequence per document).
///
/// The documents of `documents` are repeated for as many epochs as `num_samples` needs,
/// shuffled (the document index), concatenated and cut every `sequence_length` tokens (the
/// sample index): sample `k` of the concatenation is its tokens
/// `k · sequence_length ..= (k + 1) · sequence_length`, so consecutive samples share one token,
/// the last target of one being the first input of the next, as in Megatron. The samples are
/// then shuffled (the shuffle index). When the last epoch is needed for fewer than 80 % of its
/// samples, it is shuffled apart from the others (Megatron's `separate_final_epoch`), so the
/// samples it contributes are spread over all its documents rather than mixed with earlier
/// epochs.
///
/// Megatron's differences: its shuffles use NumPy's `RandomState`, so the same seed gives a
/// different (equally random) order; it caches the indices in files, we rebuild them (a
/// pass over the sequence lengths, quick for the corpora this runs on).
#[derive(Debug, Clone)]
pub struct GptDataset {
    dataset: Arc<IndexedDataset>,
    sequence_length: usize,
    num_epochs: usize,
    document_index: Vec<usize>,
    sample_index: Vec<(usize, usize)>,
    shuffle_index: Vec<usize>,
}

impl GptDataset {
    /// At least `num_samples` samples (there may be more: whole epochs are cut) from the
    /// sequences `documents` of `dataset`.
    pub fn new(
        dataset: Arc<IndexedDataset>,
        documents: Range<usize>,
        num_samples: usize,
        config: &GptDatasetConfig,
    ) -> Result<Self, DataError> {
        let seq_len = config.sequence_length;
        if seq_len == 0 {
            return Err(DataError::Invalid(
                "the sequence length must be at least 1".into(),
            ));
        }
        if documents.end > dataset.len() || documents.start > documents.end {
            return Err(DataError::Invalid(format!(
                "documents {documents:?} are not within the {} sequences of {}",
                dataset.len(),
                dataset.index_path().display()
            )));
        }
        let lengths: Vec<usize> = dataset.sequence_lengths().collect();
        let tokens_per_epoch: usize = lengths[documents.clone()].iter().sum();
        let needed = num_samples
            .checked_mul(seq_len)
            .and_then(|t| t.checked_add(1))
            .ok_or_else(|| DataError::Invalid(format!("{num_samples} samples are too many")))?;
        if tokens_per_epoch == 0 {
            return Err(DataError::Invalid(format!(
                "documents {documents:?} of {} hold no tokens: a split or blend weight gave this \
                 dataset nothing to sample",
                dataset.index_path().display()
            )));
        }
        let num_epochs = needed.div_ceil(tokens_per_epoch).max(1);

        // Megatron's separate_final_epoch.
        let samples_before_last = ((num_epochs - 1) * tokens_per_epoch).saturating_sub(1) / seq_len;
        let samples_per_epoch = (tokens_per_epoch - 1) / seq_len;
        let separate_final_epoch = num_epochs > 1
            && num_samples.saturating_sub(samples_before_last)
                < (0.8 * samples_per_epoch as f64) as usize;

        let mut rng = SplitMix64::new(config.random_seed);
        let epoch =
            |epochs: usize| -> Vec<usize> { (0..epochs).flat_map(|_| documents.clone()).collect() };
        let document_index = if separate_final_epoch {
            let mut first = epoch(num_epochs - 1);
            rng.shuffle(&mut first);
            let mut last = epoch(1);
            rng.shuffle(&mut last);
            first.extend(last);
            first
        } else {
            let mut all = epoch(num_epochs);
            rng.shuffle(&mut all);
            all
        };

        let total_samples = (num_epochs * tokens_per_epoch - 1) / seq_len;
        let sample_index = build_sample_index(&lengths, &document_index, seq_len, total_samples);

        let mut shuffle_index: Vec<usize> = (0..total_samples).collect();
        if separate_final_epoch {
            let (first, last) = shuffle_index.split_at_mut(samples_before_last);
            rng.shuffle(first);
            rng.shuffle(last);
        } else {
            rng.shuffle(&mut shuffle_index);
        }

        Ok(GptDataset {
            dataset,
            sequence_length: seq_len,
            num_epochs,
            document_index,
            sample_index,
            shuffle_index,
        })
    }

    /// The epochs over the documents that the samples need.
    pub fn num_epochs(&self) -> usize {
        self.num_epochs
    }

    /// The documents (sequence indices of the indexed dataset) in the order they are
    /// concatenated: every document once per epoch, shuffled.
    pub fn document_index(&self) -> &[usize] {
        &self.document_index
    }

    /// Which sample of the concatenation is sample `i`: a permutation of `0..len()`.
    pub fn shuffle_index(&self) -> &[usize] {
        &self.shuffle_index
    }

    /// The indexed dataset the samples come from.
    pub fn indexed_dataset(&self) -> &Arc<IndexedDataset> {
        &self.dataset
    }
}

impl SampleDataset for GptDataset {
    fn len(&self) -> usize {
        self.shuffle_index.len()
    }

    fn sequence_length(&self) -> usize {
        self.sequence_length
    }

    fn sample(&self, i: usize) -> Result<Vec<i64>, DataError> {
        let k = *self
            .shuffle_index
            .get(i)
            .ok_or(DataError::IndexOutOfRange {
                what: "sample",
                index: i,
                len: self.shuffle_index.len(),
            })?;
        let (mut position, mut offset) = self.sample_index[k];
        let mut remaining = self.sequence_length + 1;
        let mut out = Vec::with_capacity(remaining);
        while remaining > 0 {
            // In range: the sample index stops where the concatenation still has
            // `sequence_length + 1` tokens.
            let document = self.document_index[position];
            let available = self.dataset.sequence_length(document)? - offset;
            let take = available.min(remaining);
            self.dataset.read_into(document, offset, take, &mut out)?;
            remaining -= take;
            position += 1;
            offset = 0;
        }
        Ok(out)
    }
}

/// Where each sample of the concatenation starts: `(position in the document index, token
/// offset in that document)` of token `k · seq_len`, for `k` in `0..num_samples` (Megatron's
/// `build_sample_idx`, which stores the same boundaries as start and end pairs).
fn build_sample_index(
    lengths: &[usize],
    document_index: &[usize],
    seq_len: usize,
    num_samples: usize,
) -> Vec<(usize, usize)> {
    let mut index = Vec::with_capacity(num_samples);
    let (mut position, mut offset) = (0, 0);
    for k in 0..num_samples {
        if k > 0 {
            let mut remaining = seq_len;
            while remaining > 0 {
                let available = lengths[document_index[position]] - offset;
                if available > remaining {
                    offset += remaining;
                    remaining = 0;
                } else {
                    remaining -= available;
                    position += 1;
                    offset = 0;
                }
            }
        }
        // A sample starts inside a document: skip empty ones and the end of the last.
        while offset == lengths[document_index[position]] {
            position += 1;
            offset = 0;
        }
        index.push((position, offset));
    }
    index
}
