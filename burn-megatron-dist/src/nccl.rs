//! NCCL collectives on our CUDA backend, as in-band foreign operations: on Burn's device
//! buffers, in stream order with Burn's kernels, with no host synchronisation.
//!
//! This is the first slice of the NCCL process groups: a communicator and the bandwidth-bound
//! collectives on [`MegatronCuda`] tensors. Wiring it behind [`ProcessGroup`](crate::ProcessGroup),
//! multi-process rendezvous and the watchdog come next.

use burn::tensor::{DType, Shape, Tensor, TensorPrimitive};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_megatron_kernels::cuda::{CudaGpu, ForeignQueue, Lane, MegatronCuda, binding};
use cudarc::nccl::result as nccl;
use cudarc::nccl::sys;

use crate::error::{DistError, DistResult};
use crate::op::ReduceOp;

/// The id all ranks of a communicator share (rank 0 creates it and sends it to the others).
#[derive(Clone, Copy)]
pub struct NcclId(sys::ncclUniqueId);

impl NcclId {
    /// A fresh id.
    pub fn new() -> DistResult<Self> {
        nccl::get_uniqueid()
            .map(Self)
            .map_err(|e| DistError::InvalidArgument(format!("ncclGetUniqueId: {e:?}")))
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

/// One rank's NCCL communicator on one GPU.
#[derive(Debug)]
pub struct NcclCommunicator {
    comm: usize,
    rank: usize,
    size: usize,
    queue: ForeignQueue,
}

fn nccl_error(what: &str, error: impl core::fmt::Debug) -> DistError {
    DistError::InvalidArgument(format!("{what}: {error:?}"))
}

fn data_type(dtype: DType) -> DistResult<sys::ncclDataType_t> {
    Ok(match dtype {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        other => {
            return Err(DistError::InvalidArgument(format!(
                "NCCL collectives take f32, bf16 or f16, not {other:?}"
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

type Primitive = burn_cubecl::tensor::CubeTensor<burn_megatron_kernels::cuda::MegatronCudaRuntime>;

impl NcclCommunicator {
    /// Joins communicator `id` as `rank` of `size` on `gpu`. Blocks until every rank has
    /// joined (each rank calls it from its own thread or process).
    pub fn new(gpu: &CudaGpu, id: NcclId, rank: usize, size: usize) -> DistResult<Self> {
        let queue = ForeignQueue::new(gpu);
        let comm = queue.run_blocking(move |_| {
            let mut comm = core::mem::MaybeUninit::uninit();
            // SAFETY: `comm` receives the new communicator; the device's context is current.
            unsafe { nccl::comm_init_rank(comm.as_mut_ptr(), size as i32, id.0, rank as i32) }
                .map(|_| unsafe { comm.assume_init() } as usize)
                .map_err(|e| nccl_error("ncclCommInitRank", e))
        })?;
        Ok(Self {
            comm,
            rank,
            size,
            queue,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    fn contiguous<const D: usize>(x: Tensor<MegatronCuda, D>) -> Primitive {
        // NCCL reads and writes flat buffers (no pitched rows, no strides).
        burn_cubecl::kernel::into_contiguous(x.into_primitive().tensor())
    }

    fn output(like: &Primitive, shape: Vec<usize>) -> Primitive {
        empty_device_contiguous_dtype(
            like.client.clone(),
            like.device.clone(),
            Shape::from(shape),
            like.dtype,
        )
    }

    /// Runs `call` on `x`: one foreign operation on the compute stream, on Burn's buffers,
    /// flushed at once (a collective must not wait in the queue while the peers wait for it).
    fn run<const D: usize>(
        &self,
        x: Tensor<MegatronCuda, D>,
        call: Call,
    ) -> DistResult<Tensor<MegatronCuda, D>> {
        let input = Self::contiguous(x);
        let dtype = data_type(input.dtype)?;
        let mut shape = input.meta.shape().to_vec();
        let elements = shape.iter().product::<usize>();
        // NCCL counts the per-rank part: the input of an all-gather, the output of a
        // reduce-scatter.
        let count = match call {
            Call::AllReduce(_) => elements,
            Call::AllGather => {
                shape[0] *= self.size;
                elements
            }
            Call::ReduceScatter(_) => {
                if !shape[0].is_multiple_of(self.size) {
                    return Err(DistError::InvalidArgument(format!(
                        "reduce_scatter: the first dimension ({}) must divide over {} ranks",
                        shape[0], self.size
                    )));
                }
                shape[0] /= self.size;
                elements / self.size
            }
        };
        let output = Self::output(&input, shape);
        let comm = self.comm as sys::ncclComm_t as usize;
        self.queue.submit(
            call.name(),
            vec![binding(&input), binding(&output)],
            Lane::Compute,
            move |ctx| {
                let (src, dst) = (ctx.pointers[0] as *const _, ctx.pointers[1] as *mut _);
                let (comm, stream) = (comm as sys::ncclComm_t, ctx.stream as sys::cudaStream_t);
                // SAFETY: the buffers hold what `count` and the collective imply (see above); the
                // communicator lives as long as the process.
                let result = unsafe {
                    match call {
                        Call::AllReduce(op) => {
                            nccl::all_reduce(src, dst, count, dtype, reduction(op), comm, stream)
                        }
                        Call::AllGather => nccl::all_gather(src, dst, count, dtype, comm, stream),
                        Call::ReduceScatter(op) => nccl::reduce_scatter(
                            src,
                            dst,
                            count,
                            dtype,
                            reduction(op),
                            comm,
                            stream,
                        ),
                    }
                };
                result.map(|_| ()).map_err(|e| format!("{e:?}"))
            },
        );
        self.queue.flush();
        Ok(Tensor::from_primitive(TensorPrimitive::Float(output)))
    }

    /// Every rank gets the reduction of all ranks' `x`.
    pub fn all_reduce<const D: usize>(
        &self,
        x: Tensor<MegatronCuda, D>,
        op: ReduceOp,
    ) -> DistResult<Tensor<MegatronCuda, D>> {
        self.run(x, Call::AllReduce(op))
    }

    /// Every rank gets all ranks' `x` concatenated along the first dimension.
    pub fn all_gather<const D: usize>(
        &self,
        x: Tensor<MegatronCuda, D>,
    ) -> DistResult<Tensor<MegatronCuda, D>> {
        self.run(x, Call::AllGather)
    }

    /// Every rank gets its shard (along the first dimension) of the reduction of all ranks' `x`.
    pub fn reduce_scatter<const D: usize>(
        &self,
        x: Tensor<MegatronCuda, D>,
        op: ReduceOp,
    ) -> DistResult<Tensor<MegatronCuda, D>> {
        self.run(x, Call::ReduceScatter(op))
    }
}

/// A bandwidth-bound collective.
#[derive(Debug, Clone, Copy)]
enum Call {
    AllReduce(ReduceOp),
    AllGather,
    ReduceScatter(ReduceOp),
}

impl Call {
    fn name(self) -> &'static str {
        match self {
            Call::AllReduce(_) => "ncclAllReduce",
            Call::AllGather => "ncclAllGather",
            Call::ReduceScatter(_) => "ncclReduceScatter",
        }
    }
}
