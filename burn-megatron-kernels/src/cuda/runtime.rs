//! The CubeCL runtime: ties the device, the server and the CUDA C++ compiler together.

use cubecl_common::device::DeviceId;
use cubecl_core::Runtime;
use cubecl_core::ir::{ContiguousElements, MatrixLayout, MmaProperties, TargetProperties};
use cubecl_core::zspace::striding::has_pitched_row_major_strides;
use cubecl_core::zspace::{Shape, Strides};
use cubecl_cpp::cuda::mma::contiguous_elements_cuda;
use cubecl_runtime::client::ComputeClient;

use super::CudaCompiler;
use super::device::CudaGpu;
use super::server::CudaServer;

/// burn-megatron's CubeCL runtime for CUDA: cubecl-cuda's kernels and compiler, with streams
/// we own (see [`super::foreign`]).
#[derive(Debug, Clone)]
pub struct MegatronCudaRuntime;

impl Runtime for MegatronCudaRuntime {
    type Compiler = CudaCompiler;
    type Server = CudaServer;
    type Device = CudaGpu;

    fn client(device: &CudaGpu) -> ComputeClient<Self> {
        ComputeClient::load(device)
    }

    fn name(_: &ComputeClient<Self>) -> &'static str {
        "megatron-cuda"
    }

    fn require_array_lengths() -> bool {
        true
    }

    fn max_cube_count() -> (u32, u32, u32) {
        (i32::MAX as u32, u16::MAX as u32, u16::MAX as u32)
    }

    fn can_read_tensor(shape: &Shape, strides: &Strides) -> bool {
        has_pitched_row_major_strides(shape, strides)
    }

    fn target_properties() -> TargetProperties {
        // How CUDA's MMA instructions lay matrices out in registers.
        TargetProperties {
            mma: MmaProperties {
                register_size_bits: 32,
                const_plane_size: 32,
                register_layout_a: MatrixLayout::RowMajor,
                register_layout_b: MatrixLayout::ColMajor,
                register_layout_acc: MatrixLayout::RowMajor,
                register_duplication_a: 1,
                register_duplication_b: 1,
                register_duplication_acc: 1,
                contiguous_elements: ContiguousElements::new(contiguous_elements_cuda),
            },
        }
    }

    fn enumerate_devices(type_id: u16, _: &()) -> Vec<DeviceId> {
        let count = cudarc::driver::CudaContext::device_count()
            .unwrap_or(0)
            .max(0) as u16;
        (0..count)
            .map(|index_id| DeviceId { type_id, index_id })
            .collect()
    }
}
