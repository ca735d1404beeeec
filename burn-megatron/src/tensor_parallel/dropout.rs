//! Dropout whose masks do not depend on the parallel layout.
//!
//! The keep/drop decision for an element is a function of a seed and the element's index in
//! the *global* tensor. That gives Megatron's rule for free, and more:
//! - activations replicated over the TP group (the residual stream without sequence
//!   parallelism) get the same mask on every TP rank, as Megatron's default RNG gives them;
//! - activations split over the group (attention heads; the sequence under sequence
//!   parallelism) get different masks on each rank, as Megatron's model-parallel RNG tracker
//!   gives them;
//! - and in every layout the masks are the ones a single device draws, so a TP model with
//!   dropout trains exactly like the single-device model.
//!
//! The seed changes with every call (see [`DropoutSite`]), and recomputing a layer with the
//! same seed redraws the same masks.

use burn::tensor::{Tensor, backend::Backend};

use crate::init::{counter_slice, param_seed, uniform};

/// Identifies one draw of a dropout mask: a model seed, a call count and a site name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DropoutSite {
    seed: u64,
}

impl DropoutSite {
    /// The site `name` (e.g. `"layers.3.attention"`) at the `call`-th forward of the model
    /// seeded with `seed`.
    pub fn new(seed: u64, call: u64, name: &str) -> Self {
        Self {
            seed: param_seed(seed ^ call.wrapping_mul(0x9E37_79B9_7F4A_7C15), name),
        }
    }
}

/// Zeroes each element of `x` with probability `prob` and scales the others by
/// `1 / (1 - prob)`, in training only (under an autodiff backend), as Burn's `Dropout` does.
///
/// `x` is the block of a tensor of shape `global_shape` that starts at `offset`.
pub fn dropout<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    prob: f64,
    site: DropoutSite,
    global_shape: [usize; D],
    offset: [usize; D],
) -> Tensor<B, D> {
    let device = x.device();
    if prob == 0.0 || !B::ad_enabled(&device) {
        return x;
    }
    let mask = dropout_mask(x.dims(), prob, site, global_shape, offset, &device);
    x * mask
}

/// The multiplier [`dropout`] applies to a block of shape `dims` at `offset`: 0 for dropped
/// elements, `1 / (1 - prob)` for kept ones.
pub fn dropout_mask<B: Backend, const D: usize>(
    dims: [usize; D],
    prob: f64,
    site: DropoutSite,
    global_shape: [usize; D],
    offset: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    let ranges = std::array::from_fn(|d| offset[d]..offset[d] + dims[d]);
    let scale = (1.0 / (1.0 - prob)) as f32;
    let mask = counter_slice(global_shape, ranges, |i| {
        if uniform(site.seed, i) < prob {
            0.0
        } else {
            scale
        }
    });
    Tensor::from_data(mask, device)
}
