//! The output layer: hidden states to logits over this rank's slice of the vocabulary.

use burn::module::{Module, Param};
use burn::tensor::{Tensor, backend::Backend};
use burn_megatron_dist::{DistBackend, DistResult};

use crate::backend::ModelBackend;
use crate::ops::hooked_linear;

use super::placement::{DeclarePlacements, Placements};
use super::tp_context::TpContext;
use super::vocab::VocabPartition;
use crate::init::{InitDistribution, init_slice};
use crate::ops::CounterNormalOps;

/// An untied output layer: its own `[padded_vocab / tp, hidden]` table, laid out like the
/// token embedding so that the two can be tied or not with the same code.
#[derive(Module, Debug)]
pub struct VocabParallelOutput<B: Backend> {
    /// `[padded_vocab / tp, hidden]`: this rank's rows, drawn from `N(0, init_std²)`.
    pub weight: Param<Tensor<B, 2>>,
    #[module(skip)]
    vocab: VocabPartition,
}

impl<B: DistBackend + CounterNormalOps> VocabParallelOutput<B> {
    /// This rank's rows of the output table; values depend on `seed` only.
    pub fn new(
        vocab: &VocabPartition,
        hidden: usize,
        init_std: f64,
        seed: u64,
        device: &B::Device,
    ) -> Self {
        let weight = init_slice(
            [vocab.padded_size, hidden],
            [vocab.range(), 0..hidden],
            InitDistribution::Normal { std: init_std },
            seed,
            device,
        );
        Self {
            weight: Param::from_tensor(weight),
            vocab: vocab.clone(),
        }
    }
}

/// The table's rows are sharded over TP, padding rows at the end (see [`VocabPartition`]).
impl<B: Backend> DeclarePlacements for VocabParallelOutput<B> {
    fn declare_placements(&self, out: &mut Placements) {
        out.declare(&self.weight, self.vocab.placement());
    }
}

/// Megatron's `parallel_lm_logits`: `[batch, seq, hidden]` (or `[batch, seq / tp, hidden]`
/// under sequence parallelism) times this rank's `[vocab / tp, hidden]` table gives
/// `[batch, seq, vocab / tp]`, this rank's slice of the logits. The input enters the
/// tensor-parallel region through *f* (or an all-gather of the sequence).
pub fn parallel_lm_logits<B: ModelBackend>(
    hidden: Tensor<B, 3>,
    weight: Tensor<B, 2>,
    tp: &TpContext,
) -> DistResult<Tensor<B, 3>> {
    Ok(hooked_linear(
        tp.enter(hidden)?,
        weight,
        None,
        true,
        tp.backward_hook.as_ref(),
    ))
}
