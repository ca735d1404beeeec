//! Bulk transfers between the host and a device, for checkpoints: host buffers to read files
//! into, and their upload as tensors.
//!
//! The default is Burn's own path (a `Vec`, then `Tensor::from_data`). Our CUDA backend lends
//! page-locked buffers, which the copy engine reads at the link's speed, and uploads them
//! without CubeCL's extra copy of every tensor (`burn_megatron_kernels::cuda::host`): loading
//! a checkpoint's gigabytes is then bound by reading the files.

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{Bytes, DType, Tensor, TensorData};
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;

/// Host buffers and uploads of whole tensors.
pub trait HostTransferOps: Backend {
    /// A host buffer of `len` bytes to fill with a tensor's bytes and [`upload`](Self::upload)
    /// to `device`. Its content is unspecified: write every byte.
    fn host_buffer(device: &Self::Device, len: usize) -> Bytes {
        let _ = device;
        Bytes::from_bytes_vec(vec![0; len])
    }

    /// Prepares, in the background, host buffers of `sizes` bytes for reads from `device`
    /// to come (a save's): on our CUDA backend, page-locked ones, locked before the first save
    /// needs them. Nothing elsewhere.
    fn prepare_host_buffers(device: &Self::Device, sizes: Vec<usize>) {
        let _ = (device, sizes);
    }

    /// `data` on `device` as a tensor of `dtype` (converted on the host when `data` has
    /// another).
    fn upload<const D: usize>(
        data: TensorData,
        device: &Self::Device,
        dtype: DType,
    ) -> Tensor<Self, D> {
        Tensor::from_data(data.convert_dtype(dtype), (device, dtype))
    }
}

impl<B: HostTransferOps, C: CheckpointStrategy> HostTransferOps for Autodiff<B, C> {
    fn host_buffer(device: &Self::Device, len: usize) -> Bytes {
        B::host_buffer(device, len)
    }

    fn prepare_host_buffers(device: &Self::Device, sizes: Vec<usize>) {
        B::prepare_host_buffers(device, sizes)
    }

    fn upload<const D: usize>(
        data: TensorData,
        device: &Self::Device,
        dtype: DType,
    ) -> Tensor<Self, D> {
        Tensor::from_inner(B::upload(data, device, dtype))
    }
}

/// Our CUDA backend: page-locked buffers and a direct upload.
#[cfg(feature = "cuda")]
mod cuda {
    use burn::tensor::{Bytes, DType, Tensor, TensorData};
    use burn_cubecl::cubecl::cuda::CudaRuntime;
    use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
    use burn_megatron_kernels::cuda::{MegatronCudaRuntime, host};

    use super::HostTransferOps;
    use crate::ops::primitive::wrap;

    impl<F: FloatElement, I: IntElement, BT: BoolElement> HostTransferOps
        for CubeBackend<MegatronCudaRuntime, F, I, BT>
    {
        fn host_buffer(device: &Self::Device, len: usize) -> Bytes {
            host::pinned_buffer(device, len).unwrap_or_else(|| Bytes::from_bytes_vec(vec![0; len]))
        }

        fn prepare_host_buffers(device: &Self::Device, sizes: Vec<usize>) {
            host::prepare_pinned(device, sizes)
        }

        fn upload<const D: usize>(
            data: TensorData,
            device: &Self::Device,
            dtype: DType,
        ) -> Tensor<Self, D> {
            let data = data.convert_dtype(dtype);
            wrap(host::upload(device, data.bytes, data.shape, dtype))
        }
    }

    impl<F: FloatElement, I: IntElement, BT: BoolElement> HostTransferOps
        for CubeBackend<CudaRuntime, F, I, BT>
    {
    }
}

/// wgpu: Burn's path.
#[cfg(feature = "wgpu")]
impl<F, I, BT> HostTransferOps
    for burn_cubecl::CubeBackend<burn::backend::wgpu::WgpuRuntime, F, I, BT>
where
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
}
