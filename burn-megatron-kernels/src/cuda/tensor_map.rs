//! TMA tensor maps (Hopper): the descriptors CubeCL's TMA kernels take as arguments.

use cubecl_common::backtrace::BackTrace;
use cubecl_core::ir::{ElemType, FloatKind, IntKind, StorageType, UIntKind};
use cubecl_core::prelude::{
    OobFill, TensorMapFormat, TensorMapInterleave, TensorMapPrefetch, TensorMapSwizzle, TiledArgs,
};
use cubecl_core::server::{LaunchError, TensorMapMeta};
use cudarc::driver::sys::{
    CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle, cuTensorMapEncodeIm2col, cuTensorMapEncodeTiled,
};

fn unsupported(what: String) -> LaunchError {
    LaunchError::Unknown {
        reason: what,
        backtrace: BackTrace::capture(),
    }
}

/// Encodes `map` over the device memory at `ptr`.
pub fn encode(map: &TensorMapMeta, ptr: u64) -> Result<CUtensorMap, LaunchError> {
    // CUDA lists dimensions innermost first; CubeCL outermost first.
    let shape: Vec<u64> = map
        .metadata
        .shape()
        .iter()
        .rev()
        .map(|&s| s as u64)
        .collect();
    let strides: Vec<u64> = map
        .metadata
        .strides()
        .iter()
        .rev()
        .skip(1)
        .map(|&s| s as u64 * map.storage_ty.size() as u64)
        .collect();
    let elem_strides: Vec<u32> = map.elem_stride.iter().rev().map(|&s| s as u32).collect();
    let rank = map.metadata.rank() as u32;
    let data_type = data_type(map.storage_ty)?;
    let mut encoded = core::mem::MaybeUninit::<CUtensorMap>::zeroed();
    let address = ptr as *mut core::ffi::c_void;
    // SAFETY: every array holds `rank` (strides `rank - 1`) entries and outlives the call;
    // `encoded` is written by the driver on success.
    let result = unsafe {
        match &map.format {
            TensorMapFormat::Tiled(TiledArgs { tile_size }) => {
                let tile: Vec<u32> = tile_size.iter().rev().map(|&s| s as u32).collect();
                cuTensorMapEncodeTiled(
                    encoded.as_mut_ptr(),
                    data_type,
                    rank,
                    address,
                    shape.as_ptr(),
                    strides.as_ptr(),
                    tile.as_ptr(),
                    elem_strides.as_ptr(),
                    interleave(map.interleave),
                    swizzle(map.swizzle)?,
                    prefetch(map.prefetch),
                    oob(map.oob_fill),
                )
            }
            TensorMapFormat::Im2col(args) => {
                let lower: Vec<i32> = args.pixel_box_lower_corner.iter().rev().copied().collect();
                let upper: Vec<i32> = args.pixel_box_upper_corner.iter().rev().copied().collect();
                cuTensorMapEncodeIm2col(
                    encoded.as_mut_ptr(),
                    data_type,
                    rank,
                    address,
                    shape.as_ptr(),
                    strides.as_ptr(),
                    lower.as_ptr(),
                    upper.as_ptr(),
                    args.channels_per_pixel,
                    args.pixels_per_column,
                    elem_strides.as_ptr(),
                    interleave(map.interleave),
                    swizzle(map.swizzle)?,
                    prefetch(map.prefetch),
                    oob(map.oob_fill),
                )
            }
            other => {
                return Err(unsupported(format!(
                    "tensor map format {other:?} is not supported"
                )));
            }
        }
    };
    match result {
        cudarc::driver::sys::CUresult::CUDA_SUCCESS => Ok(unsafe { encoded.assume_init() }),
        code => Err(unsupported(format!(
            "cuTensorMapEncode failed ({code:?}) for shape {shape:?}, strides {strides:?}, \
             element strides {elem_strides:?}, {:?} at {ptr:#x}",
            map.format
        ))),
    }
}

fn data_type(ty: StorageType) -> Result<CUtensorMapDataType, LaunchError> {
    use CUtensorMapDataType::*;
    Ok(match ty {
        StorageType::Scalar(ElemType::Float(kind)) => match kind {
            FloatKind::F16 => CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            FloatKind::BF16 => CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            FloatKind::F32 | FloatKind::Flex32 => CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
            FloatKind::TF32 => CU_TENSOR_MAP_DATA_TYPE_TFLOAT32,
            FloatKind::F64 => CU_TENSOR_MAP_DATA_TYPE_FLOAT64,
            // 8-bit floats move as bytes: zero bits are zero in both.
            _ => CU_TENSOR_MAP_DATA_TYPE_UINT8,
        },
        StorageType::Scalar(ElemType::Int(kind)) => match kind {
            IntKind::I8 => CU_TENSOR_MAP_DATA_TYPE_UINT8,
            IntKind::I16 => CU_TENSOR_MAP_DATA_TYPE_UINT16,
            IntKind::I32 => CU_TENSOR_MAP_DATA_TYPE_INT32,
            IntKind::I64 => CU_TENSOR_MAP_DATA_TYPE_INT64,
        },
        StorageType::Scalar(ElemType::UInt(kind)) => match kind {
            UIntKind::U8 => CU_TENSOR_MAP_DATA_TYPE_UINT8,
            UIntKind::U16 => CU_TENSOR_MAP_DATA_TYPE_UINT16,
            UIntKind::U32 => CU_TENSOR_MAP_DATA_TYPE_UINT32,
            UIntKind::U64 => CU_TENSOR_MAP_DATA_TYPE_UINT64,
        },
        other => return Err(unsupported(format!("no tensor map type for {other:?}"))),
    })
}

fn interleave(value: TensorMapInterleave) -> CUtensorMapInterleave {
    match value {
        TensorMapInterleave::None => CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
        TensorMapInterleave::B16 => CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_16B,
        TensorMapInterleave::B32 => CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_32B,
    }
}

fn swizzle(value: TensorMapSwizzle) -> Result<CUtensorMapSwizzle, LaunchError> {
    use CUtensorMapSwizzle::*;
    Ok(match value {
        TensorMapSwizzle::None => CU_TENSOR_MAP_SWIZZLE_NONE,
        TensorMapSwizzle::B32 => CU_TENSOR_MAP_SWIZZLE_32B,
        TensorMapSwizzle::B64 => CU_TENSOR_MAP_SWIZZLE_64B,
        TensorMapSwizzle::B128 => CU_TENSOR_MAP_SWIZZLE_128B,
        other => return Err(unsupported(format!("swizzle {other:?} is not supported"))),
    })
}

fn prefetch(value: TensorMapPrefetch) -> CUtensorMapL2promotion {
    use CUtensorMapL2promotion::*;
    match value {
        TensorMapPrefetch::None => CU_TENSOR_MAP_L2_PROMOTION_NONE,
        TensorMapPrefetch::B64 => CU_TENSOR_MAP_L2_PROMOTION_L2_64B,
        TensorMapPrefetch::B128 => CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        TensorMapPrefetch::B256 => CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
    }
}

fn oob(value: OobFill) -> CUtensorMapFloatOOBfill {
    match value {
        OobFill::Zero => CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        OobFill::NaN => CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA,
    }
}
