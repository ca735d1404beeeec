//! The attention core, `softmax(q kᵀ / sqrt(d) + causal mask)` with dropout, times `v`, with
//! the backward written out so that it can be recomputed from `q`, `k` and `v` alone.
//!
//! The model runs it only while attention dropout is active; otherwise it runs flash
//! attention ([`crate::ops::flash_attention`]), which computes the same without dropout.

use burn::tensor::Tensor;

use crate::ops::{DropoutMask, DropoutOps, RecomputedAttention, SoftmaxOps};
use crate::tensor_parallel::DropoutSite;

/// One attention core call: its scale and how its dropout mask is placed.
///
/// Tensors are `[batch, local_heads, seq, head_dim]`; this rank's heads are the global heads
/// `first_head..first_head + local_heads` of `heads`, which places the dropout mask in the
/// global `[batch, heads, seq, seq]` probabilities.
#[derive(Debug, Clone, Copy)]
pub struct AttentionCore {
    /// `1 / sqrt(head_dim)`.
    pub scale: f64,
    /// Dropout probability on the attention probabilities.
    pub dropout: f64,
    /// Whether dropout is applied (training).
    pub training: bool,
    /// Where the dropout mask is drawn.
    pub site: DropoutSite,
    /// Heads of the whole layer.
    pub heads: usize,
    /// Global index of this rank's first head.
    pub first_head: usize,
}

impl AttentionCore {
    /// Whether dropout applies to the probabilities (a positive probability, in training).
    pub fn dropout_active(&self) -> bool {
        self.training && self.dropout > 0.0
    }

    /// The dropout mask of the probabilities, if dropout is active: this rank's heads in the
    /// global `[batch, heads, seq, seq]` probabilities.
    fn mask(&self) -> Option<DropoutMask> {
        self.dropout_active()
            .then(|| self.site.mask(self.dropout, [0, self.first_head, 0, 0]))
    }

    /// `softmax(scale · q kᵀ + causal mask)`.
    fn probabilities<B: SoftmaxOps>(&self, q: Tensor<B, 4>, k: Tensor<B, 4>) -> Tensor<B, 4> {
        B::causal_softmax(q.matmul(k.swap_dims(2, 3)), self.scale)
    }
}

impl RecomputedAttention for AttentionCore {
    /// `[batch, local_heads, seq, head_dim]` each → the same shape.
    fn forward<B: SoftmaxOps + DropoutOps>(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
    ) -> Tensor<B, 4> {
        let probs = self.probabilities(q, k);
        let probs = match self.mask() {
            Some(mask) => B::dropout(probs, None, mask),
            None => probs,
        };
        probs.matmul(v)
    }

    /// The gradients of `q`, `k` and `v` given the output's gradient, recomputing the
    /// probabilities: with `P` the probabilities, `M` the dropout multiplier and `O = (P ∘ M) v`,
    /// `dv = (P ∘ M)ᵀ dO`, `dP = (dO vᵀ) ∘ M`, `dS = P ∘ (dP - rowsum(dP ∘ P))`,
    /// `dq = scale · dS k`, `dk = scale · dSᵀ q`.
    fn backward<B: SoftmaxOps + DropoutOps>(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        grad: Tensor<B, 4>,
    ) -> [Tensor<B, 4>; 3] {
        let probs = self.probabilities(q.clone(), k.clone());
        // Dropout is linear: `M` is applied to `P` forward and to `dP` backward, drawn again.
        let (kept, grad_probs) = match self.mask() {
            Some(mask) => (
                B::dropout(probs.clone(), None, mask),
                B::dropout(grad.clone().matmul(v.swap_dims(2, 3)), None, mask),
            ),
            None => (probs.clone(), grad.clone().matmul(v.swap_dims(2, 3))),
        };
        let grad_v = kept.swap_dims(2, 3).matmul(grad);
        // The gradient of the unscaled scores q kᵀ (the scale is folded in).
        // `mul_scalar(1.0)`: the workaround of `ops::causal_softmax`'s backward (see there).
        let grad_scores = B::causal_softmax_backward(probs, grad_probs.mul_scalar(1.0), self.scale);
        let grad_q = grad_scores.clone().matmul(k);
        let grad_k = grad_scores.swap_dims(2, 3).matmul(q);
        [grad_q, grad_k, grad_v]
    }
}
