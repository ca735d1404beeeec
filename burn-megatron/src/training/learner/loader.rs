//! burn-train data loaders for data-parallel ranks: the GPT's per-step microbatches read as
//! Megatron reads them, and any Burn loader cut among the data-parallel ranks.

use std::marker::PhantomData;
use std::sync::Arc;

use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::tensor::backend::Backend;
use burn_megatron_dist::{DistBackend, ParallelState};

use super::failure::fail;
use crate::data::SampleDataset;
use crate::pipeline_parallel::Microbatch;
use crate::training::read_microbatches;

/// The batch shape of a [`GptStepLoader`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepShape {
    /// Samples per microbatch (`--micro-batch-size`).
    pub micro_batch_size: usize,
    /// Samples per global step over all data-parallel ranks (`--global-batch-size`).
    pub global_batch_size: usize,
    /// Token ids must be below this (the model's vocabulary).
    pub vocab_size: usize,
}

/// This rank's microbatches of each global step of a GPT dataset, one `Vec<Microbatch>` per
/// step, read exactly as [`pretrain`](crate::training::pretrain) reads them
/// ([`read_microbatches`]): microbatch `m` of DP rank `r` is the `m`-th slice of
/// `dp · micro_batch_size` samples of the step; TP rank 0 reads and broadcasts to its group.
/// Every rank of the world iterates its loader in step, since the broadcast is a collective.
///
/// A read that fails (a malformed file, a token id outside the vocabulary) unwinds, since
/// burn-train's loaders cannot fail: under [`MegatronStrategy`](super::MegatronStrategy) the
/// typed error reaches [`pretrain_with_learner`](super::pretrain_with_learner)'s `Result`;
/// elsewhere it is a panic with the error's message.
pub struct GptStepLoader<B: Backend, D> {
    dataset: Arc<D>,
    state: ParallelState,
    shape: StepShape,
    steps: core::ops::Range<usize>,
    device: B::Device,
}

impl<B: Backend, D> Clone for GptStepLoader<B, D> {
    fn clone(&self) -> Self {
        Self {
            dataset: self.dataset.clone(),
            state: self.state.clone(),
            shape: self.shape,
            steps: self.steps.clone(),
            device: self.device.clone(),
        }
    }
}

impl<B, D> GptStepLoader<B, D>
where
    B: DistBackend,
    D: SampleDataset + Send + Sync + 'static,
{
    /// Steps `0..steps` of `dataset` for this rank of `state`, on `device`. The global batch
    /// must be a multiple of `micro_batch_size · dp`.
    pub fn new(
        dataset: Arc<D>,
        state: &ParallelState,
        shape: StepShape,
        steps: usize,
        device: &B::Device,
    ) -> crate::Result<Self> {
        let per_step = shape.micro_batch_size * state.dp().size();
        if shape.micro_batch_size == 0 || !shape.global_batch_size.is_multiple_of(per_step) {
            return Err(crate::ConfigError::Invalid(format!(
                "the global batch ({}) must be a positive multiple of micro batch ({}) × DP ({})",
                shape.global_batch_size,
                shape.micro_batch_size,
                state.dp().size()
            ))
            .into());
        }
        Ok(Self {
            dataset,
            state: state.clone(),
            shape,
            steps: 0..steps,
            device: device.clone(),
        })
    }

    fn read(&self, step: usize) -> Vec<Microbatch<B>> {
        let shape = self.shape;
        let per_microbatch = shape.micro_batch_size * self.state.dp().size();
        read_microbatches::<B, D>(
            &self.dataset,
            &self.state,
            step * shape.global_batch_size,
            shape.global_batch_size / per_microbatch,
            shape.micro_batch_size,
            shape.vocab_size,
            &self.device,
        )
        .unwrap_or_else(|e| {
            fail(
                self.state.world().rank(),
                &format!("reading step {step}'s batch"),
                e,
            )
        })
    }
}

struct StepIterator<'a, B: Backend, D> {
    loader: &'a GptStepLoader<B, D>,
    next: usize,
}

impl<B, D> Iterator for StepIterator<'_, B, D>
where
    B: DistBackend,
    D: SampleDataset + Send + Sync + 'static,
{
    type Item = Vec<Microbatch<B>>;

    fn next(&mut self) -> Option<Self::Item> {
        let step = self.loader.steps.start + self.next;
        if step >= self.loader.steps.end {
            return None;
        }
        self.next += 1;
        Some(self.loader.read(step))
    }
}

impl<B, D> DataLoaderIterator<Vec<Microbatch<B>>> for StepIterator<'_, B, D>
where
    B: DistBackend,
    D: SampleDataset + Send + Sync + 'static,
{
    fn progress(&self) -> Progress {
        Progress::new(self.next, self.loader.steps.len())
    }
}

impl<B, D> DataLoader<B, Vec<Microbatch<B>>> for GptStepLoader<B, D>
where
    B: DistBackend,
    D: SampleDataset + Send + Sync + 'static,
{
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<Vec<Microbatch<B>>> + 'a> {
        Box::new(StepIterator {
            loader: self,
            next: 0,
        })
    }

    fn num_items(&self) -> usize {
        self.steps.len()
    }

    fn to_device(&self, device: &B::Device) -> Arc<dyn DataLoader<B, Vec<Microbatch<B>>>> {
        Arc::new(Self {
            device: device.clone(),
            ..self.clone()
        })
    }

    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<B, Vec<Microbatch<B>>>> {
        let first = self.steps.start;
        let end = (first + end).min(self.steps.end);
        Arc::new(Self {
            steps: (first + start).min(end)..end,
            ..self.clone()
        })
    }
}

/// Any Burn loader cut among data-parallel ranks, as Burn's DDP cuts it: DP rank `r` of `d`
/// takes the loader's batches `r, r + d, r + 2d, …`, so a global step is `d` of the loader's
/// batches.
///
/// Every rank iterates the whole loader (so it must give every rank the same batches in the
/// same order: no unseeded shuffle) and keeps its share; a last round of fewer than `d`
/// batches is dropped on every rank, so all ranks take the same number of steps. Burn's
/// loaders count items (samples), not batches: `num_items` and `slice` are in the loader's
/// items divided among the ranks.
pub struct DataParallelShard<B: Backend, O> {
    inner: Arc<dyn DataLoader<B, O>>,
    rank: usize,
    size: usize,
    _output: PhantomData<fn() -> O>,
}

impl<B: Backend, O> DataParallelShard<B, O> {
    /// This rank's share of `inner` over the data-parallel group of `state`.
    pub fn new(inner: Arc<dyn DataLoader<B, O>>, state: &ParallelState) -> Self {
        Self {
            inner,
            rank: state.dp().rank(),
            size: state.dp().size(),
            _output: PhantomData,
        }
    }
}

struct ShardIterator<'a, O> {
    inner: Box<dyn DataLoaderIterator<O> + 'a>,
    rank: usize,
    size: usize,
}

impl<O> Iterator for ShardIterator<'_, O> {
    type Item = O;

    /// The rank's batch of the next complete round of `size` batches.
    fn next(&mut self) -> Option<O> {
        let mut mine = None;
        for i in 0..self.size {
            let batch = self.inner.next()?;
            if i == self.rank {
                mine = Some(batch);
            }
        }
        mine
    }
}

impl<O> DataLoaderIterator<O> for ShardIterator<'_, O> {
    fn progress(&self) -> Progress {
        let inner = self.inner.progress();
        Progress::new(
            inner.items_processed / self.size,
            inner.items_total / self.size,
        )
    }
}

impl<B: Backend, O: 'static> DataLoader<B, O> for DataParallelShard<B, O> {
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<O> + 'a> {
        Box::new(ShardIterator {
            inner: self.inner.iter(),
            rank: self.rank,
            size: self.size,
        })
    }

    fn num_items(&self) -> usize {
        self.inner.num_items() / self.size
    }

    fn to_device(&self, device: &B::Device) -> Arc<dyn DataLoader<B, O>> {
        Arc::new(Self {
            inner: self.inner.to_device(device),
            rank: self.rank,
            size: self.size,
            _output: PhantomData,
        })
    }

    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<B, O>> {
        let end = end.min(self.num_items());
        Arc::new(Self {
            inner: self.inner.slice(start * self.size, end * self.size),
            rank: self.rank,
            size: self.size,
            _output: PhantomData,
        })
    }
}
