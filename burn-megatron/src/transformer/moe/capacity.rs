//! Expert capacity and token dropping (Megatron's `--moe-expert-capacity-factor`,
//! `--moe-token-drop-policy`, `--moe-pad-expert-input-to-capacity`).
//!
//! Without a capacity the layer is dropless: every token reaches each of its `top_k` experts.
//! With one, each rank lets an expert take at most
//!
//! `capacity = ceil(tokens · top_k / num_experts · factor)`
//!
//! of the assignments it routes (Megatron's `get_capacity` over the rank's `tokens · top_k`
//! assignments, computed in the same floating-point order, so the same number). The
//! capacity is a rank's, over its own tokens (Megatron's "sub-sequence" dropping): which
//! assignments drop depends on how the tokens are split over data and context parallelism,
//! not on the expert-parallel size. An over-full expert keeps
//!
//! - [`TokenDropPolicy::Probs`]: the `capacity` assignments of highest router weight (the
//!   combine weight, after any top-k normalisation), ties to the earlier token;
//! - [`TokenDropPolicy::Position`]: the first `capacity` assignments in token order.
//!
//! A dropped assignment contributes nothing to its token's output: its combine weight is gone
//! (and so its gradient), and a token all of whose assignments drop leaves the layer as zeros,
//! so that the transformer's residual carries it past. The auxiliary losses are those of the
//! router's choice before dropping, as in Megatron; the load logged (and used by the expert
//! bias) counts the assignments kept.
//!
//! With [`pad_to_capacity`](ExpertCapacity::pad_to_capacity) every expert's block from every
//! rank is padded with zero rows to `min(capacity, tokens)` rows (Megatron pads to the same:
//! its capacity mask keeps every token when the capacity exceeds them): fixed shapes for the
//! expert products, the same outputs and gradients (the experts have no biases, so a zero row
//! gives a zero row, and no token reads it back).

use burn::config::Config;

use crate::error::ConfigError;

/// Which assignments an over-full expert drops (Megatron's `--moe-token-drop-policy`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum TokenDropPolicy {
    /// Drop those of lowest router weight; ties drop the later token (`probs`, the default).
    Probs,
    /// Drop the latest in token order (`position`).
    Position,
}

impl TokenDropPolicy {
    /// Megatron's names, `probs` or `position`.
    pub fn parse(name: &str) -> Result<Self, ConfigError> {
        match name.to_ascii_lowercase().as_str() {
            "probs" => Ok(Self::Probs),
            "position" => Ok(Self::Position),
            _ => Err(ConfigError::Invalid(format!(
                "--moe-token-drop-policy {name:?}: use probs (drop the lowest router weights) \
                 or position (drop the latest tokens)"
            ))),
        }
    }
}

/// A capacity for each expert, and what happens to the assignments beyond it.
#[derive(Config, Debug, Copy, PartialEq)]
pub struct ExpertCapacity {
    /// The capacity factor (`--moe-expert-capacity-factor`): an expert takes at most
    /// `ceil(tokens · top_k / num_experts · factor)` of a rank's assignments. Finite and
    /// above 0; 1 is the mean load.
    pub factor: f64,
    /// Which assignments an over-full expert drops (`--moe-token-drop-policy`).
    #[config(default = "TokenDropPolicy::Probs")]
    pub drop_policy: TokenDropPolicy,
    /// Whether each expert's input is padded with zero rows to the capacity
    /// (`--moe-pad-expert-input-to-capacity`).
    #[config(default = false)]
    pub pad_to_capacity: bool,
}

impl ExpertCapacity {
    /// Checks the factor: finite and above 0.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.factor.is_finite() && self.factor > 0.0) {
            return Err(ConfigError::Invalid(format!(
                "--moe-expert-capacity-factor is {}: it must be a finite number above 0 (leave \
                 it out for a dropless layer)",
                self.factor
            )));
        }
        Ok(())
    }

    /// The capacity of each expert for a rank routing `assignments` (`tokens · top_k`)
    /// assignments to `num_experts` experts: `ceil(assignments / num_experts · factor)`,
    /// Megatron's `get_capacity` in the same floating-point order.
    pub fn capacity(&self, assignments: usize, num_experts: usize) -> usize {
        (assignments as f64 / num_experts as f64 * self.factor).ceil() as usize
    }

    /// Rows of each expert's block from a rank of `tokens` tokens with capacity `capacity`:
    /// with padding `min(capacity, tokens)` (an expert never gets more than every token),
    /// else `None` (each block holds the assignments kept).
    pub fn padded_rows(&self, capacity: usize, tokens: usize) -> Option<usize> {
        self.pad_to_capacity.then_some(capacity.min(tokens))
    }
}

/// Which assignments the probs policy keeps: for every expert that got more than `capacity`
/// of them, the `capacity` of highest weight (ties to the lower assignment index, that is the
/// earlier token); all the others of experts within capacity. Host-side: the weights are read
/// with the token counts (see [`TokenDispatcher`](super::TokenDispatcher)).
///
/// # Shapes
/// - experts, weights: `[assignments]`, token-major (`t · top_k + j`)
/// - output: `[assignments]`
pub fn keep_by_weight(
    experts: &[usize],
    weights: &[f32],
    num_experts: usize,
    capacity: usize,
) -> Vec<bool> {
    let mut of_expert: Vec<Vec<usize>> = vec![Vec::new(); num_experts];
    for (a, &e) in experts.iter().enumerate() {
        of_expert[e].push(a);
    }
    let mut keep = vec![true; experts.len()];
    for mut assignments in of_expert.into_iter().filter(|list| list.len() > capacity) {
        assignments.sort_by(|&a, &b| weights[b].total_cmp(&weights[a]).then(a.cmp(&b)));
        for &a in &assignments[capacity..] {
            keep[a] = false;
        }
    }
    keep
}

/// Which assignments the position policy keeps: the first `capacity` of each expert in token
/// order (the host-side statement of what the dispatcher computes on the device, for tests).
///
/// # Shapes
/// - experts: `[assignments]`, token-major
/// - output: `[assignments]`
pub fn keep_by_position(experts: &[usize], num_experts: usize, capacity: usize) -> Vec<bool> {
    let mut seen = vec![0usize; num_experts];
    experts
        .iter()
        .map(|&e| {
            seen[e] += 1;
            seen[e] <= capacity
        })
        .collect()
}
