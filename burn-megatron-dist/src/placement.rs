//! How a global tensor is laid out over the ranks of a group (PyTorch DTensor's and
//! Megatron's vocabulary: replicated, sharded along a dimension, or a pending sum).

use std::fmt;

/// How a global tensor is laid out over the ranks of a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Every rank holds the whole tensor.
    Replicate,
    /// Each rank holds a contiguous slice along the dimension (see [`crate::shard`]).
    Shard(usize),
    /// Each rank holds a term of a pending sum: the tensor is the sum over ranks.
    Partial,
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Replicate => f.write_str("replicated"),
            Placement::Shard(dim) => write!(f, "sharded along dim {dim}"),
            Placement::Partial => f.write_str("partial (pending sum)"),
        }
    }
}
