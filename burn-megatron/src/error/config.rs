//! Configurations that cannot be built.

/// A configuration that cannot be built, with what would be valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A size must be divisible by the tensor-parallel size.
    #[error(
        "{what} ({size}) must be divisible by TP ({tp}): valid TP sizes are {}",
        list(valid)
    )]
    NotDivisibleByTp {
        /// What is split, e.g. "attention heads".
        what: String,
        /// Its size.
        size: usize,
        /// The tensor-parallel size.
        tp: usize,
        /// TP sizes that divide it.
        valid: Vec<usize>,
    },
    /// Any other invalid setting.
    #[error("{0}")]
    Invalid(String),
}

impl ConfigError {
    /// Checks that `size` splits evenly over `tp` ranks.
    pub fn check_divisible(what: &str, size: usize, tp: usize) -> core::result::Result<(), Self> {
        if tp == 0 || !size.is_multiple_of(tp) {
            return Err(ConfigError::NotDivisibleByTp {
                what: what.to_string(),
                size,
                tp,
                valid: (1..=size).filter(|&d| size.is_multiple_of(d)).collect(),
            });
        }
        Ok(())
    }
}

fn list(values: &[usize]) -> String {
    values
        .iter()
        .map(|v| v.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
