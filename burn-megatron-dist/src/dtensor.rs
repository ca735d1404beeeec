//! A rank's local tensor together with how the global tensor is laid out over a group.

use std::fmt;
use std::ops::Range;

use burn::tensor::Tensor;

use crate::device_transport::DeviceTransport;
use crate::error::{DistError, DistResult};
use crate::op::ReduceOp;
use crate::process_group::ProcessGroup;
use crate::shard::shard_range;

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

/// A distributed tensor: this rank's local tensor, its [`Placement`] over a group, and the
/// global shape.
///
/// Combining tensors laid out differently, or over different groups, is an error instead of
/// a silently wrong result. Today it is a standalone type (tested on its own); the parallel
/// layers declare their parameters' [`Placement`] through
/// `burn_megatron::tensor_parallel::DeclarePlacements`.
#[derive(Debug, Clone)]
pub struct DistTensor<B: DeviceTransport, const D: usize> {
    local: Tensor<B, D>,
    placement: Placement,
    global_shape: [usize; D],
    group: ProcessGroup,
}

impl<B: DeviceTransport, const D: usize> DistTensor<B, D> {
    /// Lays out `full`, which every rank holds whole and equal, with `placement`: a shard keeps
    /// this rank's slice; a partial tensor is held by group rank 0, the others hold zeros.
    pub fn distribute(
        full: Tensor<B, D>,
        group: &ProcessGroup,
        placement: Placement,
    ) -> DistResult<Self> {
        let replicated = Self {
            global_shape: full.dims(),
            local: full,
            placement: Placement::Replicate,
            group: group.clone(),
        };
        replicated.redistribute(placement)
    }

    /// Wraps this rank's `local` part of a tensor of `global_shape`, checking that its shape is
    /// the one `placement` gives this rank.
    pub fn from_local(
        local: Tensor<B, D>,
        group: &ProcessGroup,
        placement: Placement,
        global_shape: [usize; D],
    ) -> DistResult<Self> {
        let mut expected = global_shape;
        if let Placement::Shard(dim) = placement {
            check_dim::<D>(dim)?;
            expected[dim] = shard_range(global_shape[dim], group.size(), group.rank())?.len();
        }
        if local.dims() != expected {
            return Err(DistError::Placement(format!(
                "rank {} of group '{}': a {placement} tensor of global shape {global_shape:?} \
                 has local shape {expected:?} here, got {:?}",
                group.rank(),
                group.name(),
                local.dims()
            )));
        }
        Ok(Self {
            local,
            placement,
            global_shape,
            group: group.clone(),
        })
    }

    /// This rank's tensor.
    pub fn local(&self) -> &Tensor<B, D> {
        &self.local
    }

    /// This rank's tensor, by value.
    pub fn into_local(self) -> Tensor<B, D> {
        self.local
    }

    /// The placement.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// The group the tensor is laid out over.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// The shape of the global tensor.
    pub fn global_shape(&self) -> [usize; D] {
        self.global_shape
    }

    /// For a sharded tensor, the range of the sharded dimension this rank holds.
    pub fn local_range(&self) -> Option<Range<usize>> {
        match self.placement {
            Placement::Shard(dim) => {
                shard_range(self.global_shape[dim], self.group.size(), self.group.rank()).ok()
            }
            _ => None,
        }
    }

    /// The same global tensor with another placement, moved by the collective it needs:
    /// shard → replicate is an all-gather, partial → replicate an all-reduce, partial → shard a
    /// reduce-scatter, shard → shard an all-to-all; replicate → shard only slices locally.
    pub fn redistribute(self, to: Placement) -> DistResult<Self> {
        if let Placement::Shard(dim) = to {
            check_dim::<D>(dim)?;
        }
        let group = &self.group;
        let local = match (self.placement, to) {
            (from, to) if from == to => self.local,
            (Placement::Shard(dim), Placement::Replicate) => group.all_gather(self.local, dim)?,
            (Placement::Partial, Placement::Replicate) => {
                group.all_reduce(self.local, ReduceOp::Sum)?
            }
            (Placement::Partial, Placement::Shard(dim)) => {
                group.reduce_scatter(self.local, dim, ReduceOp::Sum)?
            }
            (Placement::Replicate, Placement::Shard(dim)) => {
                let range = shard_range(self.global_shape[dim], group.size(), group.rank())?;
                self.local.narrow(dim, range.start, range.len())
            }
            (Placement::Replicate, Placement::Partial) => match group.rank() {
                0 => self.local,
                _ => self.local.zeros_like(),
            },
            (Placement::Shard(from), Placement::Shard(to)) => {
                group.all_to_all(self.local, to, from)?
            }
            (Placement::Shard(_), Placement::Partial) => {
                return self
                    .redistribute(Placement::Replicate)?
                    .redistribute(Placement::Partial);
            }
            (_, _) => unreachable!("equal placements are handled first"),
        };
        Ok(Self {
            local,
            placement: to,
            global_shape: self.global_shape,
            group: self.group,
        })
    }

    /// The whole global tensor, on every rank.
    pub fn full_tensor(&self) -> DistResult<Tensor<B, D>> {
        Ok(self.clone().redistribute(Placement::Replicate)?.local)
    }

    /// Element-wise sum. Both tensors must have the same global shape, group and placement.
    pub fn try_add(self, other: Self) -> DistResult<Self> {
        self.check_compatible(&other, "add")?;
        Ok(Self {
            local: self.local + other.local,
            ..self
        })
    }

    /// Element-wise difference. Both tensors must have the same global shape, group and
    /// placement.
    pub fn try_sub(self, other: Self) -> DistResult<Self> {
        self.check_compatible(&other, "subtract")?;
        Ok(Self {
            local: self.local - other.local,
            ..self
        })
    }

    /// Multiplies by a scalar (valid for every placement: it is linear).
    pub fn mul_scalar(self, scalar: f64) -> Self {
        Self {
            local: self.local.mul_scalar(scalar),
            ..self
        }
    }

    fn check_compatible(&self, other: &Self, what: &str) -> DistResult<()> {
        if self.group != other.group {
            return Err(DistError::Placement(format!(
                "cannot {what} tensors laid out over different groups: '{}' {:?} and '{}' {:?}",
                self.group.name(),
                self.group.ranks(),
                other.group.name(),
                other.group.ranks()
            )));
        }
        if self.global_shape != other.global_shape {
            return Err(DistError::Placement(format!(
                "cannot {what} tensors of global shapes {:?} and {:?}",
                self.global_shape, other.global_shape
            )));
        }
        if self.placement != other.placement {
            return Err(DistError::Placement(format!(
                "cannot {what} a {} tensor and a {} tensor on group '{}': redistribute one first",
                self.placement,
                other.placement,
                self.group.name()
            )));
        }
        Ok(())
    }
}

fn check_dim<const D: usize>(dim: usize) -> DistResult<()> {
    if dim >= D {
        return Err(DistError::InvalidArgument(format!(
            "cannot shard dimension {dim} of a tensor of rank {D}"
        )));
    }
    Ok(())
}
