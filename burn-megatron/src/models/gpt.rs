//! GPT- and Llama-style decoder models.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, backend::Backend};
use burn_megatron_dist::mapping::scatter_to_sequence_parallel_region;
use burn_megatron_dist::{DistResult, ProcessGroup};

use crate::backend::ModelBackend;
use crate::error::{ConfigError, InputError, Result};
use crate::init::{InitDistribution, init_full, param_seed};
use crate::tensor_parallel::{
    DropoutSite, VocabParallelEmbedding, VocabParallelOutput, VocabPartition, masked_mean,
    parallel_lm_logits, vocab_parallel_cross_entropy,
};
use crate::transformer::{
    LayerContext, PositionEmbedding, Recompute, TransformerBlock, TransformerConfig, hidden_dropout,
};

/// A decoder-only language model: token (and learned position) embeddings, a
/// [`TransformerBlock`] (layers and final norm) and an output layer (tied to the token embeddings or not), each split
/// over the tensor-parallel group as Megatron splits them.
#[derive(Module, Debug)]
pub struct GptModel<B: Backend> {
    /// Token embeddings, split by vocabulary.
    pub embedding: VocabParallelEmbedding<B>,
    /// `[max_sequence_length, hidden]`, replicated; learned positions only.
    pub position_embedding: Option<Param<Tensor<B, 2>>>,
    /// The transformer layers and the final norm.
    pub block: TransformerBlock<B>,
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
    recompute: Recompute,
    notes: Vec<String>,
}

impl TransformerConfig {
    /// This rank's part of the model over the tensor-parallel group `tp`. Parameter values
    /// depend on the seed only, so every layout holds slices of the same model.
    pub fn init_gpt<B: ModelBackend>(
        &self,
        tp: &ProcessGroup,
        device: &B::Device,
    ) -> core::result::Result<GptModel<B>, ConfigError> {
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
        let output = (!self.tie_embeddings).then(|| {
            VocabParallelOutput::new(&vocab, hidden, self.init_std, seed("output"), device)
        });
        Ok(GptModel {
            embedding,
            position_embedding,
            block: TransformerBlock::new(self, tp, device)?,
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
                recompute: self.recompute,
                notes: validated.notes,
            },
        })
    }
}

impl<B: ModelBackend> GptModel<B> {
    /// `[batch, seq]` tokens → `[batch, seq, padded_vocab / tp]`: this rank's slice of the
    /// logits. Under sequence parallelism `seq` must be divisible by the TP size; every token
    /// id must be in `0..vocab_size` (an [`InputError`] otherwise).
    pub fn try_forward(&self, tokens: Tensor<B, 2, Int>) -> Result<Tensor<B, 3>> {
        let call = self.next_call();
        let x = self.embed(tokens, call)?;
        Ok(self.logits(self.block.try_forward(x, call)?)?)
    }

    /// [`try_forward`](Self::try_forward), panicking with its error: Burn's convention of an
    /// infallible `forward(input) -> output`, for code written against it. Prefer
    /// `try_forward`.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.try_forward(tokens).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Per-token cross-entropy of `logits` (from [`try_forward`](Self::try_forward)) against
    /// `targets` (`[batch, seq]`), without gathering the vocabulary; `[batch, seq]`. A target
    /// at or above the vocabulary size is an [`InputError`].
    pub fn token_losses(
        &self,
        logits: Tensor<B, 3>,
        targets: Tensor<B, 2, Int>,
    ) -> Result<Tensor<B, 2>> {
        vocab_parallel_cross_entropy(logits, targets, &self.context.vocab, &self.context.tp)
    }

    /// The mean cross-entropy over the targets that are not negative (a negative target,
    /// such as -100, is ignored).
    pub fn loss(&self, logits: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Result<Tensor<B, 1>> {
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

    /// The activation recomputation the model was built with.
    pub fn recompute(&self) -> Recompute {
        self.context.recompute
    }

    fn next_call(&self) -> u64 {
        self.context.calls.fetch_add(1, Ordering::Relaxed)
    }

    /// Token and position embeddings with dropout: the residual stream's start,
    /// `[batch, seq, hidden]` (`seq / tp` under sequence parallelism).
    fn embed(&self, tokens: Tensor<B, 2, Int>, call: u64) -> Result<Tensor<B, 3>> {
        let c = &self.context;
        let [_, seq] = tokens.dims();
        let tp = &c.tp;
        if seq > c.max_sequence_length {
            return Err(InputError::SequenceTooLong {
                len: seq,
                max: c.max_sequence_length,
            }
            .into());
        }
        if c.layer.sequence_parallel && !seq.is_multiple_of(tp.size()) {
            return Err(InputError::SequenceNotDivisible {
                len: seq,
                tp: tp.size(),
            }
            .into());
        }
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
        Ok(hidden_dropout(
            x,
            &c.layer,
            DropoutSite::new(c.layer.seed, call, "embedding"),
        ))
    }

    /// Output layer: the normalised residual stream to this rank's slice of the logits.
    fn logits(&self, x: Tensor<B, 3>) -> DistResult<Tensor<B, 3>> {
        let table = match &self.output {
            Some(output) => output.weight.val(),
            None => self.embedding.weight.val(),
        };
        parallel_lm_logits(
            x,
            table,
            &self.context.tp,
            self.context.layer.sequence_parallel,
        )
    }
}

impl<B> GptModel<B>
where
    B: AutodiffBackend + ModelBackend,
{
    /// One training step's forward and backward pass: the mean loss (see
    /// [`loss`](Self::loss)) and the gradient of every parameter.
    ///
    /// With [`Recompute::Full`] it stores only each layer's input: the forward pass runs the
    /// layers without recording a graph, and the backward pass reruns one layer at a time
    /// (with the same dropout masks) and backpropagates through it from the gradient of its
    /// output. Otherwise it is `loss.backward()`.
    ///
    /// A collective that fails during the backward pass is returned here as an error (see
    /// [`ProcessGroup::backward_failure`]).
    pub fn forward_backward(
        &self,
        tokens: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
    ) -> Result<(Tensor<B::InnerBackend, 1>, GradientsParams)> {
        if self.context.recompute != Recompute::Full {
            let loss = self.loss(self.try_forward(tokens)?, targets)?;
            let grads = loss.backward();
            self.context.tp.backward_failure()?;
            let grads = GradientsParams::from_grads(grads, self);
            return Ok((loss.inner(), grads));
        }
        let call = self.next_call();
        let embedded = self.embed(tokens, call)?;
        let layers = &self.block.layers;
        let mut inputs = Vec::with_capacity(layers.len());
        let mut x = embedded.clone().inner();
        for layer in layers {
            inputs.push(x.clone());
            x = layer
                .clone()
                .no_grad()
                .try_forward(Tensor::from_inner(x), call)?
                .inner();
        }

        let mut grads = GradientsParams::new();
        let last = Tensor::<B, 3>::from_inner(x).require_grad();
        let normalised = self.block.final_norm.try_forward(last.clone())?;
        let loss = self.loss(self.logits(normalised)?, targets)?;
        let head = self.segment_backward(loss.clone())?;
        let mut upstream = last
            .grad(&head)
            .expect("the last layer's output feeds the loss");
        accumulate(&mut grads, &self.block.final_norm, &head);
        match &self.output {
            Some(output) => accumulate(&mut grads, output, &head),
            None => accumulate(&mut grads, &self.embedding, &head),
        }

        for (layer, input) in layers.iter().zip(inputs).rev() {
            let input = Tensor::<B, 3>::from_inner(input).require_grad();
            let output = layer.try_forward(input.clone(), call)?;
            let layer_grads =
                self.segment_backward((output * Tensor::from_inner(upstream)).sum())?;
            upstream = input
                .grad(&layer_grads)
                .expect("a layer's input reaches its output");
            accumulate(&mut grads, layer, &layer_grads);
        }

        let embedding_grads =
            self.segment_backward((embedded * Tensor::from_inner(upstream)).sum())?;
        accumulate(&mut grads, &self.embedding, &embedding_grads);
        if let Some(table) = &self.position_embedding {
            accumulate(&mut grads, table, &embedding_grads);
        }
        Ok((loss.inner(), grads))
    }
}

impl<B: AutodiffBackend + ModelBackend> GptModel<B> {
    /// Backpropagates one segment of a recomputed step, then waits for the TP group.
    ///
    /// Burn's autodiff ends every backward pass by locking every graph in the process. Two
    /// back-to-back backward passes could otherwise deadlock thread ranks: one rank, in its
    /// next segment's backward, holds its graph while waiting for a peer's collective, and
    /// the peer, still cleaning up after the previous segment, waits for that graph.
    fn segment_backward(&self, root: Tensor<B, 1>) -> DistResult<B::Gradients> {
        let grads = root.backward();
        self.context.tp.backward_failure()?;
        self.context.tp.barrier()?;
        Ok(grads)
    }
}

/// Adds the gradients `grads` holds for `module`'s parameters to `total`.
fn accumulate<B: AutodiffBackend, M: Module<B>>(
    total: &mut GradientsParams,
    module: &M,
    grads: &B::Gradients,
) {
    struct Add<'a, B: AutodiffBackend> {
        total: &'a mut GradientsParams,
        grads: &'a B::Gradients,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Add<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = param.grad(self.grads) {
                let sum = match self.total.remove::<B::InnerBackend, D>(param.id) {
                    Some(previous) => previous + grad,
                    None => grad,
                };
                self.total.register(param.id, sum);
            }
        }
    }
    module.visit(&mut Add { total, grads });
}
