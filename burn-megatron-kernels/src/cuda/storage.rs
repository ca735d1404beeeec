//! Device memory for CubeCL's memory pools, allocated in stream order on the compute stream.

use std::collections::HashMap;

use cubecl_common::backtrace::BackTrace;
use cubecl_core::server::IoError;
use cubecl_runtime::storage::{ComputeStorage, StorageHandle, StorageId, StorageUtilization};
use cudarc::driver::sys::{CUdeviceptr, CUresult, CUstream, cuMemAllocAsync, cuMemFreeAsync};

/// A slice of device memory: what a binding resolves to.
#[derive(Debug, Clone, Copy)]
pub struct GpuResource {
    /// Device address of the first byte (offsets applied).
    pub ptr: u64,
    /// Length in bytes.
    pub size: u64,
}

/// The pools' backing store: `cuMemAllocAsync` pages on the compute stream, freed with
/// `cuMemFreeAsync` in stream order at the next flush.
pub struct GpuStorage {
    stream: CUstream,
    alignment: usize,
    pages: HashMap<StorageId, CUdeviceptr>,
    to_free: Vec<StorageId>,
}

// SAFETY: the storage is owned by the server, which is only used from its device thread.
unsafe impl Send for GpuStorage {}

impl core::fmt::Debug for GpuStorage {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "GpuStorage({} pages)", self.pages.len())
    }
}

impl GpuStorage {
    /// Storage whose allocations are ordered on `stream`.
    pub fn new(stream: CUstream, alignment: usize) -> Self {
        Self {
            stream,
            alignment,
            pages: HashMap::new(),
            to_free: Vec::new(),
        }
    }
}

impl ComputeStorage for GpuStorage {
    type Resource = GpuResource;

    fn alignment(&self) -> usize {
        self.alignment
    }

    fn get(&mut self, handle: &StorageHandle) -> GpuResource {
        let base = self.pages[&handle.id];
        GpuResource {
            ptr: base + handle.offset(),
            size: handle.size(),
        }
    }

    fn alloc(&mut self, size: u64) -> Result<StorageHandle, IoError> {
        let mut ptr = 0;
        // SAFETY: allocation of `size` bytes ordered on our live stream.
        let result = unsafe { cuMemAllocAsync(&mut ptr, size as usize, self.stream) };
        match result {
            CUresult::CUDA_SUCCESS => {}
            CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                return Err(IoError::BufferTooBig {
                    size,
                    backtrace: BackTrace::capture(),
                });
            }
            other => {
                return Err(IoError::Unknown {
                    description: format!("cuMemAllocAsync of {size} bytes failed: {other:?}"),
                    backtrace: BackTrace::capture(),
                });
            }
        }
        let id = StorageId::new();
        self.pages.insert(id, ptr);
        Ok(StorageHandle::new(
            id,
            StorageUtilization { offset: 0, size },
        ))
    }

    fn dealloc(&mut self, id: StorageId) {
        self.to_free.push(id);
    }

    fn flush(&mut self) {
        for id in self.to_free.drain(..) {
            if let Some(ptr) = self.pages.remove(&id) {
                // SAFETY: allocated by cuMemAllocAsync and freed once, after the work already
                // enqueued on the stream (which is what stream-ordered freeing guarantees).
                unsafe {
                    cuMemFreeAsync(ptr, self.stream);
                }
            }
        }
    }
}
