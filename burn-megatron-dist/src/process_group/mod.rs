//! A group of ranks that run collectives together.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use burn::tensor::backend::{Backend, ExecutionError};
use burn::tensor::{Tensor, TensorData};

use crate::error::{DistError, DistResult};
use crate::op::{CollectiveOp, ReduceOp};
use crate::shard::shard_range;
use crate::transport::{Contribution, GroupInfo, Transport};
use crate::work::Work;

#[cfg(feature = "cuda")]
mod device_calls;
mod device_transport;

pub use device_transport::{DeviceTransport, OnDevice};

/// A set of ranks that communicate: Megatron's TP, PP, DP, CP or EP group, or the world.
///
/// Ranks passed to and returned by a group are *group-local* (`0..size()`), as in NCCL; the
/// global rank of each member is in [`ranks`](Self::ranks). Each rank holds its own handle;
/// clones share it. Collectives on a group are matched across ranks by call order, so every
/// member must call the same collectives in the same order. A call that cannot complete (a
/// peer failed or finished, shapes differ, the timeout passed) returns an error that names the
/// group, the operation and the ranks involved.
///
/// Tensors go through host memory between thread ranks; an NCCL group keeps them on the GPU.
#[derive(Clone)]
pub struct ProcessGroup {
    pub(crate) inner: Arc<GroupInner>,
}

pub(crate) struct GroupInner {
    pub(crate) info: GroupInfo,
    pub(crate) transport: Arc<dyn Transport>,
    pub(crate) shared: Arc<GroupShared>,
    registry: Arc<RankGroups>,
}

/// One rank's state of a group, shared by every handle of the same group on that rank.
#[derive(Debug, Default)]
pub(crate) struct GroupShared {
    /// Collectives started on the group: the next one's sequence number.
    pub(crate) collectives: AtomicU64,
    /// Messages received on the group.
    pub(crate) receives: AtomicU64,
    /// NCCL point-to-point calls on the group, numbered apart from collectives: ranks make
    /// different numbers of them, and collectives must keep one numbering on every rank.
    #[cfg(feature = "cuda")]
    pub(crate) point_to_point: AtomicU64,
    /// The error of a collective that failed inside a backward pass (see
    /// [`ProcessGroup::backward_failure`]): every later call on the group returns it.
    pub(crate) backward_failure: Mutex<Option<DistError>>,
    /// The group's NCCL communicator on this rank, created by its first GPU collective.
    #[cfg(feature = "cuda")]
    pub(crate) nccl: Mutex<Option<Arc<crate::nccl::NcclGroup>>>,
}

/// The groups one rank has created, by key: creating a group again finds the same state.
#[derive(Debug)]
pub(crate) struct RankGroups {
    groups: Mutex<HashMap<String, Arc<GroupShared>>>,
    /// Whether GPU collectives are matched across ranks on the host first (see
    /// [`LaunchConfig::check_collectives`](crate::LaunchConfig::check_collectives)).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) check_collectives: bool,
}

impl RankGroups {
    pub(crate) fn new(check_collectives: bool) -> Self {
        Self {
            groups: Mutex::default(),
            check_collectives,
        }
    }

    fn get(&self, key: &str) -> Arc<GroupShared> {
        let mut groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        groups.entry(key.to_string()).or_default().clone()
    }

    /// Waits for every GPU collective this rank has started to end, or returns the error
    /// that ended one.
    pub(crate) fn finish(&self) -> DistResult<()> {
        #[cfg(feature = "cuda")]
        {
            let groups: Vec<_> = self
                .groups
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .values()
                .cloned()
                .collect();
            for group in groups {
                let nccl = group
                    .nccl
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone();
                if let Some(nccl) = nccl {
                    nccl.finish()?;
                }
            }
        }
        Ok(())
    }
}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("name", &self.inner.info.name)
            .field("ranks", &self.inner.info.members)
            .field("rank", &self.inner.info.group_rank)
            .finish()
    }
}

impl PartialEq for ProcessGroup {
    fn eq(&self, other: &Self) -> bool {
        self.inner.info.key == other.inner.info.key
            && std::ptr::addr_eq(
                Arc::as_ptr(&self.inner.transport),
                Arc::as_ptr(&other.inner.transport),
            )
    }
}

impl ProcessGroup {
    /// The group of `members` (global ranks, in group order) as seen by global rank `rank`.
    pub(crate) fn new(
        transport: Arc<dyn Transport>,
        registry: Arc<RankGroups>,
        name: &str,
        members: Vec<usize>,
        rank: usize,
    ) -> DistResult<Self> {
        let world_size = transport.size();
        if let Some(bad) = members.iter().find(|&&r| r >= world_size) {
            return Err(DistError::InvalidArgument(format!(
                "group '{name}': rank {bad} is outside the world of {world_size} ranks"
            )));
        }
        let mut sorted = members.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != members.len() || members.is_empty() {
            return Err(DistError::InvalidArgument(format!(
                "group '{name}': members {members:?} must be distinct and non-empty"
            )));
        }
        let local_rank = members.iter().position(|&r| r == rank).ok_or_else(|| {
            DistError::InvalidArgument(format!(
                "rank {rank} is not a member of group '{name}' {members:?}"
            ))
        })?;
        let key = format!("{name}{members:?}");
        let shared = registry.get(&key);
        Ok(Self {
            inner: Arc::new(GroupInner {
                info: GroupInfo {
                    name: name.to_string(),
                    key,
                    members,
                    group_rank: local_rank,
                    global_rank: rank,
                },
                transport,
                shared,
                registry,
            }),
        })
    }

    /// Collectives this rank has started on this group so far, of every kind: for tests and
    /// profiles that count a model's communication.
    pub fn collectives_started(&self) -> u64 {
        self.inner.shared.collectives.load(Ordering::Relaxed)
    }

    /// The group's name, as used in errors.
    pub fn name(&self) -> &str {
        &self.inner.info.name
    }

    /// Whether this group matches every GPU collective on the host before running it
    /// ([`LaunchConfig::with_collective_checks`](crate::LaunchConfig::with_collective_checks)):
    /// then each call waits on the host for the other ranks' descriptions.
    pub fn checks_collectives(&self) -> bool {
        self.inner.registry.check_collectives
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.inner.info.group_rank
    }

    /// The number of ranks in the group.
    pub fn size(&self) -> usize {
        self.inner.info.members.len()
    }

    /// The global ranks of the members, in group order.
    pub fn ranks(&self) -> &[usize] {
        &self.inner.info.members
    }

    /// This rank's global rank.
    pub fn global_rank(&self) -> usize {
        self.inner.info.global_rank
    }

    /// Reduces `x` over the group; every rank gets the result.
    pub fn all_reduce<B: DeviceTransport, const D: usize>(
        &self,
        x: Tensor<B, D>,
        op: ReduceOp,
    ) -> DistResult<Tensor<B, D>> {
        self.all_reduce_async(x, op)?.wait()
    }

    /// Starts [`all_reduce`](Self::all_reduce).
    pub fn all_reduce_async<B: DeviceTransport, const D: usize>(
        &self,
        x: Tensor<B, D>,
        op: ReduceOp,
    ) -> DistResult<Work<Tensor<B, D>>> {
        if self.size() == 1 {
            return Ok(Work::ready(x));
        }
        let x = match B::collective_on_device(self, CollectiveOp::AllReduce(op), x) {
            OnDevice::Done(done) => return done.map(Work::ready),
            OnDevice::Host(x) => x,
        };
        let device = x.device();
        let size = self.size();
        let pending = self.start(CollectiveOp::AllReduce(op), x)?;
        Ok(Work::new(move || {
            let parts = pending.collect()?;
            let tensors = parts.into_iter().map(|p| p.tensor(&device)).collect();
            Ok(reduce(tensors, op, size))
        }))
    }

    /// Concatenates every rank's `x` along `dim`, in rank order. Shards may differ in length
    /// along `dim` (an uneven last shard).
    pub fn all_gather<B: DeviceTransport, const D: usize>(
        &self,
        x: Tensor<B, D>,
        dim: usize,
    ) -> DistResult<Tensor<B, D>> {
        self.all_gather_async(x, dim)?.wait()
    }

    /// Starts [`all_gather`](Self::all_gather).
    pub fn all_gather_async<B: DeviceTransport, const D: usize>(
        &self,
        x: Tensor<B, D>,
        dim: usize,
    ) -> DistResult<Work<Tensor<B, D>>> {
        check_dim::<D>(dim, "all_gather")?;
        if self.size() == 1 {
            return Ok(Work::ready(x));
        }
        let x = match B::collective_on_device(self, CollectiveOp::AllGather { dim }, x) {
            OnDevice::Done(done) => return done.map(Work::ready),
            OnDevice::Host(x) => x,
        };
        let device = x.device();
        let pending = self.start(CollectiveOp::AllGather { dim }, x)?;
        Ok(Work::new(move || {
            let parts = pending.collect()?;
            let tensors = parts.into_iter().map(|p| p.tensor(&device)).collect();
            Ok(Tensor::cat(tensors, dim))
        }))
    }

    /// Reduces `x` over the group and gives each rank its shard of the result along `dim`
    /// (see [`shard`](crate::shard) for how the dimension is cut).
    pub fn reduce_scatter<B: DeviceTransport, const D: usize>(
        &self,
        x: Tensor<B, D>,
        dim: usize,
        op: ReduceOp,
    ) -> DistResult<Tensor<B, D>> {
        self.reduce_scatter_async(x, dim, op)?.wait()
    }

    /// Starts [`reduce_scatter`](Self::reduce_scatter).
    pub fn reduce_scatter_async<B: DeviceTransport, const D: usize>(
        &self,
        x: Tensor<B, D>,
        dim: usize,
        op: ReduceOp,
    ) -> DistResult<Work<Tensor<B, D>>> {
        check_dim::<D>(dim, "reduce_scatter")?;
        let size = self.size();
        let range = shard_range(x.dims()[dim], size, self.rank())?;
        if size == 1 {
            return Ok(Work::ready(x));
        }
        let x = match B::collective_on_device(self, CollectiveOp::ReduceScatter { dim, op }, x) {
            OnDevice::Done(done) => return done.map(Work::ready),
            OnDevice::Host(x) => x,
        };
        let device = x.device();
        let pending = self.start(CollectiveOp::ReduceScatter { dim, op }, x)?;
        Ok(Work::new(move || {
            let parts = pending.collect()?;
            let shards = parts
                .into_iter()
                .map(|p| {
                    p.tensor::<B, D>(&device)
                        .narrow(dim, range.start, range.len())
                })
                .collect();
            Ok(reduce(shards, op, size))
        }))
    }

    /// Every rank gets the `x` of group rank `root`; the others' `x` give only shape and dtype.
    pub fn broadcast<B: DeviceTransport, const D: usize>(
        &self,
        x: Tensor<B, D>,
        root: usize,
    ) -> DistResult<Tensor<B, D>> {
        self.check_peer(root, "broadcast root")?;
        if self.size() == 1 {
            return Ok(x);
        }
        let op = CollectiveOp::Broadcast { root };
        let x = match B::collective_on_device(self, op, x) {
            OnDevice::Done(done) => return done,
            OnDevice::Host(x) => x,
        };
        let device = x.device();
        let pending = if self.rank() == root {
            self.start(op, x)?
        } else {
            self.start_without_data(op, x.dims().to_vec(), x.dtype())?
        };
        let mut parts = pending.collect()?;
        Ok(parts.swap_remove(root).tensor(&device))
    }

    /// Splits `x` along `split_dim` into one shard per rank, sends shard `j` to rank `j`, and
    /// concatenates the shards it receives along `concat_dim`, in rank order.
    pub fn all_to_all<B: DeviceTransport, const D: usize>(
        &self,
        x: Tensor<B, D>,
        split_dim: usize,
        concat_dim: usize,
    ) -> DistResult<Tensor<B, D>> {
        self.all_to_all_async(x, split_dim, concat_dim)?.wait()
    }

    /// Starts [`all_to_all`](Self::all_to_all).
    pub fn all_to_all_async<B: DeviceTransport, const D: usize>(
        &self,
        x: Tensor<B, D>,
        split_dim: usize,
        concat_dim: usize,
    ) -> DistResult<Work<Tensor<B, D>>> {
        check_dim::<D>(split_dim, "all_to_all")?;
        check_dim::<D>(concat_dim, "all_to_all")?;
        let range = shard_range(x.dims()[split_dim], self.size(), self.rank())?;
        if self.size() == 1 {
            return Ok(Work::ready(x));
        }
        let op = CollectiveOp::AllToAll {
            split_dim,
            concat_dim,
        };
        let x = match B::collective_on_device(self, op, x) {
            OnDevice::Done(done) => return done.map(Work::ready),
            OnDevice::Host(x) => x,
        };
        let device = x.device();
        let pending = self.start(op, x)?;
        Ok(Work::new(move || {
            let parts = pending.collect()?;
            let shards = parts
                .into_iter()
                .map(|p| {
                    p.tensor::<B, D>(&device)
                        .narrow(split_dim, range.start, range.len())
                })
                .collect();
            Ok(Tensor::cat(shards, concat_dim))
        }))
    }

    /// Waits until every GPU collective this rank started on the group has ended, or returns
    /// the error that ended one (the watchdog's timeout, a failed peer). Calls over NCCL
    /// return once enqueued, in stream order with Burn's kernels; this is the host-side wait.
    /// Host collectives are complete when they return, so for them it returns at once.
    pub fn synchronize(&self) -> DistResult<()> {
        #[cfg(feature = "cuda")]
        return self.nccl_synchronize();
        #[cfg(not(feature = "cuda"))]
        Ok(())
    }

    /// The error that has ended a collective of this group, if one has, without waiting: a
    /// collective that failed inside a backward pass, or one the NCCL watchdog aborted (a
    /// peer died, a timeout). Calls over NCCL return once enqueued, so a step whose
    /// collectives were aborted under it ends with wrong values and no error: a training loop
    /// checks this after reading the step's values, before it logs or saves them.
    pub fn failure(&self) -> DistResult<()> {
        self.backward_failure()?;
        #[cfg(feature = "cuda")]
        return self.nccl_failure();
        #[cfg(not(feature = "cuda"))]
        Ok(())
    }

    /// Has the group's NCCL watchdog follow the work enqueued on this rank's device so far,
    /// named `what` in its reports: a replayed CUDA graph whose captured collectives are this
    /// group's, which the watchdog does not see one by one. A replay that a peer never joins
    /// then times out (or fails with the peer) as a collective does. No-op for groups without
    /// an NCCL communicator.
    pub fn watch_replay(&self, what: &str) -> DistResult<()> {
        #[cfg(feature = "cuda")]
        if let Some(nccl) = self.existing_nccl() {
            return nccl.watch(self.next_seq(), what.to_string());
        }
        let _ = what;
        Ok(())
    }

    /// The next collective's sequence number on this rank.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn next_seq(&self) -> u64 {
        self.inner
            .shared
            .collectives
            .fetch_add(1, Ordering::Relaxed)
    }

    /// The next NCCL point-to-point call's number on this rank (for the watchdog's reports;
    /// not shared with collectives, see [`GroupShared::point_to_point`]).
    #[cfg(feature = "cuda")]
    fn next_p2p_seq(&self) -> u64 {
        self.inner
            .shared
            .point_to_point
            .fetch_add(1, Ordering::Relaxed)
    }

    /// The error of a collective that failed inside a backward pass on this group, if one did.
    ///
    /// Burn's backward pass has no error channel, so a differentiable communication whose
    /// collective fails there (a dead peer, a timeout) records the error on its group and
    /// passes a zero gradient on. From then on every call on the group returns that error, and
    /// a training step checks this after `backward()` (as the pipeline schedules do),
    /// so the failure reaches the caller as an `Err` rather than a panic or a wrong gradient.
    pub fn backward_failure(&self) -> DistResult<()> {
        match &*self.shared_failure() {
            Some(error) => Err(error.clone()),
            None => Ok(()),
        }
    }

    /// Records `error` as the failure of a collective inside a backward pass (the first one
    /// recorded is kept). Backward steps have no error channel: an operation whose backward
    /// runs a collective (a mapping, an FP8 layer's amax reduction) records its failure here
    /// and goes on, and the step reports it through [`backward_failure`](Self::backward_failure).
    pub fn fail_in_backward(&self, error: DistError) {
        self.shared_failure().get_or_insert(error);
    }

    fn shared_failure(&self) -> std::sync::MutexGuard<'_, Option<DistError>> {
        self.inner
            .shared
            .backward_failure
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Returns once every rank of the group has called it.
    pub fn barrier(&self) -> DistResult<()> {
        if self.size() > 1 {
            self.start_without_data(CollectiveOp::Barrier, Vec::new(), burn::tensor::DType::F32)?
                .collect()?;
        }
        Ok(())
    }

    /// Sends `x` to group rank `dst`. Sends are buffered: this never waits for the receiver.
    pub fn send<B: DeviceTransport, const D: usize>(
        &self,
        x: Tensor<B, D>,
        dst: usize,
    ) -> DistResult<()> {
        self.check_peer(dst, "send destination")?;
        let op = CollectiveOp::Send { dst };
        let x = match B::collective_on_device(self, op, x) {
            OnDevice::Done(done) => return done.map(|_| ()),
            OnDevice::Host(x) => x,
        };
        let message = Contribution {
            op,
            shape: x.dims().to_vec(),
            dtype: x.dtype(),
            data: Some(self.read(x, op)?),
        };
        self.inner.transport.send(&self.inner.info, dst, message)
    }

    /// Starts [`send`](Self::send): with [`irecv`](Self::irecv), the non-blocking pair a
    /// pipeline schedule needs.
    pub fn isend<B: DeviceTransport, const D: usize>(
        &self,
        x: Tensor<B, D>,
        dst: usize,
    ) -> DistResult<Work<()>> {
        self.send(x, dst)?;
        Ok(Work::ready(()))
    }

    /// Receives the next tensor that group rank `src` sent to this rank.
    pub fn recv<B: DeviceTransport, const D: usize>(
        &self,
        src: usize,
        device: &B::Device,
    ) -> DistResult<Tensor<B, D>> {
        self.irecv(src, device)?.wait()
    }

    /// Starts [`recv`](Self::recv); the message is taken when the handle is waited on.
    pub fn irecv<B: DeviceTransport, const D: usize>(
        &self,
        src: usize,
        device: &B::Device,
    ) -> DistResult<Work<Tensor<B, D>>> {
        self.check_peer(src, "recv source")?;
        let group = self.clone();
        let device = device.clone();
        Ok(Work::new(move || {
            let seq = group.inner.shared.receives.fetch_add(1, Ordering::Relaxed);
            let info = &group.inner.info;
            let message = group.inner.transport.recv(info, src, seq)?;
            if message.shape.len() != D {
                return Err(DistError::Mismatch {
                    rank: info.global_rank,
                    group: info.name.clone(),
                    op: format!("recv(src={src})"),
                    seq,
                    detail: format!(
                        "expected a tensor of rank {D}, rank {} sent shape {:?}",
                        info.members[src], message.shape
                    ),
                });
            }
            match message.data {
                Some(data) => Ok(tensor_from_data(data, &device)),
                None => B::recv_on_device(&group, src, message.shape, message.dtype, &device)
                    .unwrap_or_else(|| {
                        Err(DistError::Mismatch {
                            rank: info.global_rank,
                            group: info.name.clone(),
                            op: format!("recv(src={src})"),
                            seq,
                            detail: format!(
                                "rank {} sent over NCCL; this rank's backend has no NCCL",
                                info.members[src]
                            ),
                        })
                    }),
            }
        }))
    }

    fn check_peer(&self, peer: usize, what: &str) -> DistResult<()> {
        if peer >= self.size() || (what != "broadcast root" && peer == self.rank()) {
            return Err(DistError::InvalidArgument(format!(
                "group '{}' of {} ranks: {what} {peer} is not a valid peer of rank {}",
                self.name(),
                self.size(),
                self.rank()
            )));
        }
        Ok(())
    }

    fn start<B: DeviceTransport, const D: usize>(
        &self,
        op: CollectiveOp,
        x: Tensor<B, D>,
    ) -> DistResult<Pending> {
        let shape = x.dims().to_vec();
        let dtype = x.dtype();
        let data = self.read(x, op)?;
        self.deposit(Contribution {
            op,
            shape,
            dtype,
            data: Some(data),
        })
    }

    /// `x`, the input of `op` through the host, read from the device: a device error is a
    /// [`DistError::Device`] (Burn's `into_data` would panic).
    fn read<B: Backend, const D: usize>(
        &self,
        x: Tensor<B, D>,
        op: CollectiveOp,
    ) -> DistResult<TensorData> {
        x.try_into_data().map_err(|e| DistError::Device {
            rank: self.global_rank(),
            group: self.name().to_string(),
            what: format!("the input of {op}"),
            message: match e {
                ExecutionError::WithContext { reason } | ExecutionError::Generic { reason, .. } => {
                    reason.trim().to_string()
                }
            },
        })
    }

    fn start_without_data(
        &self,
        op: CollectiveOp,
        shape: Vec<usize>,
        dtype: burn::tensor::DType,
    ) -> DistResult<Pending> {
        self.deposit(Contribution {
            op,
            shape,
            dtype,
            data: None,
        })
    }

    fn deposit(&self, part: Contribution) -> DistResult<Pending> {
        self.backward_failure()?;
        let seq = self
            .inner
            .shared
            .collectives
            .fetch_add(1, Ordering::Relaxed);
        let op = part.op;
        self.inner.transport.deposit(&self.inner.info, seq, part)?;
        Ok(Pending {
            group: self.clone(),
            seq,
            op,
        })
    }
}

/// A collective this rank has joined, waiting for its peers.
struct Pending {
    group: ProcessGroup,
    seq: u64,
    op: CollectiveOp,
}

impl Pending {
    /// Every rank's contribution, in rank order, once all have arrived and agree.
    fn collect(&self) -> DistResult<Vec<Contribution>> {
        let info = &self.group.inner.info;
        let parts = self
            .group
            .inner
            .transport
            .collect(info, self.seq, &self.op.to_string())?;
        if let Some(detail) = disagreement(&parts, &info.members) {
            return Err(DistError::Mismatch {
                rank: info.global_rank,
                group: info.name.clone(),
                op: self.op.to_string(),
                seq: self.seq,
                detail,
            });
        }
        Ok(parts)
    }
}

/// Why the ranks' contributions cannot be combined, if they cannot.
fn disagreement(parts: &[Contribution], members: &[usize]) -> Option<String> {
    let first = &parts[0];
    let agree = parts.iter().all(|p| {
        p.op == first.op
            && p.dtype == first.dtype
            && match first.op {
                CollectiveOp::Barrier => true,
                // Shards may differ in length along the dimension they are concatenated on.
                CollectiveOp::AllGather { dim: free }
                | CollectiveOp::AllToAll {
                    concat_dim: free, ..
                } => {
                    p.shape.len() == first.shape.len()
                        && p.shape
                            .iter()
                            .zip(&first.shape)
                            .enumerate()
                            .all(|(d, (a, b))| d == free || a == b)
                }
                _ => p.shape == first.shape,
            }
    });
    if agree {
        return None;
    }
    let lines: Vec<String> = parts
        .iter()
        .zip(members)
        .map(|(p, rank)| format!("rank {rank}: {} {:?} {:?}", p.op, p.shape, p.dtype))
        .collect();
    Some(lines.join("; "))
}

impl Contribution {
    fn tensor<B: DeviceTransport, const D: usize>(self, device: &B::Device) -> Tensor<B, D> {
        tensor_from_data(self.data.expect("contribution carries data"), device)
    }
}

/// A tensor with the data's own dtype (not the device's default float type).
pub(crate) fn tensor_from_data<B: DeviceTransport, const D: usize>(
    data: TensorData,
    device: &B::Device,
) -> Tensor<B, D> {
    let dtype = data.dtype;
    Tensor::from_data(data, (device, dtype))
}

/// Combines tensors in rank order. Every rank runs the same sequence of operations, so every
/// rank gets bit-identical results.
fn reduce<B: DeviceTransport, const D: usize>(
    tensors: Vec<Tensor<B, D>>,
    op: ReduceOp,
    size: usize,
) -> Tensor<B, D> {
    let total = tensors
        .into_iter()
        .reduce(|acc, t| match op {
            ReduceOp::Sum | ReduceOp::Avg => acc + t,
            ReduceOp::Max => acc.max_pair(t),
            ReduceOp::Min => acc.min_pair(t),
        })
        .expect("a group has at least one rank");
    match op {
        ReduceOp::Avg => total.div_scalar(size as f64),
        _ => total,
    }
}

fn check_dim<const D: usize>(dim: usize, op: &str) -> DistResult<()> {
    if dim >= D {
        return Err(DistError::InvalidArgument(format!(
            "{op}: dimension {dim} is out of range for a tensor of rank {D}"
        )));
    }
    Ok(())
}

impl ProcessGroup {
    /// A new group of the given global ranks (in group order) in the same world. Every member
    /// creates it with the same name and ranks; creating it again returns the same group.
    pub fn new_group(&self, name: &str, ranks: &[usize]) -> DistResult<ProcessGroup> {
        ProcessGroup::new(
            self.inner.transport.clone(),
            self.inner.registry.clone(),
            name,
            ranks.to_vec(),
            self.global_rank(),
        )
    }
}
