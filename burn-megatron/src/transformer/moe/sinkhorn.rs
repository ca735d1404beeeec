//! Sinkhorn balancing of the router's choice (Megatron's `sinkhorn`, for
//! `--moe-router-load-balancing-type sinkhorn`, from the S-BASE layers of Clark et al.,
//! "Unified Scaling Laws for Routed Language Models"): instead of a loss that teaches the
//! router to spread the tokens, the choice itself is made from `exp(logits)` rescaled until
//! every expert holds the same share of the probability mass and every token the same
//! share, so that a top-k of it spreads the tokens evenly.

use burn::tensor::{Bool, FloatDType, Tensor};
use burn_megatron_dist::{DistError, DistResult, ProcessGroup, ReduceOp};

use crate::backend::ModelBackend;

/// Megatron's tolerance: the iteration stops once the expert factors move by less than this,
/// on average.
pub const SINKHORN_TOLERANCE: f64 = 1e-4;

/// Megatron's `eps` in each normalisation's denominator.
const EPS: f64 = 1e-8;

/// Iterations between two reads of whether the iteration has converged: the iterations
/// themselves run on the device without waiting for it.
const ITERATIONS_PER_READ: usize = 16;

/// The most iterations; Megatron has no bound. A matrix of positive finite entries converges
/// well before it; a non-finite one stops at once, as in Megatron (its error is NaN).
pub const SINKHORN_MAX_ITERATIONS: usize = 1024;

/// `exp(logits)` (in f32, as Megatron's) scaled by a factor per token `d0` and one per
/// expert `d1`: alternately `d0_t = 1 / (T · (Σ_e exp(l_te) d1_e + ε))` and
/// `d1_e = 1 / (E · (Σ_t exp(l_te) d0_t + ε))`, until the mean absolute change of `d1` is at
/// most [`SINKHORN_TOLERANCE`] (Megatron's loop, exactly, up to
/// [`SINKHORN_MAX_ITERATIONS`]). Returns `d1_e · exp(l_te) · d0_t`, without gradient.
///
/// The tokens are this rank's part of a batch spread over `sequence` (the context-parallel
/// group): each expert's sum then runs over the whole batch (an all-reduce of `E` values an
/// iteration, on the device), so that the result is the one device's. Every
/// 16 iterations one value is read to the host, whether to go on.
///
/// # Shapes
/// - logits: `[tokens, num_experts]`
/// - output: `[tokens, num_experts]`, f32
pub fn sinkhorn<B: ModelBackend>(
    logits: Tensor<B, 2>,
    sequence: Option<&ProcessGroup>,
) -> DistResult<Tensor<B, 2>> {
    let cost = logits.detach().cast(FloatDType::F32).exp();
    let [tokens, experts] = cost.dims();
    let device = cost.device();
    let group = sequence.filter(|g| g.size() > 1);
    let all_tokens = tokens * group.map_or(1, ProcessGroup::size);
    let ones = |n: usize| Tensor::<B, 1>::ones([n], &device).cast(FloatDType::F32);
    let (mut d0, mut d1) = (ones(tokens), ones(experts));
    // Whether the iteration goes on, on the device.
    let mut running: Tensor<B, 1, Bool> = ones(1).greater_elem(0.5);
    let mut iterations = 0;
    while iterations < SINKHORN_MAX_ITERATIONS {
        for _ in 0..ITERATIONS_PER_READ {
            // ANCHOR: sinkhorn_step
            let go = running.clone();
            let rows = (cost.clone() * d1.clone().unsqueeze::<2>())
                .sum_dim(1)
                .reshape([tokens]);
            let next_d0 = rows
                .add_scalar(EPS)
                .recip()
                .mul_scalar(1.0 / all_tokens as f64);
            d0 = d0.mask_where(go.clone().expand([tokens]), next_d0);
            let columns = (cost.clone() * d0.clone().unsqueeze_dim::<2>(1))
                .sum_dim(0)
                .reshape([experts]);
            let columns = match group {
                Some(group) => group.all_reduce(columns, ReduceOp::Sum)?,
                None => columns,
            };
            let next_d1 = columns
                .add_scalar(EPS)
                .recip()
                .mul_scalar(1.0 / experts as f64);
            let next_d1 = d1.clone().mask_where(go.expand([experts]), next_d1);
            let error = (d1 - next_d1.clone()).abs().mean();
            // NaN compares false: a non-finite matrix stops, as Megatron's `while` does.
            running = running.bool_and(error.greater_elem(SINKHORN_TOLERANCE));
            d1 = next_d1;
            // ANCHOR_END: sinkhorn_step
        }
        iterations += ITERATIONS_PER_READ;
        if !still_running(running.clone(), sequence)? {
            break;
        }
    }
    Ok(cost * d1.unsqueeze::<2>() * d0.unsqueeze_dim::<2>(1))
}

/// Whether the iteration goes on: `running` (`[1]`) read to the host.
fn still_running<B: ModelBackend>(
    running: Tensor<B, 1, Bool>,
    sequence: Option<&ProcessGroup>,
) -> DistResult<bool> {
    let error = |message: String| DistError::Device {
        rank: sequence.map_or(0, ProcessGroup::global_rank),
        group: sequence.map_or("none", ProcessGroup::name).to_string(),
        what: "whether the router's Sinkhorn iteration has converged".to_string(),
        message,
    };
    let data = running
        .int()
        .try_into_data()
        .map_err(|e| error(e.to_string()))?
        .convert::<i64>();
    let value = data.to_vec::<i64>().map_err(|e| error(format!("{e:?}")))?;
    Ok(value.first().is_some_and(|&v| v != 0))
}
