//! [`MoeLosses`]: what the MoE layers of one forward pass add to the model's loss (the
//! router's auxiliary losses, see [`super::aux_losses`]), with the experts' load for the log.

use burn::tensor::{Tensor, backend::Backend};

use super::layer::MoeOutput;

/// The auxiliary losses of the MoE layers one forward pass ran, summed over the layers
/// (coefficients included), and each layer's load.
///
/// Megatron attaches these losses to the activations (`MoEAuxLossAutoScaler`) so that they
/// backpropagate with the main loss; here the caller adds [`total`](Self::total) to the
/// loss it backpropagates, which the schedules of
/// [`pipeline_parallel`](crate::pipeline_parallel) do for each stage's layers.
#[derive(Debug, Clone)]
pub struct MoeLosses<B: Backend> {
    load_balancing_loss: Option<Tensor<B, 1>>,
    z_loss: Option<Tensor<B, 1>>,
    /// For each MoE layer run, in order: its global index and how many of this rank's token
    /// assignments each expert got.
    pub tokens_per_expert: Vec<(usize, Vec<usize>)>,
    /// This rank's assignments dropped by over-full experts, summed over the layers.
    pub dropped: usize,
}

impl<B: Backend> Default for MoeLosses<B> {
    fn default() -> Self {
        Self {
            load_balancing_loss: None,
            z_loss: None,
            tokens_per_expert: Vec::new(),
            dropped: 0,
        }
    }
}

impl<B: Backend> MoeLosses<B> {
    /// Adds the losses and load of global layer `layer`'s MoE output.
    pub fn push(&mut self, layer: usize, output: &MoeOutput<B>) {
        let add = |sum: &mut Option<Tensor<B, 1>>, loss: &Tensor<B, 1>| {
            *sum = Some(match sum.take() {
                Some(s) => s + loss.clone(),
                None => loss.clone(),
            });
        };
        add(&mut self.load_balancing_loss, &output.load_balancing_loss);
        add(&mut self.z_loss, &output.z_loss);
        self.tokens_per_expert
            .push((layer, output.tokens_per_expert.clone()));
        self.dropped += output.dropped;
    }

    /// Whether no MoE layer ran.
    pub fn is_empty(&self) -> bool {
        self.tokens_per_expert.is_empty()
    }

    /// `[1]`: the load-balancing losses, summed over the layers; `None` if no MoE layer ran.
    pub fn load_balancing_loss(&self) -> Option<Tensor<B, 1>> {
        self.load_balancing_loss.clone()
    }

    /// `[1]`: the z-losses, summed over the layers; `None` if no MoE layer ran.
    pub fn z_loss(&self) -> Option<Tensor<B, 1>> {
        self.z_loss.clone()
    }

    /// `[1]`: both, the term to add to the loss; `None` if no MoE layer ran.
    pub fn total(&self) -> Option<Tensor<B, 1>> {
        match (&self.load_balancing_loss, &self.z_loss) {
            (Some(a), Some(z)) => Some(a.clone() + z.clone().cast(a.dtype())),
            (Some(a), None) => Some(a.clone()),
            (None, Some(z)) => Some(z.clone()),
            (None, None) => None,
        }
    }

    /// `loss` plus [`total`](Self::total), in `loss`'s dtype.
    ///
    /// The losses come in the router's dtype (BF16 in a BF16 model), the cross-entropy in
    /// F32, and Burn does not promote: a binary kernel reads both operands in the left one's
    /// dtype. Added uncast, the F32 loss plus a BF16 loss read the BF16 bytes as F32, and the
    /// gradient the main loss got back was wrong (on GPUs, with several microbatches, 4 times
    /// too large at 4; nothing at all with a coefficient of 0).
    pub fn add_to(&self, loss: Tensor<B, 1>) -> Tensor<B, 1> {
        match self.total() {
            Some(aux) => {
                let dtype = loss.dtype();
                loss + aux.cast(dtype)
            }
            None => loss,
        }
    }
}
