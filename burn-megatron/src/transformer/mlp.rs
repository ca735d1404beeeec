//! The MLP block with its hidden features split across tensor-parallel ranks.

use burn::module::Module;
use burn::tensor::{Tensor, backend::Backend};
use burn_megatron_dist::{DistResult, ProcessGroup};

use super::attention::output_init_std;
use super::config::{Activation, TransformerConfig};
use crate::backend::ModelBackend;
use crate::error::ConfigError;
use crate::init::param_seed;
use crate::ops::{GeluForm, bias_gelu};
use crate::tensor_parallel::{
    ColumnParallelLinear, ColumnParallelLinearConfig, DeclarePlacements, Placements,
    RowParallelLinear, RowParallelLinearConfig, SequenceParallelGrads, TpContext,
};

/// Megatron's `ParallelMLP`: column-parallel up-projection(s), the activation on this rank's
/// features (no communication), and a row-parallel down-projection.
///
/// GeLU takes `fc1`'s bias with it (Megatron's bias-GeLU: `fc1` skips the bias add), through
/// [`bias_gelu`]; SwiGLU takes the gate's and `fc1`'s biases the same way, through
/// [`bias_swiglu`](crate::ops::bias_swiglu). Both have exact backwards.
///
/// SwiGLU's gate and up projections are two layers rather than one fused weight, so that each
/// has a layout-independent initialisation and a plain column split.
#[derive(Module, Debug)]
pub struct ParallelMlp<B: Backend> {
    /// `hidden → ffn`, split by columns.
    pub fc1: ColumnParallelLinear<B>,
    /// `hidden → ffn`, split by columns: SwiGLU's gate.
    pub gate: Option<ColumnParallelLinear<B>>,
    /// `ffn → hidden`, split by rows.
    pub fc2: RowParallelLinear<B>,
    /// The GeLU form, for the GeLU activations (`gate` is `None` then).
    #[module(skip)]
    gelu: Option<GeluForm>,
}

impl<B: Backend> DeclarePlacements for ParallelMlp<B> {
    fn declare_placements(&self, out: &mut Placements) {
        self.fc1.declare_placements(out);
        self.gate.declare_placements(out);
        self.fc2.declare_placements(out);
    }
}

impl<B: Backend> ParallelMlp<B> {
    /// The same MLP (same parameters and ids), summing `fc2`'s partial bias gradient under
    /// sequence parallelism where `grads` says.
    pub fn with_sequence_parallel_grads(self, grads: SequenceParallelGrads) -> Self {
        self.map_tp_context(&|tp| tp.with_sequence_parallel_grads(grads))
    }

    /// The same MLP (same parameters and ids) with its layers' tensor-parallel contexts
    /// mapped by `f`.
    pub fn map_tp_context(self, f: &dyn Fn(TpContext) -> TpContext) -> Self {
        Self {
            fc1: self.fc1.map_tp_context(f),
            gate: self.gate.map(|g| g.map_tp_context(f)),
            fc2: self.fc2.map_tp_context(f),
            gelu: self.gelu,
        }
    }

    /// The same MLP (same parameters and ids) with its tokens split over `cp` (the
    /// context-parallel group): FP8 layers reduce their activations' amaxes over it.
    pub fn with_sequence_group(self, cp: Option<&ProcessGroup>) -> Self {
        Self {
            fc1: self.fc1.with_sequence_group(cp),
            gate: self.gate.map(|g| g.with_sequence_group(cp)),
            fc2: self.fc2.with_sequence_group(cp),
            gelu: self.gelu,
        }
    }
}

impl<B: ModelBackend> ParallelMlp<B> {
    /// This rank's part of layer `layer`'s MLP.
    pub fn new(
        config: &TransformerConfig,
        layer: usize,
        tp: &ProcessGroup,
        device: &B::Device,
    ) -> Result<Self, ConfigError> {
        let seed = |name: &str| param_seed(config.seed, &format!("layers.{layer}.mlp.{name}"));
        let up = || {
            ColumnParallelLinearConfig::new(config.hidden_size, config.ffn_hidden_size)
                .with_bias(config.add_bias_linear)
                .with_sequence_parallel(config.sequence_parallel)
                .with_comm_overlap(config.tp_comm_overlap)
                .with_init_std(config.init_std)
                .with_fp8(config.fp8_for_layer(layer))
        };
        let gate = match config.activation {
            Activation::SwiGlu => Some(up().init(tp, seed("gate"), device)?),
            Activation::Gelu | Activation::GeluTanh => None,
        };
        Ok(Self {
            fc1: up().init(tp, seed("fc1"), device)?,
            gate,
            fc2: RowParallelLinearConfig::new(config.ffn_hidden_size, config.hidden_size)
                .with_bias(config.add_bias_linear)
                .with_sequence_parallel(config.sequence_parallel)
                .with_comm_overlap(config.tp_comm_overlap)
                .with_init_std(output_init_std(config))
                .with_fp8(config.fp8_for_layer(layer))
                .init(tp, seed("fc2"), device)?,
            gelu: config.activation.gelu_form(),
        })
    }

    /// `[batch, seq, hidden]` → `[batch, seq, hidden]` (`seq / tp` in and out under sequence
    /// parallelism).
    ///
    /// Every operation between the all-gather before `fc1` and the reduce-scatter after `fc2`
    /// works row by row, so the tokens need not be in sequence order there. The block runs on
    /// `[1, batch · seq, hidden]`: the sequence-parallel all-gather then concatenates whole
    /// rank shards (rank-major token order), and the reduce-scatter hands each rank back its
    /// own tokens. On NCCL both are then flat calls without the copies that reorder tokens
    /// into `[batch, seq]` order and back.
    ///
    /// # Shapes
    /// - x and the output: `[batch, seq, hidden]` (`seq / tp` under sequence parallelism)
    pub fn try_forward(&self, x: Tensor<B, 3>) -> DistResult<Tensor<B, 3>> {
        let [batch, seq, features] = x.dims();
        let x = x.reshape([1, batch * seq, features]);
        let hidden = match (&self.gate, self.gelu) {
            // One entry into the tensor-parallel region for both projections.
            (Some(gate), _) => self.fc1.try_forward_swiglu(gate, x)?,
            (None, Some(form)) => {
                let (h, bias) = self.fc1.try_forward_skip_bias(x)?;
                bias_gelu(h, bias, form)
            }
            (None, None) => unreachable!("`new` gives an MLP without a gate a GeLU form"),
        };
        Ok(self
            .fc2
            .try_forward(hidden)?
            .reshape([batch, seq, features]))
    }
}
