//! Train, validation and test splits by document ranges, from Megatron's `--split` string.

use std::ops::Range;

use super::DataError;

/// The three splits, in the order of Megatron's `--split "train,valid,test"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    /// Training data.
    Train,
    /// Validation data (evaluated every `--eval-interval` steps).
    Valid,
    /// Test data.
    Test,
}

impl Split {
    /// All three, in order.
    pub const ALL: [Split; 3] = [Split::Train, Split::Valid, Split::Test];

    /// The position in `--split` and in the arrays of this module.
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Parses Megatron's `--split` string, e.g. `"969,30,1"` or `"99,1"`: up to three
/// non-negative weights separated by commas (or slashes), missing ones 0, normalised to sum 1
/// (Megatron's `parse_and_normalize_split`).
pub fn parse_split(split: &str) -> Result<[f64; 3], DataError> {
    let invalid = |problem: String| {
        Err(DataError::Invalid(format!(
            "--split {split:?}: {problem}; write up to three non-negative weights for train, \
             valid and test, such as \"969,30,1\""
        )))
    };
    let parts: Vec<&str> = split.split([',', '/']).map(str::trim).collect();
    if parts.len() > 3 {
        return invalid(format!("{} weights given", parts.len()));
    }
    let mut weights = [0.0; 3];
    for (w, part) in weights.iter_mut().zip(&parts) {
        match part.parse::<f64>() {
            Ok(v) if v.is_finite() && v >= 0.0 => *w = v,
            _ => return invalid(format!("{part:?} is not a non-negative number")),
        }
    }
    let sum: f64 = weights.iter().sum();
    if sum <= 0.0 {
        return invalid("the weights add up to 0".into());
    }
    Ok(weights.map(|w| w / sum))
}

/// The document ranges of the splits for `num_documents` documents: contiguous, in order,
/// together exactly `0..num_documents`. Split `s` is `round(c_s · n)..round(c_{s+1} · n)` where
/// `c` are the cumulative normalised weights (Megatron's bookends, rounded half to even as
/// Python's `round`).
pub fn split_ranges(weights: &[f64; 3], num_documents: usize) -> [Range<usize>; 3] {
    let n = num_documents as f64;
    let mut bounds = [0usize; 4];
    let mut cumulative = 0.0;
    for (s, w) in weights.iter().enumerate() {
        cumulative += w;
        bounds[s + 1] =
            ((cumulative * n).round_ties_even() as usize).clamp(bounds[s], num_documents);
    }
    bounds[3] = num_documents;
    [
        bounds[0]..bounds[1],
        bounds[1]..bounds[2],
        bounds[2]..bounds[3],
    ]
}
