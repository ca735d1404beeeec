//! Copies between host memory and (possibly pitched) device memory.

use cubecl_common::backtrace::BackTrace;
use cubecl_core::server::IoError;
use cubecl_core::zspace::striding::has_pitched_row_major_strides;
use cubecl_core::zspace::{Shape, Strides};
use cudarc::driver::sys::{
    CUDA_MEMCPY2D_st, CUmemorytype, CUstream, cuMemcpy2DAsync_v2, cuMemcpyDtoHAsync_v2,
    cuMemcpyHtoDAsync_v2,
};

use super::driver::check;

/// Which way a copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Device to host.
    ToHost,
    /// Host to device.
    ToDevice,
}

/// Enqueues a copy on `stream` between `host` and the device tensor at `device` with `shape`
/// and `strides` (row-major, rows possibly pitched). Rank 0-1 tensors are one linear copy, the
/// others one 2D copy of `rows × row bytes` with the device's row pitch.
///
/// # Safety
/// `device` must address the whole tensor and `host` hold `shape.product() · elem_size`
/// bytes, valid until the copy is done (for pageable memory the driver stages it before
/// returning).
pub unsafe fn copy(
    direction: Direction,
    host: *mut u8,
    device: u64,
    shape: &Shape,
    strides: &Strides,
    elem_size: usize,
    stream: CUstream,
) -> Result<(), IoError> {
    if !has_pitched_row_major_strides(shape, strides) {
        return Err(IoError::UnsupportedStrides {
            backtrace: BackTrace::capture(),
        });
    }
    let rank = shape.len();
    let bytes = shape.iter().product::<usize>() * elem_size;
    // SAFETY: per this function's contract.
    let result = unsafe {
        if rank <= 1 {
            match direction {
                Direction::ToHost => check(
                    cuMemcpyDtoHAsync_v2(host.cast(), device, bytes, stream),
                    "cuMemcpyDtoHAsync",
                ),
                Direction::ToDevice => check(
                    cuMemcpyHtoDAsync_v2(device, host.cast(), bytes, stream),
                    "cuMemcpyHtoDAsync",
                ),
            }
        } else {
            let row = shape[rank - 1] * elem_size;
            let pitch = strides[rank - 2] * elem_size;
            let (host_type, device_type) = (
                CUmemorytype::CU_MEMORYTYPE_HOST,
                CUmemorytype::CU_MEMORYTYPE_DEVICE,
            );
            let to_host = direction == Direction::ToHost;
            // Every field set: the struct holds enums, so it has no valid all-zero value.
            let desc = CUDA_MEMCPY2D_st {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: if to_host { device_type } else { host_type },
                srcHost: if to_host {
                    core::ptr::null()
                } else {
                    host as *const _
                },
                srcDevice: if to_host { device } else { 0 },
                srcArray: core::ptr::null_mut(),
                srcPitch: if to_host { pitch } else { row },
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: if to_host { host_type } else { device_type },
                dstHost: if to_host {
                    host.cast()
                } else {
                    core::ptr::null_mut()
                },
                dstDevice: if to_host { 0 } else { device },
                dstArray: core::ptr::null_mut(),
                dstPitch: if to_host { row } else { pitch },
                WidthInBytes: row,
                Height: shape[..rank - 1].iter().product(),
            };
            check(cuMemcpy2DAsync_v2(&desc, stream), "cuMemcpy2DAsync")
        }
    };
    result.map_err(IoError::from)
}
