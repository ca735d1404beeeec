//! What a model's layers need to run on a context-parallel rank's part of the sequence.

use burn_megatron_dist::ProcessGroup;

use super::comm_type::CpCommType;
use super::split::LoadBalancedSplit;
use crate::error::InputError;

/// The context-parallel group a model runs over and how its attention communicates
/// (Megatron's `--context-parallel-size`, `--cp-comm-type`). Every layer holds a clone: the
/// attention runs [`context_parallel_attention`](super::context_parallel_attention) over it,
/// RoPE and the learned positions take the rank's [global positions](Self::positions), the
/// loss is averaged over it.
#[derive(Debug, Clone)]
pub struct CpContext {
    /// The context-parallel group.
    pub group: ProcessGroup,
    /// The attention's communication.
    pub comm: CpCommType,
}

impl CpContext {
    /// `group` communicating by `comm`.
    pub fn new(group: &ProcessGroup, comm: CpCommType) -> Self {
        Self {
            group: group.clone(),
            comm,
        }
    }

    /// The context-parallel size.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// This rank's place in the load-balanced split.
    pub fn split(&self) -> LoadBalancedSplit {
        LoadBalancedSplit::of_group(&self.group)
    }

    /// The global positions of this rank's `local` tokens (its two chunks of a sequence of
    /// `local · cp` tokens, in split order), or an error unless `local` is even.
    pub fn positions(&self, local: usize) -> Result<Vec<usize>, InputError> {
        self.split().positions(local * self.size())
    }
}
