//! Global-norm gradient clipping over every rank of a model replica: Megatron's
//! `clip_grad_norm_fp32` (`megatron/core/optimizer/clip_grads.py`).
//!
//! The norm is that of the whole model's gradient, each parameter counted once:
//!
//! - a parameter split over TP counts on every TP rank (each holds its slice);
//! - a TP-replicated parameter (norms, the row-parallel layers' biases, learned position
//!   embeddings: declared [`ParamPlacement::replicated`](crate::tensor_parallel::ParamPlacement)) holds the full
//!   gradient on every TP rank, and counts on TP rank 0 only (Megatron's
//!   `param_is_not_tensor_parallel_duplicate`);
//! - a tied embedding's copy on the last pipeline stage (its gradient all-reduced with the
//!   first stage's) does not count (Megatron's `shared` parameters).
//!
//! Each rank sums the squares of its counted gradients in f32 and the sums are all-reduced
//! over the model-parallel (TP × PP) group. Data-parallel ranks hold equal, already reduced
//! gradients, so they need no reduction: each computes the same norm. The norm stays a
//! device tensor and the gradients are scaled by `min(1, max_norm / (norm + 1e-6))` on the
//! device, so a GPU step never waits for the host.

use std::collections::HashSet;

use burn::config::Config;
use burn::module::{Module, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use burn_megatron_dist::{DistBackend, ParallelState, ProcessGroup, ReduceOp};

use super::grads::{Counted, Reduction, reduce_grads, scale_grads};
use crate::error::ConfigError;
use crate::tensor_parallel::{DeclarePlacements, try_param_infos};

/// Added to the norm before dividing, as Megatron does.
pub const CLIP_EPSILON: f64 = 1e-6;

/// Global-norm gradient clipping (`--clip-grad`).
#[derive(Config, Debug, Copy, PartialEq)]
pub struct GradClipConfig {
    /// The largest global L2 norm of the gradients; larger gradients are scaled down to it.
    #[config(default = 1.0)]
    pub max_norm: f64,
}

impl GradClipConfig {
    /// Checks that `max_norm` is a positive, finite number.
    pub fn validate(&self) -> core::result::Result<(), ConfigError> {
        if self.max_norm.is_finite() && self.max_norm > 0.0 {
            Ok(())
        } else {
            Err(ConfigError::Invalid(format!(
                "the clipping norm max_norm (--clip-grad) is {}: it must be positive and finite",
                self.max_norm
            )))
        }
    }
}

/// Paths of `model`'s parameters that copy a parameter counted on another rank (see
/// [`DeclarePlacements::shared_copies`]): for a GPT, the last stage's copy of a tied embedding
/// table (`output.weight`).
pub fn shared_copies<M: DeclarePlacements>(model: &M) -> Vec<String> {
    model.shared_copies()
}

/// This rank's share of the squared global norm: `Σ g²` over the parameters of `module` it
/// counts (see the [module docs](self)), as a `[1]` f32 device tensor. `tp_rank` is the rank
/// in the TP group; `excluded` lists paths of copies counted elsewhere. A parameter without
/// a gradient is an [`InputError::MissingGradient`](crate::InputError).
pub fn local_grad_sum_of_squares<B: AutodiffBackend, M: Module<B> + DeclarePlacements>(
    module: &M,
    grads: &GradientsParams,
    tp_rank: usize,
    excluded: &[String],
) -> crate::Result<Tensor<B::InnerBackend, 1>> {
    let device = module.devices().into_iter().next().unwrap_or_default();
    let counted: HashSet<ParamId> = try_param_infos(module)?
        .into_iter()
        .filter(|info| info.placement.dim().is_some() || tp_rank == 0)
        .filter(|info| !excluded.contains(&info.path) && !info.placement.frozen)
        .map(|info| info.id)
        .collect();
    reduce_grads(
        module,
        grads,
        Reduction::SumOfSquares,
        &Counted::Only(&counted),
        &device,
    )
}

/// The global L2 norm of the gradients of a model replica, as a `[1]` f32 device tensor:
/// this rank's model chunks (`chunks[i]` with gradients `grads[i]`; one chunk unless the
/// schedule is interleaved), all-reduced over the model-parallel group of `state`. Every
/// rank of the group must call it.
pub fn global_grad_norm<B, M>(
    chunks: &[M],
    grads: &[GradientsParams],
    state: &ParallelState,
) -> crate::Result<Tensor<B::InnerBackend, 1>>
where
    B: AutodiffBackend,
    B::InnerBackend: DistBackend,
    M: Module<B> + DeclarePlacements,
{
    if chunks.len() != grads.len() {
        return Err(ConfigError::Invalid(format!(
            "{} model chunks but {} sets of gradients: pass one per chunk",
            chunks.len(),
            grads.len()
        ))
        .into());
    }
    let tp_rank = state.tp().rank();
    let mut total: Option<Tensor<B::InnerBackend, 1>> = None;
    for (chunk, chunk_grads) in chunks.iter().zip(grads) {
        // A chunk of no parameters (an interleaved stage without layers) adds nothing, and
        // has no device of its own to put its zero on.
        if chunk.devices().is_empty() {
            continue;
        }
        let part = local_grad_sum_of_squares(chunk, chunk_grads, tp_rank, &shared_copies(chunk))?;
        total = Some(match total {
            Some(t) => t + part,
            None => part,
        });
    }
    // Every rank holds at least one chunk; without one there is no device to sum on.
    let total = total.ok_or_else(|| {
        ConfigError::Invalid("no model chunks: a rank holds at least one chunk".into())
    })?;
    norm_over(total, state.model_parallel())
}

/// `sqrt` of the sum of `local_sum_of_squares` over `group`.
fn norm_over<B: DistBackend>(
    local_sum_of_squares: Tensor<B, 1>,
    group: &ProcessGroup,
) -> crate::Result<Tensor<B, 1>> {
    Ok(group
        .all_reduce(local_sum_of_squares, ReduceOp::Sum)?
        .sqrt())
}

/// The factor that clips gradients of global norm `norm` to `max_norm`:
/// `min(1, max_norm / (norm + 1e-6))`, on the device.
pub fn clip_coefficient<B: burn::tensor::backend::Backend>(
    norm: Tensor<B, 1>,
    max_norm: f64,
) -> Tensor<B, 1> {
    (norm.add_scalar(CLIP_EPSILON).recip() * max_norm).clamp_max(1.0)
}

/// Scales `module`'s gradients in `grads` by `min(1, max_norm / (norm + 1e-6))`, where `norm`
/// is the global norm (from [`global_grad_norm`]), on the device.
pub fn clip_grads_by_norm<B: AutodiffBackend, M: Module<B>>(
    module: &M,
    grads: &mut GradientsParams,
    norm: Tensor<B::InnerBackend, 1>,
    max_norm: f64,
) {
    scale_grads(module, grads, &clip_coefficient(norm, max_norm));
}

/// Clips the gradients of a model replica to global norm `config.max_norm` and returns the
/// norm before clipping (a `[1]` f32 device tensor, read it at the log interval): Megatron's
/// `clip_grad_norm_fp32`. `chunks` and `grads` as for [`global_grad_norm`]; every rank of
/// the model-parallel group must call it.
pub fn clip_grad_norm<B, M>(
    chunks: &[M],
    grads: &mut [GradientsParams],
    state: &ParallelState,
    config: &GradClipConfig,
) -> crate::Result<Tensor<B::InnerBackend, 1>>
where
    B: AutodiffBackend,
    B::InnerBackend: DistBackend,
    M: Module<B> + DeclarePlacements,
{
    config.validate()?;
    let norm = global_grad_norm(chunks, grads, state)?;
    let coefficient = clip_coefficient(norm.clone(), config.max_norm);
    for (chunk, chunk_grads) in chunks.iter().zip(grads.iter_mut()) {
        scale_grads(chunk, chunk_grads, &coefficient);
    }
    Ok(norm)
}
