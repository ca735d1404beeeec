//! A micro-batch of GPT samples for the training loop, and its broadcast over a
//! tensor-parallel group.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_megatron_dist::{DistBackend, ProcessGroup};

use super::{DataError, Microbatch, SampleDataset};
use crate::error::{IdKind, Result, check_ids_on_host, read_data};

/// `micro_batch_size` samples of `sequence_length + 1` tokens, on the host, row-major
/// `[micro_batch_size, sequence_length + 1]`: the model's inputs are the first
/// `sequence_length` tokens of each row, its targets the last `sequence_length` (Megatron's
/// `tokens = text[:-1]`, `labels = text[1:]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GptBatch {
    micro_batch_size: usize,
    sequence_length: usize,
    tokens: Vec<i64>,
}

impl GptBatch {
    /// Samples `first..first + micro_batch_size` of `dataset`: the micro-batch after `first`
    /// consumed samples.
    pub fn read(
        dataset: &impl SampleDataset,
        first: usize,
        micro_batch_size: usize,
    ) -> core::result::Result<Self, DataError> {
        let samples = (first..first.saturating_add(micro_batch_size))
            .map(|i| dataset.sample(i))
            .collect::<core::result::Result<Vec<_>, _>>()?;
        Self::from_samples(&samples)
    }

    /// A batch of samples, each of `sequence_length + 1` tokens (at least 2).
    pub fn from_samples(samples: &[Vec<i64>]) -> core::result::Result<Self, DataError> {
        let width = samples.first().map_or(0, Vec::len);
        if samples.is_empty() || width < 2 || samples.iter().any(|s| s.len() != width) {
            return Err(DataError::Invalid(format!(
                "a batch needs at least one sample, all of the same length of at least 2 tokens; \
                 got lengths {:?}",
                samples.iter().map(Vec::len).collect::<Vec<_>>()
            )));
        }
        Ok(GptBatch {
            micro_batch_size: samples.len(),
            sequence_length: width - 1,
            tokens: samples.concat(),
        })
    }

    /// Samples in the batch.
    pub fn micro_batch_size(&self) -> usize {
        self.micro_batch_size
    }

    /// Input tokens per sample.
    pub fn sequence_length(&self) -> usize {
        self.sequence_length
    }

    /// The samples' tokens, `[micro_batch_size, sequence_length + 1]` row-major.
    pub fn tokens(&self) -> &[i64] {
        &self.tokens
    }

    /// Input tokens `[micro_batch_size, sequence_length]` and targets (the same, shifted by
    /// one), row-major.
    pub fn inputs_and_targets(&self) -> (Vec<i64>, Vec<i64>) {
        let width = self.sequence_length + 1;
        let rows = self.tokens.chunks_exact(width);
        let inputs = rows
            .clone()
            .flat_map(|r| &r[..width - 1])
            .copied()
            .collect();
        let targets = rows.flat_map(|r| &r[1..]).copied().collect();
        (inputs, targets)
    }

    /// Checks every token against a vocabulary of `vocab_size` tokens: the first id outside
    /// `0..vocab_size` is an [`InputError::IdOutOfRange`](crate::InputError::IdOutOfRange).
    /// (A dataset preprocessed with another tokenizer than the model's fails here.)
    pub fn check_vocab(&self, vocab_size: usize) -> Result<()> {
        let data = TensorData::new(self.tokens.clone(), [self.tokens.len()]);
        Ok(check_ids_on_host(&data, IdKind::Token, vocab_size)?)
    }

    /// The model's [`Microbatch`]: tokens and targets, each `[micro_batch_size,
    /// sequence_length]` Int tensors on `device`, after [`check_vocab`](Self::check_vocab).
    pub fn to_microbatch<B: Backend>(
        &self,
        vocab_size: usize,
        device: &B::Device,
    ) -> Result<Microbatch<B>> {
        self.check_vocab(vocab_size)?;
        let (inputs, targets) = self.inputs_and_targets();
        let shape = [self.micro_batch_size, self.sequence_length];
        Ok(Microbatch::new(
            Tensor::<B, 2, Int>::from_data(TensorData::new(inputs, shape), device),
            Tensor::<B, 2, Int>::from_data(TensorData::new(targets, shape), device),
        ))
    }
}

/// Every id is sent as two f32 halves, `id = high · 2²⁴ + low` with `0 <= low < 2²⁴`: both are
/// exact in f32 for `|id| < 2⁴⁷`.
const HALF: i64 = 1 << 24;
const LIMIT: i64 = 1 << 47;

/// The batch of group rank `root`, on every rank of `group` (Megatron's
/// `broadcast_data` within a tensor-parallel group: one rank reads, the others receive).
///
/// `root` passes `Some(batch)`, the others `None`; all pass the batch's shape. The ids travel
/// as one f32 tensor (a leading status, then two exact halves per id), on the group's device
/// path where the backend has one (NCCL) or through the host.
pub fn broadcast_batch<B: DistBackend>(
    group: &ProcessGroup,
    root: usize,
    batch: Option<&GptBatch>,
    micro_batch_size: usize,
    sequence_length: usize,
    device: &B::Device,
) -> Result<GptBatch> {
    let count = micro_batch_size * (sequence_length + 1);
    let len = 1 + 2 * count;
    let message = if group.rank() == root {
        let Some(batch) = batch else {
            return Err(DataError::Invalid(format!(
                "broadcast_batch: rank {root} is the root and must pass the batch"
            ))
            .into());
        };
        let mut values = vec![0f32; len];
        if batch.micro_batch_size != micro_batch_size
            || batch.sequence_length != sequence_length
            || batch.tokens.iter().any(|id| id.abs() >= LIMIT)
        {
            values[0] = 1.0; // status: the others return an error too, rather than wait
        } else {
            for (i, &id) in batch.tokens.iter().enumerate() {
                values[1 + 2 * i] = id.div_euclid(HALF) as f32;
                values[2 + 2 * i] = id.rem_euclid(HALF) as f32;
            }
        }
        Tensor::<B, 1>::from_data(TensorData::new(values, [len]), (device, DType::F32))
    } else {
        Tensor::<B, 1>::zeros([len], (device, DType::F32))
    };
    let received = group.broadcast(message, root)?;
    let what = || {
        format!(
            "the batch broadcast from rank {root} of group '{}'",
            group.name()
        )
    };
    let values = read_data(received, what)
        .map_err(|e| e.on_rank(group.global_rank()))?
        .convert::<f32>()
        .to_vec::<f32>()
        .map_err(|e| DataError::Invalid(format!("broadcast_batch: {e:?}")))?;
    if values[0] != 0.0 {
        return Err(DataError::Invalid(format!(
            "broadcast_batch: the root's batch is not [{micro_batch_size}, {}] tokens with ids \
             below 2^47 in magnitude",
            sequence_length + 1
        ))
        .into());
    }
    let tokens = values[1..]
        .chunks_exact(2)
        .map(|pair| pair[0] as i64 * HALF + pair[1] as i64)
        .collect();
    Ok(GptBatch {
        micro_batch_size,
        sequence_length,
        tokens,
    })
}
