//! What both training loops share (pretrain's own and the one through Burn's Learner): the
//! schedule of every step, and the step's values reduced over the ranks for the log.

use burn::tensor::{DType, Tensor};
use burn_megatron_dist::{DistBackend, ParallelState, ReduceOp};

use crate::error::Result;
use crate::pipeline_parallel::Schedule;

/// The schedule of the Learner's steps, and of pretrain's without virtual pipeline stages
/// ([`RunLayout::schedule`](super::RunLayout::schedule)): 1F1B, Megatron's default (with one
/// pipeline stage it is plain gradient accumulation).
pub const SCHEDULE: Schedule = Schedule::OneFOneB;

/// The step's loss on every stage: the last stage holds it, the others add zero over the
/// pipeline group. `[1]` f32.
pub(crate) fn loss_on_every_stage<B: DistBackend>(
    state: &ParallelState,
    loss: Option<Tensor<B, 1>>,
    device: &B::Device,
) -> Result<Tensor<B, 1>> {
    let loss = match loss {
        Some(l) => l.cast(DType::F32),
        None => Tensor::zeros([1], (device, DType::F32)),
    };
    Ok(state.pp().all_reduce(loss, ReduceOp::Sum)?)
}

pub(crate) const MIB: f64 = (1u64 << 20) as f64;

/// The largest of every rank's `bytes`, in MiB (`[1]` f32, exact to the MiB below 16 TiB),
/// on the device, for reading with the step's loss (and the Learner's memory metric).
pub(crate) fn largest_over_ranks<B: DistBackend>(
    state: &ParallelState,
    bytes: u64,
    device: &B::Device,
) -> Result<Tensor<B, 1>> {
    let mib = burn::tensor::TensorData::new(vec![(bytes as f64 / MIB).ceil() as f32], [1]);
    let mib = Tensor::<B, 1>::from_data(mib, (device, DType::F32));
    Ok(state.world().all_reduce(mib, ReduceOp::Max)?)
}
