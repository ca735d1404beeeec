//! The stack of transformer layers and the final norm.

use burn::module::Module;
use burn::tensor::{Tensor, backend::Backend};
use burn_megatron_dist::{DistResult, ProcessGroup};

use super::config::TransformerConfig;
use super::layer::TransformerLayer;
use super::norm::Norm;
use crate::backend::ModelBackend;
use crate::error::ConfigError;

/// Megatron's `TransformerBlock`: `num_layers` pre-norm layers, then the final norm.
#[derive(Module, Debug)]
pub struct TransformerBlock<B: Backend> {
    /// The layers, in order.
    pub layers: Vec<TransformerLayer<B>>,
    /// Norm after the last layer.
    pub final_norm: Norm<B>,
}

impl<B: ModelBackend> TransformerBlock<B> {
    /// This rank's part of every layer.
    pub fn new(
        config: &TransformerConfig,
        tp: &ProcessGroup,
        device: &B::Device,
    ) -> Result<Self, ConfigError> {
        let layers = (0..config.num_layers)
            .map(|i| TransformerLayer::new(config, i, tp, device))
            .collect::<Result<Vec<_>, _>>()?;
        let sp_group = config.sequence_parallel.then(|| tp.clone());
        Ok(Self {
            layers,
            final_norm: Norm::new(
                config.normalization,
                config.hidden_size,
                config.norm_epsilon,
                sp_group,
                device,
            ),
        })
    }

    /// `[batch, seq, hidden]` (`seq / tp` under sequence parallelism) through every layer and
    /// the final norm, for the model's `call`-th forward pass (which picks the dropout masks).
    pub fn try_forward(&self, mut x: Tensor<B, 3>, call: u64) -> DistResult<Tensor<B, 3>> {
        for layer in &self.layers {
            x = layer.try_forward(x, call)?;
        }
        self.final_norm.try_forward(x)
    }
}
