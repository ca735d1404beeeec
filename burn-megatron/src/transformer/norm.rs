//! LayerNorm and RMSNorm over the hidden dimension, aware of sequence parallelism.

use burn::module::{Module, Param};
use burn::tensor::{Tensor, backend::Backend};
use burn_megatron_dist::mapping::copy_to_tensor_parallel_region;
use burn_megatron_dist::{DistBackend, DistResult, ProcessGroup};

use super::config::Normalization;
use crate::ModelBackend;
use crate::ops::{NormKind, norm};
use crate::tensor_parallel::{DeclarePlacements, ParamPlacement, Placements};

/// Normalisation of the last dimension: `(x - mean) / sqrt(var + eps) · scale + shift`
/// (LayerNorm) or `x / sqrt(mean(x²) + eps) · scale` (RMSNorm).
///
/// Its parameters are replicated on every TP rank. Under sequence parallelism each rank
/// normalises its own part of the sequence, so each holds a partial gradient: the parameters
/// enter through *f*, which sums the gradient over the TP group (Megatron reduces these
/// "sequence-parallel parameters" after the backward pass instead).
#[derive(Module, Debug)]
pub struct Norm<B: Backend> {
    /// `[hidden]`, initialised to one.
    pub scale: Param<Tensor<B, 1>>,
    /// `[hidden]`, initialised to zero; LayerNorm only.
    pub shift: Option<Param<Tensor<B, 1>>>,
    #[module(skip)]
    epsilon: f64,
    #[module(skip)]
    sequence_parallel_group: Option<ProcessGroup>,
}

/// Scale and shift are replicated on every TP rank.
impl<B: Backend> DeclarePlacements for Norm<B> {
    fn declare_placements(&self, out: &mut Placements) {
        out.declare(&self.scale, ParamPlacement::replicated());
        if let Some(shift) = &self.shift {
            out.declare(shift, ParamPlacement::replicated());
        }
    }
}

impl<B: DistBackend> Norm<B> {
    /// A norm over `hidden` features; `sequence_parallel_group` is the TP group when sequence
    /// parallelism is on.
    pub fn new(
        kind: Normalization,
        hidden: usize,
        epsilon: f64,
        sequence_parallel_group: Option<ProcessGroup>,
        device: &B::Device,
    ) -> Self {
        Self {
            scale: Param::from_tensor(Tensor::ones([hidden], device)),
            shift: (kind == Normalization::LayerNorm)
                .then(|| Param::from_tensor(Tensor::zeros([hidden], device))),
            epsilon,
            sequence_parallel_group,
        }
    }
}

impl<B: ModelBackend> Norm<B> {
    /// `[.., hidden]` → `[.., hidden]`, one [`ModelBackend::norm`] (a fused kernel on CubeCL
    /// backends).
    pub fn try_forward<const D: usize>(&self, x: Tensor<B, D>) -> DistResult<Tensor<B, D>> {
        let param = |p: &Param<Tensor<B, 1>>| -> DistResult<Tensor<B, 1>> {
            match &self.sequence_parallel_group {
                Some(tp) => copy_to_tensor_parallel_region(p.val(), tp),
                None => Ok(p.val()),
            }
        };
        let (kind, shift) = match &self.shift {
            Some(shift) => (NormKind::LayerNorm, Some(param(shift)?)),
            None => (NormKind::RmsNorm, None),
        };
        Ok(norm(x, param(&self.scale)?, shift, kind, self.epsilon))
    }
}
