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
//! same seed redraws the same masks. The masks are drawn by [`DropoutOps::dropout`]: on the
//! device, inside the kernel that applies them, where the backend has one.

use burn::tensor::Tensor;

use crate::backend::ModelBackend;
use crate::init::param_seed;
use crate::ops::DropoutMask;

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

    /// The stream's seed (also the router's input jitter's, [`JitterSite`](crate::transformer::moe::JitterSite)).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The mask of this site with drop probability `prob`, for the block of a global tensor
    /// (of rank `D` ≤ 4) that starts at `offset`.
    pub fn mask<const D: usize>(&self, prob: f64, offset: [usize; D]) -> DropoutMask {
        assert!(
            D <= 4,
            "dropout masks are drawn for tensors of rank 4 at most"
        );
        let mut padded = [0; 4];
        padded[4 - D..].copy_from_slice(&offset);
        DropoutMask {
            prob,
            seed: self.seed,
            offset: padded,
        }
    }
}

/// `residual + dropout(x)` (without a residual, `dropout(x)`): zeroes each element of `x` with
/// probability `prob` and scales the others by `1 / (1 - prob)`, in training only (under an
/// autodiff backend), as Burn's `Dropout` does.
///
/// `x` is the block of a global tensor that starts at `offset`.
pub fn dropout<B: ModelBackend, const D: usize>(
    x: Tensor<B, D>,
    residual: Option<Tensor<B, D>>,
    prob: f64,
    site: DropoutSite,
    offset: [usize; D],
) -> Tensor<B, D> {
    if prob == 0.0 || !B::ad_enabled(&x.device()) {
        return match residual {
            Some(residual) => residual + x,
            None => x,
        };
    }
    let dims = x.dims();
    let as_4d = |t: Tensor<B, D>| -> Tensor<B, 4> {
        let mut shape = [1; 4];
        shape[4 - D..].copy_from_slice(&t.dims());
        t.reshape(shape)
    };
    let residual = residual.map(as_4d);
    B::dropout(as_4d(x), residual, site.mask(prob, offset)).reshape(dims)
}
