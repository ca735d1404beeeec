//! LayerNorm and RMSNorm over the hidden dimension, aware of sequence parallelism.

use burn::module::{Module, Param};
use burn::tensor::{Tensor, backend::Backend};
use burn_megatron_dist::mapping::copy_to_tensor_parallel_region;
use burn_megatron_dist::{DistBackend, DistResult};

use super::config::Normalization;
use crate::ModelBackend;
use crate::ops::{NormKind, norm};
use crate::tensor_parallel::{
    DeclarePlacements, ParamPlacement, Placements, SequenceParallelGrads, TpContext,
};

/// Normalisation of the last dimension: `(x - mean) / sqrt(var + eps) · scale + shift`
/// (LayerNorm) or `x / sqrt(mean(x²) + eps) · scale` (RMSNorm).
///
/// Its parameters are replicated on every TP rank. Under sequence parallelism each rank
/// normalises its own part of the sequence, so each holds a partial gradient. They enter
/// through *f* ([`TpContext::replicated`]), which sums it over the TP group, unless the norm
/// defers that sum ([`with_sequence_parallel_grads`](Self::with_sequence_parallel_grads), as
/// the training schedules do) to one all-reduce of every such gradient after the backward
/// pass (Megatron's "sequence-parallel parameters"). The norm declares them for it
/// ([`Placements::declare_partial_gradient`]).
///
/// A norm over each attention head's vector ([`per_head`](Self::per_head), QK-norm) sees only
/// this rank's heads: its gradient is always partial over the TP group, and *f*
/// ([`copy_to_tensor_parallel_region`]) sums it in the backward pass, with or without
/// sequence parallelism.
#[derive(Module, Debug)]
pub struct Norm<B: Backend> {
    /// `[hidden]`, initialised to one.
    pub scale: Param<Tensor<B, 1>>,
    /// `[hidden]`, initialised to zero; LayerNorm only.
    pub shift: Option<Param<Tensor<B, 1>>>,
    #[module(skip)]
    epsilon: f64,
    #[module(skip)]
    tp: TpContext,
    /// Whether the input is this rank's attention heads (QK-norm) rather than the residual
    /// stream.
    #[module(skip)]
    over_heads: bool,
}

/// Scale and shift are replicated on every TP rank.
impl<B: Backend> DeclarePlacements for Norm<B> {
    fn declare_placements(&self, out: &mut Placements) {
        out.declare(&self.scale, ParamPlacement::replicated());
        if let Some(shift) = &self.shift {
            out.declare(shift, ParamPlacement::replicated());
        }
        if self.tp.sequence_parallel && !self.over_heads {
            let grads = self.tp.sequence_parallel_grads;
            out.declare_partial_gradient(&self.scale, grads);
            if let Some(shift) = &self.shift {
                out.declare_partial_gradient(shift, grads);
            }
        }
    }
}

impl<B: DistBackend> Norm<B> {
    /// A norm over `hidden` features in the tensor-parallel context `tp`.
    pub fn new(
        kind: Normalization,
        hidden: usize,
        epsilon: f64,
        tp: &TpContext,
        device: &B::Device,
    ) -> Self {
        Self {
            scale: Param::from_tensor(Tensor::ones([hidden], device)),
            shift: (kind == Normalization::LayerNorm)
                .then(|| Param::from_tensor(Tensor::zeros([hidden], device))),
            epsilon,
            tp: tp.clone(),
            over_heads: false,
        }
    }

    /// A norm over each attention head's `head_dim` features, its weights shared by the heads
    /// (Megatron's `--qk-layernorm`): the input is this rank's heads, so the weights'
    /// gradients are summed over the TP group in the backward pass.
    pub fn per_head(
        kind: Normalization,
        head_dim: usize,
        epsilon: f64,
        tp: &TpContext,
        device: &B::Device,
    ) -> Self {
        Self {
            over_heads: true,
            ..Self::new(kind, head_dim, epsilon, tp, device)
        }
    }
}

impl<B: Backend> Norm<B> {
    /// The same norm (same parameters and ids), summing its partial gradients under sequence
    /// parallelism where `grads` says.
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

impl<B: ModelBackend> Norm<B> {
    /// One [`NormOps::norm`](crate::ops::NormOps::norm) (a fused kernel on CubeCL backends).
    ///
    /// # Shapes
    /// - x and the output: `[..., hidden]`
    pub fn try_forward<const D: usize>(&self, x: Tensor<B, D>) -> DistResult<Tensor<B, D>> {
        let (kind, scale, shift) = self.parameters()?;
        Ok(norm(x, scale, shift, kind, self.epsilon))
    }

    /// The kind of norm, the scale and the shift as this rank's forward uses them (entered
    /// into the tensor-parallel region for a norm over heads).
    fn parameters(&self) -> DistResult<(NormKind, Tensor<B, 1>, Option<Tensor<B, 1>>)> {
        let param = |p: &Param<Tensor<B, 1>>| match self.over_heads {
            true => copy_to_tensor_parallel_region(p.val(), &self.tp.group),
            false => self.tp.replicated(p.val()),
        };
        Ok(match &self.shift {
            Some(shift) => (
                NormKind::LayerNorm,
                param(&self.scale)?,
                Some(param(shift)?),
            ),
            None => (NormKind::RmsNorm, param(&self.scale)?, None),
        })
    }

    /// `x + residual` and this norm of it, as [`NormOps::add_norm`](crate::ops::NormOps::add_norm)
    /// (one kernel on CubeCL backends): the residual add before a norm, for inference.
    /// Returns the sum, then the norm's output.
    ///
    /// # Shapes
    /// - x, residual and both outputs: `[..., hidden]`
    pub fn try_forward_add<const D: usize>(
        &self,
        x: Tensor<B, D>,
        residual: Tensor<B, D>,
    ) -> DistResult<[Tensor<B, D>; 2]> {
        let (kind, scale, shift) = self.parameters()?;
        let dims = x.dims();
        let hidden = dims[D - 1];
        let rows = dims[..D - 1].iter().product();
        let [sum, normed] = B::add_norm(
            x.reshape([rows, hidden]),
            residual.reshape([rows, hidden]),
            scale,
            shift,
            kind,
            self.epsilon,
        );
        Ok([sum.reshape(dims), normed.reshape(dims)])
    }
}
