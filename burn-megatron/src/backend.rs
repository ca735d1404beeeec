//! The backend burn-megatron's models are generic over: every op's trait (see [`crate::ops`])
//! and what the training loop asks a backend about itself.
//!
//! An op's trait, composition, autodiff node and kernel wiring live in the op's own file. Here
//! are only [`ModelBackend`], which gathers them, and the backends whose ops are all the
//! compositions (NdArray, and Burn's fusion backend over burn-cuda).

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_megatron_dist::DistBackend;

use crate::ops::{
    AdamWOps, BackwardHookOps, BiasOps, CounterNormalOps, CrossEntropyOps, DecodeAttentionOps,
    DropoutOps, EmbeddingOps, FlashAttentionOps, Fp8LinearOps, Fp8Ops, GatheredLinearOps, GeluOps,
    GroupedLinearOps, HostTransferOps, IdCheckOps, LinearOps, NormOps, PackedFlashAttentionOps,
    PermuteOps, RecomputeOps, ReduceScatteredLinearOps, RingFlashAttentionOps, RopeOps, SoftmaxOps,
    SwiGluOps, TopKOps, WriteSlotOps,
};

/// What the training loop asks a backend about itself.
pub trait BackendInfo: Backend {
    /// Bytes of device memory this process's tensors on `device` use now (the memory pool's
    /// live allocations, in queue order: no wait for the device), for the training log;
    /// `None` where the backend does not track it (the CPU).
    fn memory_in_use(_device: &Self::Device) -> Option<u64> {
        None
    }

    /// The id of `tensor`'s autodiff node (for a parameter, its leaf), `None` on a backend
    /// without autodiff. Thread ranks compare them to refuse parameters shared between ranks
    /// (see [`DistributedAdamWConfig::init`](crate::optimizer::DistributedAdamWConfig::init)).
    fn autodiff_node(tensor: &Self::FloatTensorPrimitive) -> Option<u64> {
        let _ = tensor;
        None
    }

    /// Starts recording where `device`'s GPU time goes, per kernel, where the backend can
    /// (our CUDA backend with `BM_PROFILE=1`: `burn_megatron_kernels::cuda::profile`); for
    /// `--profile`. Returns whether it records.
    fn profile_start(device: &Self::Device) -> bool {
        let _ = device;
        false
    }

    /// Tags the work submitted to `device` from now on with `phase` ("forward", "backward",
    /// "optimizer") in a recording [`profile_start`](Self::profile_start) began, so that its
    /// table splits GPU and idle time by phase; a no-op where nothing records.
    fn profile_phase(device: &Self::Device, phase: &'static str) {
        let _ = (device, phase);
    }

    /// Waits for `device`, stops the recording [`profile_start`](Self::profile_start) began,
    /// and gives its table (the `top` kernels, times per step over `steps` steps); `None`
    /// where nothing was recorded.
    fn profile_report(device: &Self::Device, top: usize, steps: usize) -> Option<String> {
        let _ = (device, top, steps);
        None
    }

    /// Starts capturing `device`'s work into a graph replayed later with one launch (a CUDA
    /// graph on our CUDA backend): `Ok(false)` where the backend has none. The work is
    /// recorded, not run, until [`graph_end`](Self::graph_end).
    fn graph_begin(device: &Self::Device) -> Result<bool, String> {
        let _ = device;
        Ok(false)
    }

    /// Ends the capture [`graph_begin`](Self::graph_begin) started: the graph, or what the
    /// captured work did that a graph cannot hold.
    fn graph_end(device: &Self::Device) -> Result<StepGraph, String> {
        let _ = device;
        Err("this backend captures no graphs".into())
    }

    /// The device address of a float tensor's memory (`None` where there is none to tell):
    /// whether an update was made in place, which a captured step's state must be.
    fn float_address(tensor: &Self::FloatTensorPrimitive) -> Option<u64> {
        let _ = tensor;
        None
    }

    /// [`float_address`](Self::float_address) of an integer tensor.
    fn int_address(tensor: &Self::IntTensorPrimitive) -> Option<u64> {
        let _ = tensor;
        None
    }
}

/// A step's device work, captured once and replayed with one launch (see
/// [`BackendInfo::graph_begin`]).
pub struct StepGraph {
    graph: Box<dyn ReplayGraph>,
}

impl core::fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "StepGraph({} nodes)", self.nodes())
    }
}

/// What a backend's captured graph does.
pub trait ReplayGraph: Send {
    /// Enqueues the captured work once more (no host synchronisation).
    fn replay(&self);
    /// The captured operations.
    fn nodes(&self) -> usize;
}

impl StepGraph {
    /// Wraps a backend's graph.
    pub fn new(graph: impl ReplayGraph + 'static) -> Self {
        Self {
            graph: Box::new(graph),
        }
    }

    /// Enqueues the captured work once more.
    pub fn replay(&self) {
        self.graph.replay();
    }

    /// The captured operations.
    pub fn nodes(&self) -> usize {
        self.graph.nodes()
    }
}

/// A [`DistBackend`] with every operation of the model (see [`crate::ops`]): implemented for
/// every backend that has them all, as the traits' compositions or as kernels.
pub trait ModelBackend:
    DistBackend
    + BackendInfo
    + LinearOps
    + Fp8Ops
    + Fp8LinearOps
    + GatheredLinearOps
    + GroupedLinearOps
    + ReduceScatteredLinearOps
    + BiasOps
    + GeluOps
    + SwiGluOps
    + NormOps
    + DropoutOps
    + CounterNormalOps
    + RopeOps
    + SoftmaxOps
    + DecodeAttentionOps
    + FlashAttentionOps
    + RingFlashAttentionOps
    + PackedFlashAttentionOps
    + RecomputeOps
    + EmbeddingOps
    + PermuteOps
    + TopKOps
    + CrossEntropyOps
    + IdCheckOps
    + BackwardHookOps
    + WriteSlotOps
    + AdamWOps
    + HostTransferOps
{
}

impl<B> ModelBackend for B where
    B: DistBackend
        + BackendInfo
        + LinearOps
        + Fp8Ops
        + Fp8LinearOps
        + GatheredLinearOps
        + GroupedLinearOps
        + ReduceScatteredLinearOps
        + BiasOps
        + GeluOps
        + SwiGluOps
        + NormOps
        + DropoutOps
        + CounterNormalOps
        + RopeOps
        + SoftmaxOps
        + DecodeAttentionOps
        + FlashAttentionOps
        + RingFlashAttentionOps
        + PackedFlashAttentionOps
        + RecomputeOps
        + EmbeddingOps
        + PermuteOps
        + TopKOps
        + CrossEntropyOps
        + IdCheckOps
        + BackwardHookOps
        + WriteSlotOps
        + AdamWOps
        + HostTransferOps
{
}

impl<B: BackendInfo, C: CheckpointStrategy> BackendInfo for Autodiff<B, C> {
    fn memory_in_use(device: &Self::Device) -> Option<u64> {
        B::memory_in_use(device)
    }

    fn autodiff_node(tensor: &Self::FloatTensorPrimitive) -> Option<u64> {
        Some(tensor.node.id.value)
    }

    fn profile_start(device: &Self::Device) -> bool {
        B::profile_start(device)
    }

    fn profile_phase(device: &Self::Device, phase: &'static str) {
        B::profile_phase(device, phase)
    }

    fn profile_report(device: &Self::Device, top: usize, steps: usize) -> Option<String> {
        B::profile_report(device, top, steps)
    }

    fn graph_begin(device: &Self::Device) -> Result<bool, String> {
        B::graph_begin(device)
    }

    fn graph_end(device: &Self::Device) -> Result<StepGraph, String> {
        B::graph_end(device)
    }
}

/// Implements each listed op trait for a backend with the traits' defaults: the compositions.
macro_rules! compositions {
    ($generics:tt $backend:ty where $bounds:tt; $($op:ident),+ $(,)?) => {
        $(compositions!(@one $generics $backend where $bounds; $op);)+
    };
    (@one [$($generics:tt)*] $backend:ty where [$($bounds:tt)*]; $op:ident) => {
        impl<$($generics)*> $op for $backend where $($bounds)* {}
    };
}

/// NdArray (the CPU, and every test's reference): the compositions.
mod ndarray {
    use burn::backend::NdArray;
    use burn::backend::ndarray::{
        FloatNdArrayElement, IntNdArrayElement, NdArrayTensor, QuantElement, SharedArray,
    };

    use super::*;

    compositions!(
        [E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement] NdArray<E, I, Q>
        where [NdArrayTensor: From<SharedArray<E>>, NdArrayTensor: From<SharedArray<I>>];
        BackendInfo, LinearOps, Fp8Ops, Fp8LinearOps, GatheredLinearOps, GroupedLinearOps, ReduceScatteredLinearOps, BiasOps, GeluOps, SwiGluOps, NormOps, DropoutOps, CounterNormalOps, RopeOps,
        SoftmaxOps, DecodeAttentionOps, FlashAttentionOps, RingFlashAttentionOps, PackedFlashAttentionOps, RecomputeOps, EmbeddingOps, PermuteOps, TopKOps,
        CrossEntropyOps, IdCheckOps, BackwardHookOps, WriteSlotOps, AdamWOps, HostTransferOps,
    );
}

/// Burn's fusion backend (burn-cuda's default): the compositions, which it fuses.
#[cfg(feature = "cuda")]
mod fusion {
    use burn_fusion::{Fusion, FusionBackend};

    use super::*;

    compositions!(
        [B: FusionBackend] Fusion<B> where [];
        BackendInfo, LinearOps, Fp8Ops, Fp8LinearOps, GatheredLinearOps, GroupedLinearOps, ReduceScatteredLinearOps, BiasOps, GeluOps, SwiGluOps, NormOps, DropoutOps, CounterNormalOps, RopeOps,
        SoftmaxOps, DecodeAttentionOps, FlashAttentionOps, RingFlashAttentionOps, PackedFlashAttentionOps, RecomputeOps, EmbeddingOps, PermuteOps, TopKOps,
        CrossEntropyOps, IdCheckOps, BackwardHookOps, WriteSlotOps, AdamWOps, HostTransferOps,
    );
}

/// CubeCL backends report their memory pool's live bytes.
#[cfg(feature = "fused")]
impl<R, F, I, BT> BackendInfo for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
    fn memory_in_use(device: &Self::Device) -> Option<u64> {
        R::client(device)
            .memory_usage()
            .ok()
            .map(|usage| usage.bytes_in_use)
    }

    /// Our CUDA runtime's built-in profile; other CubeCL runtimes have none.
    fn profile_start(device: &Self::Device) -> bool {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = (device as &dyn core::any::Any)
            .downcast_ref::<burn_megatron_kernels::cuda::CudaGpu>()
            .filter(|_| burn_megatron_kernels::cuda::profile::enabled())
        {
            burn_megatron_kernels::cuda::profile::start(gpu);
            return true;
        }
        let _ = device;
        false
    }

    fn profile_phase(device: &Self::Device, phase: &'static str) {
        #[cfg(feature = "cuda")]
        if let Some(gpu) =
            (device as &dyn core::any::Any).downcast_ref::<burn_megatron_kernels::cuda::CudaGpu>()
        {
            burn_megatron_kernels::cuda::profile::phase(gpu, phase);
        }
        let _ = (device, phase);
    }

    fn profile_report(device: &Self::Device, top: usize, steps: usize) -> Option<String> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = (device as &dyn core::any::Any)
            .downcast_ref::<burn_megatron_kernels::cuda::CudaGpu>()
            .filter(|_| burn_megatron_kernels::cuda::profile::enabled())
        {
            return Some(match burn_megatron_kernels::cuda::profile::report(gpu) {
                Ok(report) => report.table(top, steps),
                Err(e) => format!("the profile could not be read: {e}"),
            });
        }
        let _ = (device, top, steps);
        None
    }

    /// Our CUDA runtime's CUDA graphs (`burn_megatron_kernels::cuda::graph`); other CubeCL
    /// runtimes have none.
    fn graph_begin(device: &Self::Device) -> Result<bool, String> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) =
            (device as &dyn core::any::Any).downcast_ref::<burn_megatron_kernels::cuda::CudaGpu>()
        {
            return burn_megatron_kernels::cuda::graph::begin_capture(gpu).map(|()| true);
        }
        let _ = device;
        Ok(false)
    }

    fn graph_end(device: &Self::Device) -> Result<StepGraph, String> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) =
            (device as &dyn core::any::Any).downcast_ref::<burn_megatron_kernels::cuda::CudaGpu>()
        {
            return burn_megatron_kernels::cuda::graph::end_capture(gpu).map(StepGraph::new);
        }
        let _ = device;
        Err("this backend captures no graphs".into())
    }

    fn float_address(tensor: &Self::FloatTensorPrimitive) -> Option<u64> {
        cuda_address(tensor)
    }

    fn int_address(tensor: &Self::IntTensorPrimitive) -> Option<u64> {
        cuda_address(tensor)
    }
}

/// The device address of a CubeCL tensor of our CUDA runtime (`None` for other runtimes').
#[cfg(feature = "fused")]
fn cuda_address(tensor: &dyn core::any::Any) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if let Some(tensor) = tensor.downcast_ref::<
        burn_cubecl::tensor::CubeTensor<burn_megatron_kernels::cuda::MegatronCudaRuntime>,
    >() {
        return burn_megatron_kernels::cuda::graph::address(tensor);
    }
    let _ = tensor;
    None
}

/// Our CUDA runtime's graphs replay through [`StepGraph`].
#[cfg(feature = "cuda")]
impl ReplayGraph for burn_megatron_kernels::cuda::graph::CapturedGraph {
    fn replay(&self) {
        burn_megatron_kernels::cuda::graph::CapturedGraph::replay(self);
    }

    fn nodes(&self) -> usize {
        burn_megatron_kernels::cuda::graph::CapturedGraph::nodes(self)
    }
}
