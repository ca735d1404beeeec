//! How the K/V of a context-parallel attention reach the other ranks (Megatron's
//! `--cp-comm-type`), and the attention that dispatches on it.

use std::fmt;
use std::str::FromStr;

use burn::tensor::Tensor;
use burn_megatron_dist::{DistBackend, ProcessGroup};

use super::all_gather::{all_gather_attention, all_gather_flash_attention};
use super::all_to_all::{all_to_all_attention, all_to_all_flash_attention};
use super::ring::{ring_attention, ring_flash_attention};
use crate::error::{ConfigError, Result};
use crate::ops::RingFlashAttentionOps;

/// The communication of context-parallel attention, by Megatron's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpCommType {
    /// `p2p`: K/V blocks passed around a ring ([`ring_attention`]).
    #[default]
    P2p,
    /// `all_gather`: K/V all-gathered ([`all_gather_attention`]).
    AllGather,
    /// `a2a`: the sequence split traded for a head split by all-to-all, DeepSpeed-Ulysses
    /// ([`all_to_all_attention`]).
    A2a,
}

impl CpCommType {
    /// Megatron's name: `p2p`, `all_gather` or `a2a`.
    pub fn name(self) -> &'static str {
        match self {
            CpCommType::P2p => "p2p",
            CpCommType::AllGather => "all_gather",
            CpCommType::A2a => "a2a",
        }
    }
}

impl fmt::Display for CpCommType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CpCommType {
    type Err = ConfigError;

    fn from_str(s: &str) -> core::result::Result<Self, ConfigError> {
        match s {
            "p2p" => Ok(CpCommType::P2p),
            "all_gather" => Ok(CpCommType::AllGather),
            "a2a" => Ok(CpCommType::A2a),
            other => Err(ConfigError::Invalid(format!(
                "--cp-comm-type {other} is not supported: use p2p, all_gather or a2a \
                 (Megatron's a2a+p2p, hierarchical, is not implemented)"
            ))),
        }
    }
}

/// Causal attention over the sequence split across `cp_group`, by `comm`: see
/// [`ring_attention`], [`all_gather_attention`] and [`all_to_all_attention`], which compute
/// the same.
///
/// # Shapes
/// - `q`: `[batch, heads, seq / cp, head_dim]`, this rank's tokens in the
///   [load-balanced split](super::LoadBalancedSplit);
/// - `k`, `v`: `[batch, kv_heads, seq / cp, head_dim]`, `heads` a multiple of `kv_heads`;
/// - returns `[batch, heads, seq / cp, head_dim]`.
pub fn context_parallel_attention<B: DistBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    cp_group: &ProcessGroup,
    scale: f64,
    comm: CpCommType,
) -> Result<Tensor<B, 4>> {
    match comm {
        CpCommType::P2p => ring_attention(q, k, v, cp_group, scale),
        CpCommType::AllGather => all_gather_attention(q, k, v, cp_group, scale),
        CpCommType::A2a => all_to_all_attention(q, k, v, cp_group, scale),
    }
}

/// [`context_parallel_attention`] on the fused flash attention: `p2p` by
/// [`ring_flash_attention`], `all_gather` by [`all_gather_flash_attention`], `a2a` by
/// [`all_to_all_flash_attention`] (none keeps a `[seq, seq]` tensor for the backward). The
/// model's attention under context parallelism.
///
/// # Shapes
/// As [`context_parallel_attention`].
pub fn context_parallel_flash_attention<B: RingFlashAttentionOps>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    cp_group: &ProcessGroup,
    scale: f64,
    comm: CpCommType,
) -> Result<Tensor<B, 4>> {
    match comm {
        CpCommType::P2p => ring_flash_attention(q, k, v, cp_group, scale),
        CpCommType::AllGather => all_gather_flash_attention(q, k, v, cp_group, scale),
        CpCommType::A2a => all_to_all_flash_attention(q, k, v, cp_group, scale),
    }
}
