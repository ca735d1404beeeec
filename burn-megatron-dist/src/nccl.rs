//! NCCL behind [`ProcessGroup`](crate::ProcessGroup): collectives on tensors of our CUDA
//! backend ([`MegatronCuda`]) stay on the GPU.
//!
//! Each group gets its own communicator on its first GPU collective (group rank 0 creates the
//! NCCL id and hands it to the others through the group's host transport), and its own side
//! stream of the device. Every call is an in-band foreign operation on that stream, on Burn's
//! buffers: it starts after the compute work enqueued before it, and the compute stream waits
//! for it before the next use of its memory. No host synchronisation. A watchdog thread follows
//! each call until its GPU work ends.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use burn::tensor::{DType, Shape, Tensor, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::ops::reshape;
use burn_cubecl::tensor::CubeTensor;
use burn_megatron_kernels::cuda::{
    CudaGpu, ForeignQueue, Lane, MegatronCuda, MegatronCudaRuntime, binding,
};
use cudarc::nccl::result as nccl;
use cudarc::nccl::sys;

use crate::error::{DistError, DistResult};
use crate::op::ReduceOp;
use crate::transport::{GroupInfo, Transport};
use crate::watchdog::{Tracked, Watchdog};

/// A tensor of our CUDA backend, as the NCCL calls take it.
pub(crate) type GpuTensor = CubeTensor<MegatronCudaRuntime>;

/// The id all ranks of a communicator share (rank 0 creates it and sends it to the others).
#[derive(Clone, Copy)]
pub struct NcclId(sys::ncclUniqueId);

impl NcclId {
    /// A fresh id.
    pub fn new() -> DistResult<Self> {
        nccl::get_uniqueid()
            .map(Self)
            .map_err(|e| DistError::Nccl(format!("ncclGetUniqueId: {e:?}")))
    }

    /// Its 128 bytes, to send to the other ranks.
    pub fn to_bytes(&self) -> [u8; 128] {
        self.0.internal.map(|c| c as u8)
    }

    /// The id from its 128 bytes.
    pub fn from_bytes(bytes: [u8; 128]) -> Self {
        Self(sys::ncclUniqueId {
            internal: bytes.map(|b| b as core::ffi::c_char),
        })
    }
}

fn data_type(dtype: DType) -> DistResult<sys::ncclDataType_t> {
    Ok(match dtype {
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        other => {
            return Err(DistError::InvalidArgument(format!(
                "NCCL collectives take f64, f32, bf16 or f16 tensors, not {other:?}"
            )));
        }
    })
}

fn reduction(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
    }
}

/// The collectives on one flat buffer (see [`NcclGroup::collective`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Flat {
    AllReduce(ReduceOp),
    /// From this group rank.
    Broadcast(usize),
    AllGather,
    ReduceScatter(ReduceOp),
}

impl Flat {
    fn name(self) -> &'static str {
        match self {
            Flat::AllReduce(_) => "ncclAllReduce",
            Flat::Broadcast(_) => "ncclBroadcast",
            Flat::AllGather => "ncclAllGather",
            Flat::ReduceScatter(_) => "ncclReduceScatter",
        }
    }
}

/// A raw communicator handle (NCCL communicators may be used from any thread).
#[derive(Debug, Clone, Copy)]
struct Comm(usize);

impl Comm {
    fn raw(self) -> sys::ncclComm_t {
        self.0 as sys::ncclComm_t
    }
}

/// What one foreign operation enqueues, given the device pointers of its tensors.
type Body = Box<dyn FnOnce(&[u64], sys::ncclComm_t, sys::cudaStream_t) -> NcclResult + Send>;
type NcclResult = Result<(), String>;

fn check(what: &str, result: Result<nccl::NcclStatus, nccl::NcclError>) -> NcclResult {
    result.map(|_| ()).map_err(|e| format!("{what}: {e:?}"))
}

/// One group's NCCL communicator on this rank.
#[derive(Debug)]
pub(crate) struct NcclGroup {
    comm: Comm,
    gpu: CudaGpu,
    queue: ForeignQueue,
    lane: Lane,
    size: usize,
    watchdog: Arc<Watchdog>,
    aborted: Arc<Mutex<bool>>,
}

/// Side streams handed out to communicators, per process (each group its own stream, so
/// that collectives of different groups never wait behind each other).
static NEXT_LANE: AtomicU8 = AtomicU8::new(1);

impl NcclGroup {
    /// Joins the communicator `id` on `gpu`; blocks until every member has joined.
    pub fn new(
        gpu: &CudaGpu,
        id: NcclId,
        info: &GroupInfo,
        transport: Arc<dyn Transport>,
    ) -> DistResult<Self> {
        let queue = ForeignQueue::new(gpu);
        let (rank, size) = (info.group_rank, info.members.len());
        let (comm, context) = queue.run_blocking(move |_| {
            let mut comm = core::mem::MaybeUninit::uninit();
            // SAFETY: `comm` receives the new communicator; the device's context is current.
            let comm = unsafe {
                nccl::comm_init_rank(comm.as_mut_ptr(), size as i32, id.0, rank as i32)
                    .map(|_| comm.assume_init() as usize)
            };
            let context = cudarc::driver::result::ctx::get_current();
            (comm, context.ok().flatten().map_or(0, |c| c as usize))
        });
        let comm = comm.map_err(|e| {
            DistError::Nccl(format!(
                "rank {}: ncclCommInitRank for group '{}' on {gpu:?}: {e:?}",
                info.global_rank, info.name
            ))
        })?;
        let aborted = Arc::new(Mutex::new(false));
        let abort = {
            let aborted = aborted.clone();
            Box::new(move || {
                let mut aborted = aborted.lock().unwrap_or_else(PoisonError::into_inner);
                if !*aborted {
                    *aborted = true;
                    // SAFETY: a live communicator, aborted once; NCCL allows this from any
                    // thread while operations are in flight (that is its purpose).
                    let _ = unsafe { nccl::comm_abort(comm as sys::ncclComm_t) };
                }
            })
        };
        let comm_error = {
            let aborted = aborted.clone();
            Box::new(move || {
                // An aborted communicator is gone: nothing to ask.
                let aborted = aborted.lock().unwrap_or_else(PoisonError::into_inner);
                if *aborted {
                    return None;
                }
                let mut result = sys::ncclResult_t::ncclSuccess;
                // SAFETY: a live communicator (not aborted: checked under the lock that
                // `abort` takes); NCCL allows the query from any thread.
                let status =
                    unsafe { sys::ncclCommGetAsyncError(comm as sys::ncclComm_t, &mut result) };
                match (status, result) {
                    (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess)
                    | (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclInProgress) => None,
                    (sys::ncclResult_t::ncclSuccess, error) => Some(format!("{error:?}")),
                    (failed, _) => Some(format!("ncclCommGetAsyncError: {failed:?}")),
                }
            })
        };
        let watchdog = Watchdog::start(
            info.clone(),
            transport,
            queue.alarms(),
            context,
            abort,
            comm_error,
        );
        let lane = Lane::Side(NEXT_LANE.fetch_add(1, Ordering::Relaxed).max(1));
        Ok(Self {
            comm: Comm(comm),
            gpu: gpu.clone(),
            queue,
            lane,
            size,
            watchdog,
            aborted,
        })
    }

    /// The GPU the communicator lives on.
    pub fn gpu(&self) -> &CudaGpu {
        &self.gpu
    }

    /// The error the watchdog ended a collective with, if any, without waiting.
    pub fn failure(&self) -> DistResult<()> {
        self.watchdog.failure()
    }

    /// Waits for every collective started so far to end on the GPU.
    pub fn synchronize(&self) -> DistResult<()> {
        self.watchdog.synchronize()
    }

    /// Waits at the rank's end (an error the rank has already seen is not repeated).
    pub fn finish(&self) -> DistResult<()> {
        self.watchdog.finish()
    }

    /// Enqueues `body` on the group's stream with the pointers of `tensors`, tracked by the
    /// watchdog as collective `seq`.
    fn submit(&self, seq: u64, op: String, tensors: &[&GpuTensor], body: Body) -> DistResult<()> {
        let first = tensors.first().expect("a collective touches memory");
        let tracked: Arc<Tracked> =
            self.watchdog
                .track(seq, op, first.meta.shape().to_vec(), first.dtype)?;
        let comm = self.comm;
        let bindings = tensors.iter().map(|t| binding(t)).collect();
        self.queue.submit("nccl", bindings, self.lane, move |ctx| {
            let stream = ctx.stream as sys::cudaStream_t;
            let result = body(ctx.pointers, comm.raw(), stream);
            tracked.enqueued(ctx);
            result
        });
        // A collective must not wait in the queue while its peers wait for it.
        self.queue.flush();
        Ok(())
    }

    /// Has the watchdog follow, as collective `seq` named `op`, the work enqueued on the
    /// device so far: a replayed CUDA graph whose captured collectives are this group's (a
    /// capture records them without an event, see `ForeignContext::capturing`), so that a
    /// replay a peer never joins times out like any collective.
    pub fn watch(&self, seq: u64, op: String) -> DistResult<()> {
        let tracked = self.watchdog.track(seq, op, Vec::new(), DType::F32)?;
        self.queue
            .submit("nccl watch", Vec::new(), Lane::Compute, move |ctx| {
                tracked.enqueued(ctx);
                Ok(())
            });
        self.queue.flush();
        Ok(())
    }

    /// Runs `call` on `x` as one flat run of elements and returns the flat result: the
    /// reduction, the root's buffer, every rank's part (all-gather), or this rank's part of
    /// the reduction (reduce-scatter; `x` holds `size` equal parts). An all-reduce whose
    /// input nothing else holds (`x = all_reduce(x)`) runs in place, as Megatron reduces
    /// gradient buckets.
    pub fn collective(
        &self,
        seq: u64,
        op: String,
        x: GpuTensor,
        call: Flat,
    ) -> DistResult<GpuTensor> {
        let (input, count, dtype) = flat(x)?;
        let output = match call {
            Flat::AllReduce(_) if input.can_mut() => input.clone(),
            Flat::AllReduce(_) | Flat::Broadcast(_) => empty_like(&input, count),
            Flat::AllGather => empty_like(&input, count * self.size),
            Flat::ReduceScatter(_) => empty_like(&input, count / self.size),
        };
        let part = count / self.size;
        let body: Body = Box::new(move |p, comm, stream| {
            let (src, dst) = (p[0] as *const _, p[1] as *mut _);
            // SAFETY: the buffers hold what `call` implies (see above); NCCL allows an
            // all-reduce's two buffers to be one.
            let result = unsafe {
                match call {
                    Flat::AllReduce(red) => {
                        nccl::all_reduce(src, dst, count, dtype, reduction(red), comm, stream)
                    }
                    Flat::Broadcast(root) => {
                        nccl::broadcast(src, dst, count, dtype, root as i32, comm, stream)
                    }
                    Flat::AllGather => nccl::all_gather(src, dst, count, dtype, comm, stream),
                    Flat::ReduceScatter(red) => {
                        nccl::reduce_scatter(src, dst, part, dtype, reduction(red), comm, stream)
                    }
                }
            };
            check(call.name(), result)
        });
        self.submit(seq, op, &[&input, &output], body)?;
        Ok(output)
    }

    /// Sends `sends[q]` to rank `q` and receives `recv_counts[q]` elements from each, in one
    /// NCCL group (so no pair waits on another): all-to-all, and send/recv.
    pub fn exchange(
        &self,
        seq: u64,
        op: String,
        sends: Vec<Option<GpuTensor>>,
        recvs: Vec<Option<(usize, DType)>>,
    ) -> DistResult<Vec<Option<GpuTensor>>> {
        let mut ops = Vec::new();
        for (peer, send) in sends.into_iter().enumerate() {
            if let Some(tensor) = send {
                ops.push(PeerOp::Send {
                    tensor: Box::new(tensor),
                    peer,
                });
            }
        }
        let mut receiving = Vec::new();
        for (peer, recv) in recvs.into_iter().enumerate() {
            if let Some((count, dtype)) = recv {
                ops.push(PeerOp::Recv { peer, count, dtype });
                receiving.push(peer);
            }
        }
        let mut received = vec![None; self.size];
        for (peer, buffer) in receiving
            .into_iter()
            .zip(self.point_to_point(seq, op, ops)?)
        {
            received[peer] = Some(buffer);
        }
        Ok(received)
    }

    /// Runs `ops` (sends and receives, several with one peer allowed) as one NCCL group on
    /// the group's stream, in one foreign operation, and returns the flat receive buffers in
    /// the order of the receives. Between two ranks, the n-th send meets the n-th receive.
    pub fn point_to_point(
        &self,
        seq: u64,
        op: String,
        ops: Vec<PeerOp>,
    ) -> DistResult<Vec<GpuTensor>> {
        let mut plan = Vec::with_capacity(ops.len());
        let mut tensors = Vec::with_capacity(ops.len());
        let mut received = Vec::new();
        for peer_op in ops {
            match peer_op {
                PeerOp::Send { tensor, peer } => {
                    let (send, count, dtype) = flat(*tensor)?;
                    plan.push((true, peer, count, dtype));
                    tensors.push(send);
                }
                PeerOp::Recv { peer, count, dtype } => {
                    let buffer = empty_device_contiguous_dtype(
                        <MegatronCudaRuntime as cubecl_runtime::runtime::Runtime>::client(
                            &self.gpu,
                        ),
                        self.gpu.clone(),
                        Shape::from([count]),
                        dtype,
                    );
                    plan.push((false, peer, count, data_type(dtype)?));
                    tensors.push(buffer.clone());
                    received.push(buffer);
                }
            }
        }
        if plan.is_empty() {
            return Ok(received);
        }
        let body: Body = Box::new(move |p, comm, stream| {
            check("ncclGroupStart", nccl::group_start())?;
            for (&(is_send, peer, count, dtype), &ptr) in plan.iter().zip(p) {
                // SAFETY: each buffer holds `count` elements of `dtype`.
                let result = unsafe {
                    match is_send {
                        true => nccl::send(ptr as _, count, dtype, peer as i32, comm, stream),
                        false => nccl::recv(ptr as _, count, dtype, peer as i32, comm, stream),
                    }
                };
                if let Err(e) = check(if is_send { "ncclSend" } else { "ncclRecv" }, result) {
                    // Close the group so that the communicator stays usable for the abort.
                    let _ = nccl::group_end();
                    return Err(e);
                }
            }
            check("ncclGroupEnd", nccl::group_end())
        });
        let refs: Vec<&GpuTensor> = tensors.iter().collect();
        self.submit(seq, op, &refs, body)?;
        Ok(received)
    }
}

/// One send or receive of a grouped point-to-point call ([`NcclGroup::point_to_point`]).
#[derive(Debug, Clone)]
pub(crate) enum PeerOp {
    /// Sends `tensor` (any shape; sent as its contiguous elements) to group rank `peer`.
    Send { tensor: Box<GpuTensor>, peer: usize },
    /// Receives `count` elements of `dtype` from group rank `peer`.
    Recv {
        peer: usize,
        count: usize,
        dtype: DType,
    },
}

/// One op of a batch on GPU tensors (`ProcessGroup::nccl_batch`).
#[derive(Debug, Clone)]
pub(crate) enum GpuP2p {
    /// Sends `tensor` to group rank `peer`.
    Send { tensor: Box<GpuTensor>, peer: usize },
    /// Receives a tensor of `shape` and `dtype` from group rank `peer`.
    Recv {
        peer: usize,
        shape: Vec<usize>,
        dtype: DType,
    },
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        self.watchdog.stop();
        if *self.aborted.lock().unwrap_or_else(PoisonError::into_inner) {
            return;
        }
        let comm = self.comm;
        // The rank has waited for its collectives (`finish`). Abort, unlike destroy, never
        // waits on peers, one of which may be gone; it runs on the device thread after
        // everything queued there.
        self.queue.run_blocking(move |_| {
            // SAFETY: no further use of the communicator follows.
            let _ = unsafe { nccl::comm_abort(comm.raw()) };
        });
    }
}

/// `x` as one contiguous run of elements (pitched rows and strides are copied out), with
/// its element count and NCCL type.
fn flat(x: GpuTensor) -> DistResult<(GpuTensor, usize, sys::ncclDataType_t)> {
    let count = x.meta.shape().num_elements();
    let dtype = data_type(x.dtype)?;
    Ok((
        into_contiguous(reshape(x, Shape::from([count]))),
        count,
        dtype,
    ))
}

fn empty_like(like: &GpuTensor, count: usize) -> GpuTensor {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from([count]),
        like.dtype,
    )
}

/// A tensor of our backend from its primitive, for the tensor ops around the NCCL calls.
pub(crate) fn tensor<const D: usize>(x: GpuTensor) -> Tensor<MegatronCuda, D> {
    Tensor::from_primitive(TensorPrimitive::Float(x))
}

/// The primitive of a tensor of our backend.
pub(crate) fn primitive<const D: usize>(x: Tensor<MegatronCuda, D>) -> GpuTensor {
    x.into_primitive().tensor()
}
