//! The mixture-of-experts layer (issue 34) on CPU thread ranks: the router's losses against
//! hand-computed values, configuration errors, expert parallelism (EP = 1, 2, 4) against the
//! single-device layer with either token dispatcher (all-to-all, all-gather), the experts'
//! grouped GEMM against the per-expert composition, the optimizer with the experts cut into
//! several parts against one part, and the experts' gradients through the overlap hook
//! against their reduction after the backward pass. The f64 finite
//! differences of the layer's gradients are in the `finite_differences` target.

mod all_gather;
mod capacity;
mod config_errors;
mod expert_parallel;
mod expert_parts;
mod force_balance;
mod gpt_model;
mod grouped_linear;
mod optimizer;
mod overlap;
mod padded_dispatch;
mod padded_experts;
mod pretrain;
mod router_dtype;
mod router_losses;
mod sinkhorn;

use burn::backend::{Autodiff, NdArray};
pub use burn_megatron_testing::{assert_close, run, tolerance, values};

pub type B = NdArray<f32>;
pub type AD = Autodiff<B>;

/// Each row's `k` best columns of `scores` (`[rows, experts]`, row-major), best first, ties to
/// the lower column: the router's top-k, on the host.
pub fn top_k_of_rows(scores: &[f32], experts: usize, k: usize) -> Vec<usize> {
    scores
        .chunks(experts)
        .flat_map(|row| {
            let mut order: Vec<usize> = (0..experts).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            order.into_iter().take(k)
        })
        .collect()
}
