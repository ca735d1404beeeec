//! GPT- and Llama-style decoder models.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::module::{Module, Param};
use burn::tensor::{Int, Tensor, backend::Backend};
use burn_megatron_dist::mapping::scatter_to_sequence_parallel_region;
use burn_megatron_dist::{DistBackend, DistError, DistResult, ProcessGroup};

use crate::error::ConfigError;
use crate::init::{InitDistribution, init_full, param_seed};
use crate::tensor_parallel::{
    DropoutSite, VocabParallelEmbedding, VocabParallelOutput, VocabPartition, masked_mean,
    parallel_lm_logits, vocab_parallel_cross_entropy,
};
use crate::transformer::{
    LayerContext, Norm, PositionEmbedding, TransformerConfig, TransformerLayer, hidden_dropout,
};

/// A decoder-only language model: token (and learned position) embeddings, transformer
/// layers, a final norm and an output layer (tied to the token embeddings or not), each split
/// over the tensor-parallel group as Megatron splits them.
#[derive(Module, Debug)]
pub struct GptModel<B: Backend> {
    /// Token embeddings, split by vocabulary.
    pub embedding: VocabParallelEmbedding<B>,
    /// `[max_sequence_length, hidden]`, replicated; learned positions only.
    pub position_embedding: Option<Param<Tensor<B, 2>>>,
    /// The transformer layers.
    pub layers: Vec<TransformerLayer<B>>,
    /// Norm after the last layer.
    pub final_norm: Norm<B>,
    /// Output layer, split by vocabulary; `None` when tied to the token embeddings.
    pub output: Option<VocabParallelOutput<B>>,
    #[module(skip)]
    context: ModelContext,
}

#[derive(Debug, Clone)]
struct ModelContext {
    tp: ProcessGroup,
    vocab: VocabPartition,
    max_sequence_length: usize,
    layer: LayerContext,
    /// Forward passes so far: picks fresh dropout masks for each.
    calls: Arc<AtomicU64>,
    notes: Vec<String>,
}

impl TransformerConfig {
    /// This rank's part of the model over the tensor-parallel group `tp`. Parameter values
    /// depend on the seed only, so every layout holds slices of the same model.
    pub fn init_gpt<B: DistBackend>(
        &self,
        tp: &ProcessGroup,
        device: &B::Device,
    ) -> Result<GptModel<B>, ConfigError> {
        let validated = self.validate(tp.size(), tp.rank())?;
        let vocab = validated.vocab;
        let hidden = self.hidden_size;
        let seed = |name: &str| param_seed(self.seed, name);
        let embedding = VocabParallelEmbedding::new(
            vocab.clone(),
            hidden,
            self.init_std,
            self.sequence_parallel,
            tp,
            seed("embedding"),
            device,
        );
        let position_embedding =
            (self.position_embedding == PositionEmbedding::Learned).then(|| {
                let table = init_full(
                    [self.max_sequence_length, hidden],
                    InitDistribution::Normal { std: self.init_std },
                    seed("position_embedding"),
                    device,
                );
                Param::from_tensor(table)
            });
        let layers = (0..self.num_layers)
            .map(|i| TransformerLayer::new(self, i, tp, device))
            .collect::<Result<Vec<_>, _>>()?;
        let sp_group = self.sequence_parallel.then(|| tp.clone());
        let output = (!self.tie_embeddings).then(|| {
            VocabParallelOutput::new(&vocab, hidden, self.init_std, seed("output"), device)
        });
        Ok(GptModel {
            embedding,
            position_embedding,
            layers,
            final_norm: Norm::new(
                self.normalization,
                hidden,
                self.norm_epsilon,
                sp_group,
                device,
            ),
            output,
            context: ModelContext {
                tp: tp.clone(),
                vocab,
                max_sequence_length: self.max_sequence_length,
                layer: LayerContext {
                    index: usize::MAX,
                    seed: self.seed,
                    hidden_dropout: self.hidden_dropout,
                    tp: tp.clone(),
                    sequence_parallel: self.sequence_parallel,
                },
                calls: Arc::new(AtomicU64::new(0)),
                notes: validated.notes,
            },
        })
    }
}

impl<B: DistBackend> GptModel<B> {
    /// `[batch, seq]` tokens → `[batch, seq, padded_vocab / tp]`: this rank's slice of the
    /// logits. Under sequence parallelism `seq` must be divisible by the TP size.
    pub fn try_forward(&self, tokens: Tensor<B, 2, Int>) -> DistResult<Tensor<B, 3>> {
        let c = &self.context;
        let [_, seq] = tokens.dims();
        let tp = &c.tp;
        if seq > c.max_sequence_length {
            return Err(DistError::InvalidArgument(format!(
                "sequence of {seq} tokens is longer than the model's maximum of {}",
                c.max_sequence_length
            )));
        }
        if c.layer.sequence_parallel && !seq.is_multiple_of(tp.size()) {
            return Err(DistError::InvalidArgument(format!(
                "sequence parallelism splits the sequence over TP = {}: {seq} tokens do not divide",
                tp.size()
            )));
        }
        let call = c.calls.fetch_add(1, Ordering::Relaxed);
        let mut x = self.embedding.try_forward(tokens)?;
        if let Some(table) = &self.position_embedding {
            let positions = table.val().narrow(0, 0, seq).unsqueeze::<3>();
            let positions = if c.layer.sequence_parallel {
                scatter_to_sequence_parallel_region(positions, tp, 1)?
            } else {
                positions
            };
            x = x + positions;
        }
        x = hidden_dropout(
            x,
            &c.layer,
            DropoutSite::new(c.layer.seed, call, "embedding"),
        );
        for layer in &self.layers {
            x = layer.try_forward(x, call)?;
        }
        let x = self.final_norm.try_forward(x)?;
        let table = match &self.output {
            Some(output) => output.weight.val(),
            None => self.embedding.weight.val(),
        };
        parallel_lm_logits(x, table, tp, c.layer.sequence_parallel)
    }

    /// [`try_forward`](Self::try_forward), panicking on a communication failure.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.try_forward(tokens).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Per-token cross-entropy of `logits` (from [`try_forward`](Self::try_forward)) against
    /// `targets` (`[batch, seq]`), without gathering the vocabulary; `[batch, seq]`.
    pub fn token_losses(
        &self,
        logits: Tensor<B, 3>,
        targets: Tensor<B, 2, Int>,
    ) -> DistResult<Tensor<B, 2>> {
        vocab_parallel_cross_entropy(logits, targets, &self.context.vocab, &self.context.tp)
    }

    /// The mean cross-entropy over the targets that are not negative (a negative target,
    /// such as -100, is ignored).
    pub fn loss(
        &self,
        logits: Tensor<B, 3>,
        targets: Tensor<B, 2, Int>,
    ) -> DistResult<Tensor<B, 1>> {
        let keep = targets.clone().greater_equal_elem(0);
        Ok(masked_mean(self.token_losses(logits, targets)?, keep))
    }

    /// The vocabulary as split over TP.
    pub fn vocab(&self) -> &VocabPartition {
        &self.context.vocab
    }

    /// Notes from building the model, such as vocabulary padding.
    pub fn notes(&self) -> &[String] {
        &self.context.notes
    }
}
