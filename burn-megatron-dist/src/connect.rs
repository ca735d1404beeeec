//! Opening a rank's communicators and pipeline links at start-up ([`ParallelState::connect`]).

use burn::tensor::Tensor;

use crate::error::DistResult;
use crate::layout::GroupKind;
use crate::mapping::Comm;
use crate::op::ReduceOp;
use crate::parallel_state::ParallelState;
use crate::process_group::DeviceTransport;

impl ParallelState {
    /// Opens this rank's communicators now, and the pipeline's point-to-point connections:
    /// one small all-reduce on every group of more than one rank (the expert groups only with
    /// `experts`), then a send to the next pipeline rank and one to the previous.
    ///
    /// NCCL opens a communicator on the group's first collective and a connection on the
    /// first exchange between two ranks, and allocates their GPU buffers then. Called at
    /// start-up, before the model and the optimizer take the GPU's memory, that is where
    /// those buffers go; opened in the middle of the first step, on a GPU the memory pool
    /// has nearly filled, NCCL's allocations can fail and leave a peer waiting. Every rank
    /// of the world must call it, in the same place: the groups are visited in one order.
    pub fn connect<B: DeviceTransport>(&self, device: &B::Device, experts: bool) -> DistResult<()> {
        let expert_groups = [self.ep(), self.expert_dp()];
        let groups = [
            self.tp(),
            self.cp(),
            self.group(GroupKind::TpCp).expect("every rank has one"),
            self.pp(),
            self.dp(),
            self.dp_cp(),
            self.model_parallel(),
        ]
        .into_iter()
        .chain(expert_groups.into_iter().filter(|_| experts))
        .chain(self.embedding())
        .chain([self.world()]);
        for group in groups.filter(|g| g.size() > 1) {
            let x = Tensor::<B, 1>::zeros([group.size()], device);
            group.all_reduce(x, ReduceOp::Sum)?;
            group.synchronize()?;
        }
        let pp = self.pp();
        if pp.size() > 1 {
            // Around the ring, both ways: the interleaved schedule also sends from the last
            // stage to the first.
            for step in [Comm::RingToNext, Comm::RingToPrevious] {
                step.apply(pp, Tensor::<B, 1>::zeros([1], device))?;
            }
            pp.synchronize()?;
        }
        Ok(())
    }
}
