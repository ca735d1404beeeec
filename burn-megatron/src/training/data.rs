//! The run's training and validation samples: Megatron's `build_train_valid_test_datasets`
//! for GPT, over the `--data-path` blend or the generated default corpus, and the
//! microbatches of a global batch.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn_megatron_dist::{DistBackend, ParallelState};

use super::config::PretrainConfig;
use crate::context_parallel::LoadBalancedSplit;
use crate::data::{
    BlendedDataset, GptBatch, GptDataset, GptDatasetConfig, IndexedDataset, SampleDataset, Split,
    broadcast_batch, normalize_weights, parse_data_path, parse_split, samples_per_dataset,
    split_ranges, write_default_corpus,
};
use crate::error::Result;
use crate::pipeline_parallel::Microbatch;

/// Megatron's surplus of samples built per blended dataset.
const BLEND_SURPLUS: f64 = 0.005;

/// The samples of a run: the training split sized for `train_iters` global batches, and the
/// validation split sized for every evaluation. Sample `i` depends only on the data, the
/// split and the seed, so a resumed run reads exactly the samples the uninterrupted run would.
#[derive(Debug, Clone)]
pub struct PretrainData {
    /// Training samples, in the order they are consumed.
    pub train: BlendedDataset<GptDataset>,
    /// Validation samples; `None` when evaluation is off or the split holds no document.
    pub valid: Option<BlendedDataset<GptDataset>>,
    /// Where the data came from, for the log.
    pub description: String,
}

impl PretrainData {
    /// The run's datasets. With no `--data-path`, the default corpus is generated into a
    /// temporary directory, memory-mapped, and the directory removed again (the mappings
    /// outlive the files).
    pub fn build(config: &PretrainConfig) -> Result<Self> {
        let (sources, description, scratch) = if config.data_path.is_empty() {
            // One directory per call: runs of one process (tests) may build at once.
            static BUILDS: AtomicU64 = AtomicU64::new(0);
            let dir = std::env::temp_dir().join(format!(
                "burn-megatron-corpus-{}-{}",
                std::process::id(),
                BUILDS.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).map_err(|e| {
                crate::data::DataError::Invalid(format!("cannot create {}: {e}", dir.display()))
            })?;
            let summary =
                write_default_corpus(&dir.join("corpus"), config.default_corpus_documents, 7)?;
            let description = format!(
                "the generated default corpus ({} documents, {} byte tokens)",
                summary.documents, summary.tokens
            );
            (vec![(1.0, summary.prefix)], description, Some(dir))
        } else {
            let sources = parse_data_path(&config.data_path)?;
            let description = sources
                .iter()
                .map(|(w, p)| format!("{w} × {}", p.display()))
                .collect::<Vec<_>>()
                .join(" + ");
            (sources, description, None)
        };
        let built = Self::from_sources(config, &sources, description);
        if let Some(dir) = scratch {
            let _ = std::fs::remove_dir_all(dir);
        }
        built
    }

    fn from_sources(
        config: &PretrainConfig,
        sources: &[(f64, PathBuf)],
        description: String,
    ) -> Result<Self> {
        let weights: Vec<f64> = sources.iter().map(|(w, _)| *w).collect();
        let weights = normalize_weights(&weights)?;
        let split = parse_split(&config.split)?;
        let datasets = sources
            .iter()
            .map(|(_, prefix)| IndexedDataset::open(prefix).map(Arc::new))
            .collect::<core::result::Result<Vec<_>, _>>()?;
        let sampling = GptDatasetConfig::new(config.seq_length).with_random_seed(config.seed);
        let build = |which: Split, size: usize| -> Result<BlendedDataset<GptDataset>> {
            let per_dataset = samples_per_dataset(&weights, size, BLEND_SURPLUS);
            let parts = datasets
                .iter()
                .zip(per_dataset)
                .map(|(dataset, samples)| {
                    let documents = split_ranges(&split, dataset.len())[which.index()].clone();
                    GptDataset::new(dataset.clone(), documents, samples, &sampling)
                })
                .collect::<core::result::Result<Vec<_>, _>>()?;
            Ok(BlendedDataset::new(parts, &weights, size)?)
        };
        let train = build(Split::Train, config.train_iters * config.global_batch_size)?;
        let evaluations = match config.eval_interval {
            0 => 0,
            interval => config.train_iters / interval + 1,
        };
        let valid = if evaluations > 0 && split[Split::Valid.index()] > 0.0 {
            let size = evaluations * config.eval_iters * config.global_batch_size;
            Some(build(Split::Valid, size)?)
        } else {
            None
        };
        Ok(PretrainData {
            train,
            valid,
            description,
        })
    }
}

/// This data-parallel rank's `count` microbatches of `micro_batch_size` samples of the global
/// batch that starts at sample `first` of `dataset`, on `device`. As Megatron's
/// `MegatronPretrainingSampler`, microbatch `m` of DP rank `r` is the samples from
/// `first + (m · dp + r) · micro_batch_size`: the `m`-th slice of `dp · micro_batch_size`
/// samples, cut among the DP ranks. Rank 0 of `state`'s tensor-parallel group reads them and
/// broadcasts them to the others (Megatron's `get_batch`); the ids are checked against
/// `vocab_size`. Under context parallelism every rank of a CP group reads the same samples and
/// keeps its two chunks of each sequence, tokens and targets
/// ([`LoadBalancedSplit`], Megatron's `get_batch_on_this_cp_rank`): `[micro_batch, seq / cp]`.
pub fn read_microbatches<B: DistBackend, D: SampleDataset>(
    dataset: &D,
    state: &ParallelState,
    first: usize,
    count: usize,
    micro_batch_size: usize,
    vocab_size: usize,
    device: &B::Device,
) -> Result<Vec<Microbatch<B>>> {
    let (tp, dp) = (state.tp(), state.dp());
    let seq = dataset.sequence_length();
    (0..count)
        .map(|m| {
            let read = if tp.rank() == 0 {
                Some(GptBatch::read(
                    dataset,
                    first + (m * dp.size() + dp.rank()) * micro_batch_size,
                    micro_batch_size,
                )?)
            } else {
                None
            };
            let batch = if tp.size() == 1 {
                read.expect("a group of one reads its own batch")
            } else {
                broadcast_batch::<B>(tp, 0, read.as_ref(), micro_batch_size, seq, device)?
            };
            let microbatch = batch.to_microbatch(vocab_size, device)?;
            if state.cp().size() == 1 {
                return Ok(microbatch);
            }
            let split = LoadBalancedSplit::of_group(state.cp());
            Ok(Microbatch::new(
                split.split(microbatch.tokens, 1)?,
                split.split(microbatch.targets, 1)?,
            ))
        })
        .collect()
}
