//! The stack of transformer layers and the final norm.

use core::ops::Range;

use burn::module::Module;
use burn::tensor::{Tensor, backend::Backend};
use burn_megatron_dist::{DistResult, ProcessGroup};

use super::config::TransformerConfig;
use super::layer::{TransformerLayer, single_rank_group};
use super::norm::Norm;
use crate::backend::ModelBackend;
use crate::context_parallel::CpContext;
use crate::error::ConfigError;
use crate::tensor_parallel::{DeclarePlacements, Placements, SequenceParallelGrads, TpContext};

/// Megatron's `TransformerBlock`: pre-norm layers, then the final norm. A pipeline stage's
/// block holds its own layers only, and the final norm only on the last stage (Megatron's
/// `post_layer_norm` under `post_process`).
#[derive(Module, Debug)]
pub struct TransformerBlock<B: Backend> {
    /// The layers, in order (`layers[i]` is global layer `first + i` of a stage).
    pub layers: Vec<TransformerLayer<B>>,
    /// Norm after the last layer; `None` on a pipeline stage other than the last.
    pub final_norm: Option<Norm<B>>,
}

impl<B: Backend> DeclarePlacements for TransformerBlock<B> {
    fn declare_placements(&self, out: &mut Placements) {
        self.layers.declare_placements(out);
        self.final_norm.declare_placements(out);
    }
}

impl<B: Backend> TransformerBlock<B> {
    /// The same block (same parameters and ids), summing the gradients sequence parallelism
    /// leaves partial where `grads` says.
    pub fn with_sequence_parallel_grads(self, grads: SequenceParallelGrads) -> Self {
        self.map_tp_context(&|tp| tp.with_sequence_parallel_grads(grads))
    }

    /// The same block (same parameters and ids) with its layers' tensor-parallel contexts
    /// mapped by `f`.
    pub fn map_tp_context(self, f: &dyn Fn(TpContext) -> TpContext) -> Self {
        Self {
            layers: self
                .layers
                .into_iter()
                .map(|layer| layer.map_tp_context(f))
                .collect(),
            final_norm: self.final_norm.map(|norm| norm.map_tp_context(f)),
        }
    }
}

impl<B: Backend> TransformerBlock<B> {
    /// The same block (same parameters and ids) over the context-parallel group of `cp`
    /// ([`TransformerLayer::with_context_parallel`]).
    pub fn with_context_parallel(self, cp: Option<CpContext>) -> Result<Self, ConfigError> {
        Ok(Self {
            layers: self
                .layers
                .into_iter()
                .map(|layer| layer.with_context_parallel(cp.clone()))
                .collect::<Result<Vec<_>, _>>()?,
            final_norm: self.final_norm,
        })
    }
}

impl<B: ModelBackend> TransformerBlock<B> {
    /// This rank's part of every layer.
    pub fn new(
        config: &TransformerConfig,
        tp: &ProcessGroup,
        device: &B::Device,
    ) -> Result<Self, ConfigError> {
        Self::new_stage(config, 0..config.num_layers, true, tp, device)
    }

    /// This rank's part of the global layers `layers` (a pipeline stage's), with the final
    /// norm if `final_norm`. Values depend on the global layer index only, so a stage holds
    /// exactly those layers of the whole model.
    pub fn new_stage(
        config: &TransformerConfig,
        layers: Range<usize>,
        final_norm: bool,
        tp: &ProcessGroup,
        device: &B::Device,
    ) -> Result<Self, ConfigError> {
        let ep = single_rank_group(tp)?;
        Self::new_stage_with_ep(config, layers, final_norm, tp, &ep, device)
    }

    /// [`new_stage`](Self::new_stage) with the MoE layers' experts split over the
    /// expert-parallel group `ep`.
    pub fn new_stage_with_ep(
        config: &TransformerConfig,
        layers: Range<usize>,
        final_norm: bool,
        tp: &ProcessGroup,
        ep: &ProcessGroup,
        device: &B::Device,
    ) -> Result<Self, ConfigError> {
        let layers = layers
            .map(|i| TransformerLayer::new_with_ep(config, i, tp, ep, device))
            .collect::<Result<Vec<_>, _>>()?;
        let context = TpContext::new(tp, config.sequence_parallel);
        Ok(Self {
            layers,
            final_norm: final_norm.then(|| {
                Norm::new(
                    config.normalization,
                    config.hidden_size,
                    config.norm_epsilon,
                    &context,
                    device,
                )
            }),
        })
    }

    /// `x` through every layer and the final norm (if the block has it), for the model's
    /// `call`-th forward pass (which picks the dropout masks).
    ///
    /// # Shapes
    /// - x and the output: `[batch, seq, hidden]` (`seq / tp` under sequence parallelism)
    pub fn try_forward(&self, mut x: Tensor<B, 3>, call: u64) -> DistResult<Tensor<B, 3>> {
        for layer in &self.layers {
            x = layer.try_forward(x, call)?;
        }
        match &self.final_norm {
            Some(norm) => norm.try_forward(x),
            None => Ok(x),
        }
    }
}
