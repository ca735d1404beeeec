//! What a parameter is, from its path and shape: the weight-decay policy exempts biases and
//! norms, and the flat buffers record each parameter's kind.

/// What a parameter is, for the weight-decay policy (Megatron's `_get_param_groups`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    /// A bias: the last name of its path is `bias` (linear layers' biases).
    Bias,
    /// Any other one-dimensional parameter: a norm's scale or shift.
    Norm,
    /// Everything else: weight matrices and embedding tables (position embeddings included,
    /// as in Megatron).
    Weight,
}

impl ParamKind {
    /// The kind of a parameter from its path and this rank's shape of it.
    pub fn of(path: &str, shape: &[usize]) -> Self {
        let name = path.rsplit('.').next().unwrap_or(path);
        if name.ends_with("bias") {
            ParamKind::Bias
        } else if shape.len() == 1 {
            ParamKind::Norm
        } else {
            ParamKind::Weight
        }
    }
}
