//! Pipeline schedules: the order in which each rank runs the forward and backward passes of
//! a step's microbatches. Each one is a function from (PP, virtual stages, microbatches) to a
//! [`Plan`]; [`forward_backward`](super::forward_backward) runs any of them.

mod gpipe;
mod interleaved;
mod no_pipelining;
mod one_f_one_b;
pub(super) mod schedule;

use super::plan::{Compute, Plan};
use crate::error::PipelineError;

pub use interleaved::megatron_warmup as interleaved_warmup;
pub use one_f_one_b::megatron_warmup as one_f_one_b_warmup;
pub use schedule::Schedule;

impl Schedule {
    /// The plan of a training step: every rank's forward, backward and exchange steps for
    /// `microbatches` microbatches over `pp` ranks with `virtual_size` chunks each.
    pub fn plan(
        self,
        pp: usize,
        virtual_size: usize,
        microbatches: usize,
    ) -> Result<Plan, PipelineError> {
        self.make(pp, virtual_size, microbatches, false)
    }

    /// The plan of an evaluation step: forward passes only, in the schedule's forward order.
    pub fn plan_forward_only(
        self,
        pp: usize,
        virtual_size: usize,
        microbatches: usize,
    ) -> Result<Plan, PipelineError> {
        self.make(pp, virtual_size, microbatches, true)
    }

    fn make(
        self,
        pp: usize,
        v: usize,
        m: usize,
        forward_only: bool,
    ) -> Result<Plan, PipelineError> {
        if m == 0 {
            return Err(PipelineError::NoMicrobatches);
        }
        if pp == 0 {
            return Err(PipelineError::VirtualStages {
                schedule: self.to_string(),
                problem: "needs at least one pipeline rank".into(),
            });
        }
        let virtual_problem = match self {
            Schedule::Interleaved if pp < 2 => Some(format!(
                "needs PP ≥ 2 (got PP = {pp}): with one rank use 1F1B or no pipelining"
            )),
            Schedule::Interleaved if v == 0 => {
                Some("needs at least one model chunk per rank".to_string())
            }
            Schedule::Interleaved => None,
            _ if v != 1 => Some(format!(
                "runs one model chunk per rank (got {v} virtual stages): use the interleaved \
                 schedule for virtual stages"
            )),
            _ => None,
        };
        if let Some(problem) = virtual_problem {
            return Err(PipelineError::VirtualStages {
                schedule: self.to_string(),
                problem,
            });
        }
        if self == Schedule::Interleaved && !m.is_multiple_of(pp) {
            return Err(PipelineError::MicrobatchesNotDivisible {
                microbatches: m,
                pp,
            });
        }
        let orders = (0..pp)
            .map(|rank| {
                let single = |order: Vec<(bool, Compute)>| -> Vec<Vec<(bool, Compute)>> {
                    order.into_iter().map(|pass| vec![pass]).collect()
                };
                let units = match self {
                    Schedule::NoPipelining => single(no_pipelining::order(m)),
                    Schedule::GPipe => single(gpipe::order(m)),
                    Schedule::OneFOneB => single(one_f_one_b::order(pp, rank, m)),
                    Schedule::Interleaved => interleaved::order(pp, rank, v, m, forward_only),
                };
                if forward_only {
                    units
                        .into_iter()
                        .map(|unit| unit.into_iter().filter(|(forward, _)| *forward).collect())
                        .filter(|unit: &Vec<_>| !unit.is_empty())
                        .collect()
                } else {
                    units
                }
            })
            .collect();
        Ok(Plan::from_compute_order(
            self,
            pp,
            v,
            m,
            forward_only,
            orders,
        ))
    }
}

/// A pass of microbatch `m` through chunk 0: forward if `forward`.
fn pass(forward: bool, microbatch: usize) -> (bool, Compute) {
    (
        forward,
        Compute {
            microbatch,
            chunk: 0,
        },
    )
}
