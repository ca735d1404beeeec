//! An embedding table whose rows (tokens) are split across tensor-parallel ranks.

use burn::module::{Module, Param};
use burn::tensor::{Int, Tensor, backend::Backend};
use burn_megatron_dist::{DistBackend, ProcessGroup};

use super::placement::{DeclarePlacements, Placements};
use super::tp_context::{SequenceParallelGrads, TpContext};
use super::vocab::VocabPartition;
use crate::backend::ModelBackend;
use crate::error::{IdKind, Result};
use crate::init::{InitDistribution, init_slice};
use crate::ops::CounterNormalOps;
use crate::ops::embedding::embedding_or_zero;

/// Token embeddings split by vocabulary: rank `r` holds the rows of its
/// [`VocabPartition`] range, looks up the tokens that fall in it (zero for the others), and
/// the ranks' partial embeddings are summed over the group, or reduce-scattered along the
/// sequence under sequence parallelism.
#[derive(Module, Debug)]
pub struct VocabParallelEmbedding<B: Backend> {
    /// `[padded_vocab / tp, d_model]`: this rank's rows of the full table, drawn from
    /// `N(0, init_std²)`.
    pub weight: Param<Tensor<B, 2>>,
    #[module(skip)]
    tp: TpContext,
    #[module(skip)]
    vocab: VocabPartition,
}

impl<B: DistBackend + CounterNormalOps> VocabParallelEmbedding<B> {
    /// This rank's rows of a `[vocab.padded_size, d_model]` table; values depend on `seed`
    /// only, not on the layout.
    pub fn new(
        vocab: VocabPartition,
        d_model: usize,
        init_std: f64,
        sequence_parallel: bool,
        tp: &ProcessGroup,
        seed: u64,
        device: &B::Device,
    ) -> Self {
        let weight = init_slice(
            [vocab.padded_size, d_model],
            [vocab.range(), 0..d_model],
            InitDistribution::Normal { std: init_std },
            seed,
            device,
        );
        Self {
            weight: Param::from_tensor(weight),
            tp: TpContext::new(tp, sequence_parallel),
            vocab,
        }
    }

    /// The vocabulary partition.
    pub fn vocab(&self) -> &VocabPartition {
        &self.vocab
    }
}

impl<B: Backend> VocabParallelEmbedding<B> {
    /// The same table (same parameter and id) in a context that sums sequence parallelism's
    /// partial gradients where `grads` says. The table has none of its own; it keeps its
    /// context like the layers after it.
    pub fn with_sequence_parallel_grads(self, grads: SequenceParallelGrads) -> Self {
        self.map_tp_context(&|tp| tp.with_sequence_parallel_grads(grads))
    }

    /// The same (same parameters and ids) with its tensor-parallel context mapped by `f`.
    pub fn map_tp_context(self, f: &dyn Fn(TpContext) -> TpContext) -> Self {
        Self {
            tp: f(self.tp),
            ..self
        }
    }
}

/// The table's rows are sharded over TP, padding rows at the end (see [`VocabPartition`]).
impl<B: Backend> DeclarePlacements for VocabParallelEmbedding<B> {
    fn declare_placements(&self, out: &mut Placements) {
        out.declare(&self.weight, self.vocab.placement());
    }
}

impl<B: ModelBackend> VocabParallelEmbedding<B> {
    /// `[batch, seq]` token ids → `[batch, seq, d_model]`, or `[batch, seq / tp, d_model]`
    /// under sequence parallelism.
    ///
    /// # Shapes
    /// - tokens: `[batch, seq]`
    /// - output: `[batch, seq, d_model]` (`[batch, seq / tp, d_model]` under sequence
    ///   parallelism)
    ///
    /// An id outside `0..vocab_size` is an
    /// [`InputError::IdOutOfRange`](crate::InputError::IdOutOfRange) (on our CUDA backend,
    /// raised at the device's next read or sync: see [`IdCheckOps::check_ids`](crate::ops::IdCheckOps::check_ids)).
    pub fn try_forward(&self, tokens: Tensor<B, 2, Int>) -> Result<Tensor<B, 3>> {
        B::check_ids(tokens.clone(), IdKind::Token, self.vocab.vocab_size)?;
        let partial = embedding_or_zero(self.weight.val(), self.vocab.localize(tokens));
        Ok(self.tp.leave(partial)?)
    }
}
