//! What the GPU can do, told to CubeCL the way Burn's kernels (matmul, autotune) expect it, so
//! they choose the same paths as on burn-cuda.

use cubecl_common::profile::TimingMethod;
use cubecl_core::ir::features::{AtomicUsage, Plane, Tma, TypeUsage};
use cubecl_core::ir::{
    BarrierLevel, DeviceProperties, ElemType, FloatKind, HardwareProperties,
    MemoryDeviceProperties, OpaqueType, SemanticType, StorageType, Type, VectorSize,
};
use cubecl_cpp::DialectWmmaCompiler;
use cubecl_cpp::cuda::arch::CudaArchitecture;
use cubecl_cpp::cuda::mma::CudaWmmaCompiler;
use cubecl_cpp::shared::{
    CompilationOptions, CppSupportedFeatures, register_mma_features, register_scaled_mma_features,
    register_supported_types, register_wmma_features,
};
use cudarc::driver::sys::{
    CUdevice, CUdevice_attribute, cuDeviceGetAttribute, cuDeviceTotalMem_v2,
};

use super::driver::{DriverFailure, check};

/// Row alignment of pitched allocations: what `cuMemAllocPitch` uses.
pub const MEMORY_ALIGNMENT: usize = 512;

/// Most buffers a kernel may bind.
const MAX_BINDINGS: u32 = 1024;

/// A probed GPU: its compute capability (e.g. 90 for Hopper), what CubeCL is told about it,
/// and how kernels for it are compiled.
pub struct Probe {
    pub arch: u32,
    pub properties: DeviceProperties,
    pub compilation: CompilationOptions,
}

fn attribute(device: CUdevice, attribute: CUdevice_attribute) -> Result<i32, DriverFailure> {
    let mut value = 0;
    // SAFETY: a read-only query of a valid device.
    unsafe {
        check(
            cuDeviceGetAttribute(&mut value, attribute, device),
            "cuDeviceGetAttribute",
        )?
    };
    Ok(value)
}

/// Probes `device`.
pub fn probe(device: CUdevice) -> Result<Probe, DriverFailure> {
    use CUdevice_attribute::*;
    let major = attribute(device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? as u32;
    let arch = major * 10 + attribute(device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? as u32;
    let warp = attribute(device, CU_DEVICE_ATTRIBUTE_WARP_SIZE)? as u32;
    let mut total_memory = 0;
    // SAFETY: writes the device's memory size.
    unsafe {
        check(
            cuDeviceTotalMem_v2(&mut total_memory, device),
            "cuDeviceTotalMem",
        )?
    };

    let cuda_arch = CudaArchitecture { version: arch };
    let wmma = CudaWmmaCompiler::supported_wmma_combinations(&cuda_arch);
    let mma = CudaWmmaCompiler::supported_mma_combinations(&cuda_arch);
    let scaled_mma = CudaWmmaCompiler::supported_scaled_mma_combinations(&cuda_arch);

    let dims = |x, y, z| -> Result<(u32, u32, u32), DriverFailure> {
        Ok((
            attribute(device, x)? as u32,
            attribute(device, y)? as u32,
            attribute(device, z)? as u32,
        ))
    };
    let hardware = HardwareProperties {
        load_width: 128,
        plane_size_min: warp,
        plane_size_max: warp,
        max_bindings: MAX_BINDINGS,
        max_shared_memory_size: attribute(
            device,
            CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )? as usize,
        max_cube_count: dims(
            CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X,
            CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y,
            CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z,
        )?,
        max_units_per_cube: attribute(device, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)? as u32,
        max_cube_dim: dims(
            CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X,
            CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y,
            CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z,
        )?,
        num_streaming_multiprocessors: Some(attribute(
            device,
            CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as u32),
        num_tensor_cores: match arch {
            70 | 75 => Some(8),
            80 | 86 | 89 | 90 | 91 | 92 | 100 => Some(4),
            _ => None,
        },
        min_tensor_cores_dim: (!wmma.is_empty()).then_some(8),
        num_cpu_cores: None,
        max_vector_size: VectorSize::MAX,
    };
    let memory = MemoryDeviceProperties {
        max_page_size: total_memory as u64 / 4,
        alignment: MEMORY_ALIGNMENT as u64,
    };
    let mut props =
        DeviceProperties::new(Default::default(), memory, hardware, TimingMethod::System);
    let mut compilation = CompilationOptions {
        warp_size: warp,
        supports_features: CppSupportedFeatures {
            fast_math: true,
            ..Default::default()
        },
    };
    register_features(arch, &mut props, &mut compilation);
    register_wmma_features(wmma, &mut props);
    register_mma_features(mma, &mut props);
    register_scaled_mma_features(scaled_mma, &mut props);
    Ok(Probe {
        arch,
        properties: props,
        compilation,
    })
}

fn atomic(kind: FloatKind, vector: usize) -> Type {
    let ty = Type::new(StorageType::Atomic(ElemType::Float(kind)));
    if vector > 1 {
        ty.with_vector_size(vector)
    } else {
        ty
    }
}

/// The features of compute capability `arch` (e.g. 90), from the oldest up.
fn register_features(
    arch: u32,
    props: &mut DeviceProperties,
    compilation: &mut CompilationOptions,
) {
    let float = |kind| ElemType::Float(kind);
    register_supported_types(props);
    props.register_type_usage(float(FloatKind::TF32), TypeUsage::Conversion);
    props.features.memory_reinterpret = true;
    props.features.alignment = true;
    props.features.plane.insert(Plane::Ops);
    props.features.plane.insert(Plane::NonUniformControlFlow);
    let add_store = AtomicUsage::Add | AtomicUsage::LoadStore;
    if arch >= 60 {
        props.register_atomic_type_usage(atomic(FloatKind::F64, 1), add_store);
    }
    if arch >= 70 {
        props.register_atomic_type_usage(atomic(FloatKind::F16, 1), add_store);
        props.register_atomic_type_usage(atomic(FloatKind::F16, 2), add_store);
        props.register_semantic_type(SemanticType::Pipeline);
        props.register_type_usage(OpaqueType::Barrier(BarrierLevel::Unit), TypeUsage::Buffer);
        props.register_type_usage(OpaqueType::Barrier(BarrierLevel::Cube), TypeUsage::Buffer);
        props.features.plane.insert(Plane::Sync);
        compilation.supports_features.grid_constants = true;
    }
    if arch >= 75 {
        for kind in [FloatKind::F16, FloatKind::BF16] {
            props.features.matmul.ldmatrix.insert(float(kind).into());
        }
        compilation.supports_features.fast_tanh = cudarc::driver::sys::CUDA_VERSION >= 12080;
    }
    if arch >= 80 {
        props.features.copy_async = true;
    }
    if arch >= 89 {
        for kind in [FloatKind::E4M3, FloatKind::E5M2] {
            props.register_type_usage(float(kind), TypeUsage::Conversion | TypeUsage::Buffer);
        }
    }
    if arch >= 90 {
        props.features.tma.insert(Tma::Base);
        props.register_semantic_type(SemanticType::TensorMap);
        props.features.cube_cluster = true;
        compilation.supports_features.clusters = true;
        compilation.supports_features.elect_sync = true;
        for kind in [FloatKind::F16, FloatKind::BF16] {
            props.features.matmul.stmatrix.insert(float(kind).into());
        }
        props.register_atomic_type_usage(atomic(FloatKind::F32, 2), add_store);
        props.register_atomic_type_usage(atomic(FloatKind::F32, 4), add_store);
    }
    // Blackwell's im2col-wide tensor maps and FP4/FP6 types are not supported yet: kernels
    // that need them are not offered.
}
