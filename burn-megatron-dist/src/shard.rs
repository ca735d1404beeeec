//! How a dimension is cut into one shard per rank.
//!
//! Shards are contiguous and taken in rank order. Each holds `ceil(len / parts)` elements,
//! except the last, which holds what is left (an uneven last shard). A cut that would leave a
//! rank with nothing is refused: every rank holds at least one element.

use std::ops::Range;

use crate::error::{DistError, DistResult};

/// The lengths of the `parts` shards of a dimension of length `len`.
pub fn shard_lengths(len: usize, parts: usize) -> DistResult<Vec<usize>> {
    if parts == 0 {
        return Err(DistError::InvalidArgument(
            "cannot shard over 0 ranks".to_string(),
        ));
    }
    let chunk = len.div_ceil(parts);
    let lengths: Vec<usize> = (0..parts)
        .map(|i| len.saturating_sub(i * chunk).min(chunk))
        .collect();
    if lengths.contains(&0) {
        return Err(DistError::InvalidArgument(format!(
            "a dimension of length {len} cannot be sharded over {parts} ranks: shards of \
             {chunk} leave {lengths:?}, and every rank needs at least one element"
        )));
    }
    Ok(lengths)
}

/// The range of the dimension that shard `index` of `parts` holds.
pub fn shard_range(len: usize, parts: usize, index: usize) -> DistResult<Range<usize>> {
    let lengths = shard_lengths(len, parts)?;
    let start: usize = lengths[..index].iter().sum();
    Ok(start..start + lengths[index])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_and_uneven_cuts() {
        assert_eq!(shard_lengths(8, 4).unwrap(), vec![2, 2, 2, 2]);
        assert_eq!(shard_lengths(7, 4).unwrap(), vec![2, 2, 2, 1]);
        assert_eq!(shard_lengths(10, 3).unwrap(), vec![4, 4, 2]);
        assert_eq!(shard_range(7, 4, 3).unwrap(), 6..7);
        assert_eq!(shard_range(10, 3, 1).unwrap(), 4..8);
    }

    #[test]
    fn refuses_empty_shards() {
        let err = shard_lengths(5, 4).unwrap_err().to_string();
        assert!(
            err.contains("length 5 cannot be sharded over 4 ranks"),
            "{err}"
        );
        assert!(shard_lengths(3, 4).is_err());
        assert!(shard_lengths(3, 0).is_err());
    }
}
