//! Host buffers and uploads for bulk transfers (checkpoints): page-locked buffers from the
//! device's pool (see `pinned`), and host bytes copied into a new tensor in stream order.
//!
//! Why not `Tensor::from_data`: CubeCL's client copies the bytes into a fresh `Vec` before
//! handing them to the server, and the server's copy then goes through the driver's staging
//! buffer; for a checkpoint's gigabytes both copies cost more than the transfer itself. Here
//! the bytes go to the device once, directly from page-locked memory when they are in it.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock, PoisonError};

use burn::tensor::{DType, Shape};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl_common::bytes::{AllocationProperty, Bytes};
use cudarc::driver::sys::cuMemcpyHtoDAsync_v2;

use super::device::CudaGpu;
use super::driver::check;
use super::foreign::{ForeignQueue, Lane, binding};
use super::pinned::PinnedPool;
use super::runtime::MegatronCudaRuntime;

/// A host buffer of `len` bytes from `device`'s page-locked pool, to fill and then
/// [`upload`]; `None` when the pool cannot lend one (small, or over its limit). Any thread
/// may call it. Its bytes are whatever the buffer held: write them all.
pub fn pinned_buffer(device: &CudaGpu, len: usize) -> Option<Bytes> {
    let buffer = pool(device).take(len)?;
    // SAFETY: the buffer is mapped host memory of at least `len` bytes (its bytes are defined,
    // if stale); the caller overwrites them.
    Some(unsafe { buffer.into_bytes(len) })
}

/// Locks buffers of `sizes` bytes in `device`'s pool on a background thread, so that the
/// reads of a first save find them instead of locking pages while the step waits.
pub fn prepare_pinned(device: &CudaGpu, sizes: Vec<usize>) {
    let pool = pool(device);
    let spawned = std::thread::Builder::new()
        .name("pinned-buffers".into())
        .spawn(move || pool.prepare(&sizes));
    // Without the thread, the first save locks its pages itself, as it would anyway.
    drop(spawned);
}

/// `device`'s pool, asked of its server once.
pub(super) fn pool(device: &CudaGpu) -> PinnedPool {
    static POOLS: OnceLock<Mutex<HashMap<usize, PinnedPool>>> = OnceLock::new();
    let mut pools =
        (POOLS.get_or_init(Default::default).lock()).unwrap_or_else(PoisonError::into_inner);
    pools
        .entry(device.index)
        .or_insert_with(|| ForeignQueue::new(device).pinned_pool())
        .clone()
}

/// A new contiguous tensor on `device` of `shape` and `dtype` holding `bytes` (row-major),
/// copied in stream order after the work submitted so far. From page-locked bytes (see
/// [`pinned_buffer`]) the copy engine reads them directly; the device's thread waits for the
/// copy before it lets them go. Other bytes are staged by the driver before the copy is
/// enqueued.
///
/// # Panics
/// If `bytes` does not hold exactly the tensor.
pub fn upload(
    device: &CudaGpu,
    bytes: Bytes,
    shape: Shape,
    dtype: DType,
) -> CubeTensor<MegatronCudaRuntime> {
    let len = shape.num_elements() * dtype.size();
    assert_eq!(
        bytes.len(),
        len,
        "the bytes of a {shape:?} {dtype:?} tensor"
    );
    let client = <MegatronCudaRuntime as cubecl::Runtime>::client(device);
    let tensor = empty_device_contiguous_dtype(client, device.clone(), shape, dtype);
    if len == 0 {
        return tensor;
    }
    let pinned = bytes.property() == AllocationProperty::Pinned;
    ForeignQueue::new(device).submit(
        "upload to the device",
        vec![binding(&tensor)],
        Lane::Compute,
        move |ctx| {
            // SAFETY: the tensor's memory holds `len` bytes; `bytes` lives until the copy is
            // done (staged before the call returns, or waited for below).
            unsafe {
                check(
                    cuMemcpyHtoDAsync_v2(ctx.pointers[0], bytes.as_ptr().cast(), len, ctx.stream),
                    "cuMemcpyHtoDAsync",
                )
                .map_err(|e| e.to_string())?;
            }
            if pinned {
                ctx.record_event()?
                    .synchronize()
                    .map_err(|e| e.to_string())?;
            }
            drop(bytes);
            Ok(())
        },
    );
    tensor
}
