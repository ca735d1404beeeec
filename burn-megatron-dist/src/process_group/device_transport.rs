//! The backend hooks that move tensors over the device's own transport (NCCL) instead of
//! through the host. This is the only backend-specific part of communication; the
//! differentiable side (Megatron's mappings) builds on it in [`mapping`](crate::mapping)
//! and does not come back here.

use burn::backend::Autodiff;
use burn::backend::NdArray;
use burn::backend::ndarray::{
    FloatNdArrayElement, IntNdArrayElement, NdArrayTensor, QuantElement, SharedArray,
};
use burn::tensor::{DType, Tensor};
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;

use super::ProcessGroup;
use crate::error::DistResult;
use crate::host_read::HostRead;
use crate::op::{CollectiveOp, P2pOp};

/// What a backend did with a communication call: ran it on the device's own transport, or
/// handed the input back for the host path.
#[derive(Debug)]
pub enum OnDevice<T, Input> {
    /// Run on the device's transport: its result.
    Done(DistResult<T>),
    /// Not for the device's transport: the input, for the host path.
    Host(Input),
}

/// A Burn backend whose tensors [`ProcessGroup`] collectives can move.
///
/// Every hook has a default that hands the tensor back, and the group then moves it through
/// the host (thread or TCP transport). A backend with its own transport overrides them: our
/// CUDA backend (`burn_megatron_kernels::cuda::MegatronCuda`) runs them over
/// NCCL. Implemented for NdArray, for `Autodiff` over any implementing backend (the result is
/// a new leaf), and (features `cuda`, `wgpu`) for the CubeCL backends.
/// [`DistBackend`](crate::DistBackend) adds differentiable communication on top.
pub trait DeviceTransport: burn::tensor::backend::Backend {
    /// Runs `op` (a collective or a send) on the device's own transport, or gives `x` back
    /// for the host path.
    fn collective_on_device<const D: usize>(
        group: &ProcessGroup,
        op: CollectiveOp,
        x: Tensor<Self, D>,
    ) -> OnDevice<Tensor<Self, D>, Tensor<Self, D>> {
        let _ = (group, op);
        OnDevice::Host(x)
    }

    /// Whether collectives on `device` run on the device's own transport, asynchronously:
    /// the host only enqueues them and never waits for the other ranks (unless the group
    /// checks each call on the host first, [`ProcessGroup::checks_collectives`]). Such a
    /// collective may start inside a backward pass; one through the host may not (see
    /// book: "Burn's autodiff and thread ranks": a rank blocked there can deadlock with another's cleanup).
    fn collectives_on_device(device: &Self::Device) -> bool {
        let _ = device;
        false
    }

    /// Receives over the device's own transport a tensor whose header (shape, dtype) came
    /// through the host; `None` where the backend has no such transport.
    fn recv_on_device<const D: usize>(
        group: &ProcessGroup,
        src: usize,
        shape: Vec<usize>,
        dtype: DType,
        device: &Self::Device,
    ) -> Option<DistResult<Tensor<Self, D>>> {
        let _ = (group, src, shape, dtype, device);
        None
    }

    /// Runs a batch of sends and receives ([`batch_isend_irecv`](crate::p2p::batch_isend_irecv))
    /// on the device's own transport as one grouped call, returning the received tensors in
    /// the order of the receives; or gives `ops` back for the host path.
    fn batch_p2p_on_device<const D: usize>(
        group: &ProcessGroup,
        ops: Vec<P2pOp<Self, D>>,
        device: &Self::Device,
    ) -> OnDevice<Vec<Tensor<Self, D>>, Vec<P2pOp<Self, D>>> {
        let _ = (group, device);
        OnDevice::Host(ops)
    }

    /// Starts reading `x` to the host after the work queued so far, so that the caller can
    /// queue work that does not need the values before it waits for them
    /// ([`HostRead::wait`]). By default the read happens at the wait; our CUDA backend copies
    /// on a side lane at once, and the wait does not wait for the compute queued after it.
    fn read_ahead<const D: usize>(x: Tensor<Self, D>) -> HostRead {
        HostRead::later(x)
    }
}

impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> DeviceTransport
    for NdArray<E, I, Q>
where
    NdArrayTensor: From<SharedArray<E>>,
    NdArrayTensor: From<SharedArray<I>>,
{
}

#[cfg(feature = "cuda")]
mod cube {
    use std::any::Any;

    use burn::tensor::TensorData;
    use burn::tensor::{DType, Tensor, TensorPrimitive};
    use burn_cubecl::tensor::CubeTensor;
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use burn_fusion::{Fusion, FusionBackend};
    use burn_megatron_kernels::cuda::read_ahead::read_ahead;
    use burn_megatron_kernels::cuda::{CudaGpu, MegatronCudaRuntime};

    use super::ProcessGroup;
    use super::{DeviceTransport, OnDevice};
    use crate::error::DistResult;
    use crate::host_read::HostRead;
    use crate::nccl::GpuP2p;
    use crate::op::CollectiveOp;
    use crate::op::P2pOp;

    /// `value` as type `U` when it is one (the runtime is ours), or back as it was.
    fn cast<T: 'static, U: 'static>(value: T) -> Result<U, T> {
        let boxed: Box<dyn Any> = Box::new(value);
        match boxed.downcast::<U>() {
            Ok(u) => Ok(*u),
            Err(boxed) => Err(*boxed.downcast::<T>().expect("the value's own type")),
        }
    }

    fn wrap<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement, const D: usize>(
        x: CubeTensor<R>,
    ) -> Tensor<CubeBackend<R, F, I, BT>, D> {
        Tensor::from_primitive(TensorPrimitive::Float(x))
    }

    /// A result of ours as a tensor of the backend `R` was found to be (our runtime).
    fn back<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement, const D: usize>(
        out: CubeTensor<MegatronCudaRuntime>,
    ) -> Tensor<CubeBackend<R, F, I, BT>, D> {
        wrap(cast(out).unwrap_or_else(|_| unreachable!("R is our runtime")))
    }

    /// Every CubeCL backend. On ours (`MegatronCudaRuntime`) collectives run over NCCL; on
    /// the others (burn-cuda's, wgpu) they go through the host.
    impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> DeviceTransport
        for CubeBackend<R, F, I, BT>
    {
        fn collective_on_device<const D: usize>(
            group: &ProcessGroup,
            op: CollectiveOp,
            x: Tensor<Self, D>,
        ) -> OnDevice<Tensor<Self, D>, Tensor<Self, D>> {
            let x: CubeTensor<R> = x.into_primitive().tensor();
            match cast::<_, CubeTensor<MegatronCudaRuntime>>(x) {
                Ok(ours) => {
                    let gpu = ours.device.clone();
                    OnDevice::Done(group.nccl_call::<D>(op, ours, &gpu).map(back))
                }
                Err(x) => OnDevice::Host(wrap(x)),
            }
        }

        fn collectives_on_device(device: &Self::Device) -> bool {
            cast::<_, CudaGpu>(device.clone()).is_ok()
        }

        fn recv_on_device<const D: usize>(
            group: &ProcessGroup,
            src: usize,
            shape: Vec<usize>,
            dtype: DType,
            device: &Self::Device,
        ) -> Option<DistResult<Tensor<Self, D>>> {
            let gpu = cast::<_, CudaGpu>(device.clone()).ok()?;
            Some(group.nccl_recv(src, shape, dtype, &gpu).map(back))
        }

        fn batch_p2p_on_device<const D: usize>(
            group: &ProcessGroup,
            ops: Vec<P2pOp<Self, D>>,
            device: &Self::Device,
        ) -> OnDevice<Vec<Tensor<Self, D>>, Vec<P2pOp<Self, D>>> {
            let Ok(gpu) = cast::<_, CudaGpu>(device.clone()) else {
                return OnDevice::Host(ops);
            };
            let ops = ops
                .into_iter()
                .map(|op| match op {
                    P2pOp::Send { tensor, peer } => {
                        let x: CubeTensor<R> = tensor.into_primitive().tensor();
                        let tensor = cast::<_, CubeTensor<MegatronCudaRuntime>>(x)
                            .unwrap_or_else(|_| unreachable!("the device is ours, so is R"));
                        GpuP2p::Send {
                            tensor: Box::new(tensor),
                            peer,
                        }
                    }
                    P2pOp::Recv { peer, shape, dtype } => GpuP2p::Recv {
                        peer,
                        shape: shape.to_vec(),
                        dtype,
                    },
                })
                .collect();
            OnDevice::Done(
                group
                    .nccl_batch(ops, &gpu)
                    .map(|received| received.into_iter().map(back).collect()),
            )
        }

        fn read_ahead<const D: usize>(x: Tensor<Self, D>) -> HostRead {
            let (shape, dtype) = (x.dims(), x.dtype());
            let primitive: CubeTensor<R> = x.clone().into_primitive().tensor();
            let started = cast::<_, CubeTensor<MegatronCudaRuntime>>(primitive)
                .ok()
                .and_then(|ours| read_ahead(&ours));
            match started {
                Some(read) => HostRead::new(move || {
                    read.wait()
                        .map(|bytes| TensorData::from_bytes_vec(bytes, shape, dtype))
                }),
                None => HostRead::later(x),
            }
        }
    }

    /// Fused backends move tensors through the host: NCCL takes unfused tensors.
    impl<B: FusionBackend> DeviceTransport for Fusion<B> {}
}

/// CubeCL backends without CUDA (Burn's wgpu): collectives go through the host.
#[cfg(all(feature = "wgpu", not(feature = "cuda")))]
impl<R, F, I, BT> DeviceTransport for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
}

/// On `Autodiff`, collectives on the device take the inner tensor; like the host path, the
/// result is a new leaf (differentiable communication goes through
/// [`mapping`](crate::mapping)).
impl<B: DeviceTransport, C: CheckpointStrategy> DeviceTransport for Autodiff<B, C> {
    fn collectives_on_device(device: &Self::Device) -> bool {
        B::collectives_on_device(device)
    }

    fn collective_on_device<const D: usize>(
        group: &ProcessGroup,
        op: CollectiveOp,
        x: Tensor<Self, D>,
    ) -> OnDevice<Tensor<Self, D>, Tensor<Self, D>> {
        match B::collective_on_device(group, op, x.clone().inner()) {
            OnDevice::Done(result) => OnDevice::Done(result.map(Tensor::from_inner)),
            OnDevice::Host(_) => OnDevice::Host(x),
        }
    }

    fn recv_on_device<const D: usize>(
        group: &ProcessGroup,
        src: usize,
        shape: Vec<usize>,
        dtype: DType,
        device: &Self::Device,
    ) -> Option<DistResult<Tensor<Self, D>>> {
        B::recv_on_device(group, src, shape, dtype, device).map(|r| r.map(Tensor::from_inner))
    }

    fn read_ahead<const D: usize>(x: Tensor<Self, D>) -> HostRead {
        B::read_ahead(x.inner())
    }

    fn batch_p2p_on_device<const D: usize>(
        group: &ProcessGroup,
        ops: Vec<P2pOp<Self, D>>,
        device: &Self::Device,
    ) -> OnDevice<Vec<Tensor<Self, D>>, Vec<P2pOp<Self, D>>> {
        let inner = ops
            .iter()
            .map(|op| match op {
                P2pOp::Send { tensor, peer } => P2pOp::Send {
                    tensor: tensor.clone().inner(),
                    peer: *peer,
                },
                P2pOp::Recv { peer, shape, dtype } => P2pOp::Recv {
                    peer: *peer,
                    shape: *shape,
                    dtype: *dtype,
                },
            })
            .collect();
        match B::batch_p2p_on_device(group, inner, device) {
            OnDevice::Done(result) => OnDevice::Done(
                result.map(|received| received.into_iter().map(Tensor::from_inner).collect()),
            ),
            OnDevice::Host(_) => OnDevice::Host(ops),
        }
    }
}
