//! AdamW's hyper-parameters for one step, as the fused AdamW kernel and its composition
//! (`burn_megatron::ops::adamw`) take them.

/// The step's host scalars: f32, computed on the host from the f64 settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWScalars {
    /// The learning rate.
    pub lr: f32,
    /// `β₁`.
    pub beta_1: f32,
    /// `β₂`.
    pub beta_2: f32,
    /// `ln β₁` (for the bias correction), computed in f64.
    pub ln_beta_1: f32,
    /// `ln β₂`, computed in f64.
    pub ln_beta_2: f32,
    /// `ε`, added to `sqrt(v̂)`.
    pub epsilon: f32,
    /// `1 - lr · weight_decay`, computed in f64: the factor of a decayed element.
    pub decay_factor: f32,
    /// Elements per weight-decay block.
    pub block: usize,
}

impl AdamWScalars {
    /// The scalars of a step at learning rate `lr`.
    pub fn new(
        lr: f64,
        beta_1: f64,
        beta_2: f64,
        epsilon: f64,
        weight_decay: f64,
        block: usize,
    ) -> Self {
        Self {
            lr: lr as f32,
            beta_1: beta_1 as f32,
            beta_2: beta_2 as f32,
            ln_beta_1: beta_1.ln() as f32,
            ln_beta_2: beta_2.ln() as f32,
            epsilon: epsilon as f32,
            decay_factor: (1.0 - lr * weight_decay) as f32,
            block,
        }
    }
}
