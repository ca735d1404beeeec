//! Which schedule orders a step's passes: the name a [`Plan`](super::super::Plan) carries;
//! [`Schedule::plan`] (in `schedules/mod.rs`) makes the plan.

use core::fmt;

/// Which schedule orders the passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// Each microbatch's forward and backward pass before the next microbatch starts:
    /// gradient accumulation, Megatron's `forward_backward_no_pipelining`. With PP > 1 the
    /// stages take turns (one microbatch in the pipeline at a time).
    NoPipelining,
    /// GPipe: every forward pass, then every backward pass; keeps all microbatches'
    /// activations.
    GPipe,
    /// 1F1B (PipeDream-Flush), Megatron's `forward_backward_pipelining_without_interleaving`:
    /// `pp − rank − 1` warm-up forwards, then one forward and one backward in turn; a rank
    /// keeps at most `pp − rank` microbatches' activations.
    OneFOneB,
    /// Interleaved 1F1B with several model chunks (virtual stages) per rank, Megatron's
    /// `forward_backward_pipelining_with_interleaving`: the bubble shrinks by the number of
    /// chunks. Needs PP ≥ 2 and microbatches divisible by PP.
    Interleaved,
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Schedule::NoPipelining => "no-pipelining",
            Schedule::GPipe => "GPipe",
            Schedule::OneFOneB => "1F1B",
            Schedule::Interleaved => "interleaved 1F1B",
        })
    }
}
