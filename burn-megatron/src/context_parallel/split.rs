//! The load-balanced causal split of a sequence over the CP group (Megatron's
//! `get_batch_on_this_cp_rank`).
//!
//! Under a causal mask the last tokens attend to the whole sequence and the first to almost
//! nothing, so cutting the sequence into CP contiguous parts would give the last rank most of
//! the work. The sequence is cut into `2 · cp` equal chunks instead, and rank `i` holds chunks
//! `i` and `2 · cp - 1 - i`: one early and one late chunk, the same work on every rank.
//!
//! With `seq = 8` and `cp = 2` (chunks of 2 tokens): rank 0 holds positions `0 1 6 7`, rank 1
//! holds `2 3 4 5`.

use burn::tensor::backend::Backend;
use burn::tensor::{BasicOps, Int, Tensor, TensorData};
use burn_megatron_dist::ProcessGroup;

use crate::error::InputError;

/// One rank's place in the load-balanced split: rank `rank` of a CP group of `cp` ranks holds
/// chunks `rank` and `2 · cp - 1 - rank` of `2 · cp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadBalancedSplit {
    /// The context-parallel size.
    pub cp: usize,
    /// This rank's index in the CP group.
    pub rank: usize,
}

impl LoadBalancedSplit {
    /// Rank `rank` of `cp`. Panics unless `rank < cp`.
    pub fn new(cp: usize, rank: usize) -> Self {
        assert!(
            rank < cp,
            "CP rank {rank} is outside a CP group of {cp} ranks"
        );
        Self { cp, rank }
    }

    /// This rank's place in `cp_group`.
    pub fn of_group(cp_group: &ProcessGroup) -> Self {
        Self::new(cp_group.size(), cp_group.rank())
    }

    /// The global chunk indices this rank holds, early one first: `[rank, 2 · cp - 1 - rank]`.
    pub fn chunks(&self) -> [usize; 2] {
        [self.rank, 2 * self.cp - 1 - self.rank]
    }

    /// The tokens of one chunk of a `seq`-token sequence, or an error unless `2 · cp` divides
    /// `seq`.
    pub fn chunk_len(&self, seq: usize) -> Result<usize, InputError> {
        let chunks = 2 * self.cp;
        if seq == 0 || !seq.is_multiple_of(chunks) {
            return Err(InputError::SequenceNotDivisibleByChunks { len: seq, chunks });
        }
        Ok(seq / chunks)
    }

    /// The global positions of this rank's `seq / cp` tokens of a `seq`-token sequence, in the
    /// order [`split`](Self::split) lays them out: the position ids RoPE needs on this rank.
    pub fn positions(&self, seq: usize) -> Result<Vec<usize>, InputError> {
        let len = self.chunk_len(seq)?;
        Ok(self
            .chunks()
            .into_iter()
            .flat_map(|chunk| chunk * len..(chunk + 1) * len)
            .collect())
    }

    /// [`positions`](Self::positions) as a `[seq / cp]` integer tensor on `device`.
    pub fn position_ids<B: Backend>(
        &self,
        seq: usize,
        device: &B::Device,
    ) -> Result<Tensor<B, 1, Int>, InputError> {
        let positions: Vec<i64> = self.positions(seq)?.into_iter().map(|p| p as i64).collect();
        let len = positions.len();
        Ok(Tensor::from_data(TensorData::new(positions, [len]), device))
    }

    /// This rank's part of `x`, whose dimension `dim` is the whole sequence: its two chunks,
    /// early one first. `[.., seq, ..]` → `[.., seq / cp, ..]` (`dim` sized `seq / cp`).
    /// Differentiable (a narrow and a concatenation); token ids and targets split alike.
    pub fn split<B: Backend, const D: usize, K: BasicOps<B>>(
        &self,
        x: Tensor<B, D, K>,
        dim: usize,
    ) -> Result<Tensor<B, D, K>, InputError> {
        let len = self.chunk_len(x.dims()[dim])?;
        if self.cp == 1 {
            return Ok(x);
        }
        let [early, late] = self
            .chunks()
            .map(|chunk| x.clone().narrow(dim, chunk * len, len));
        Ok(Tensor::cat(vec![early, late], dim))
    }

    /// The whole sequence from every rank's part (the [`split`](Self::split)s of ranks
    /// `0..parts.len()`, in rank order): `parts.len()` tensors `[.., seq / cp, ..]` →
    /// `[.., seq, ..]`, chunks in their natural order. The inverse of [`split`](Self::split),
    /// differentiable.
    pub fn restore<B: Backend, const D: usize, K: BasicOps<B>>(
        parts: Vec<Tensor<B, D, K>>,
        dim: usize,
    ) -> Result<Tensor<B, D, K>, InputError> {
        let cp = parts.len();
        assert!(
            cp > 0,
            "restoring a sequence needs at least one rank's part"
        );
        let local = parts[0].dims()[dim];
        let len = Self::new(cp, 0).chunk_len(local * cp)?;
        let mut chunks: Vec<Option<Tensor<B, D, K>>> = vec![None; 2 * cp];
        for (rank, part) in parts.into_iter().enumerate() {
            assert_eq!(
                part.dims()[dim],
                local,
                "every rank's part holds seq / cp = {local} tokens (rank {rank}'s holds {})",
                part.dims()[dim]
            );
            for (i, chunk) in Self::new(cp, rank).chunks().into_iter().enumerate() {
                chunks[chunk] = Some(part.clone().narrow(dim, i * len, len));
            }
        }
        let chunks = chunks
            .into_iter()
            .map(|c| c.expect("every chunk is held by one rank"))
            .collect();
        Ok(Tensor::cat(chunks, dim))
    }
}
