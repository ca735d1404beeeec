//! What the server keeps while it captures the compute stream into a CUDA graph (see
//! [`super::graph`]), and what a captured graph holds on to.
//!
//! A graph replays the captured launches with the addresses they had: every buffer allocated
//! while capturing stays allocated for the graph's life (its memory descriptor is kept, so the
//! pool never hands it to another tensor), and the host bytes of every copy to the device (the
//! kernels' metadata) are kept in page-locked memory, which the copy node reads at each replay.

use cubecl_runtime::memory_management::ManagedMemoryBinding;
use cudarc::driver::sys::{CUresult, cuMemFreeHost, cuMemHostAlloc};

use super::driver::{DriverFailure, check};

/// Page-locked host bytes that a captured copy reads at each replay.
pub(crate) struct HostBytes {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the bytes are owned, written once before the capture ends, and only read by the
// device afterwards.
unsafe impl Send for HostBytes {}

impl HostBytes {
    /// A page-locked copy of `bytes`.
    pub(crate) fn copy_of(bytes: &[u8]) -> Result<Self, DriverFailure> {
        let mut ptr = core::ptr::null_mut();
        // SAFETY: allocates `len` bytes (at least 1) of page-locked host memory.
        unsafe {
            check(
                cuMemHostAlloc(&mut ptr, bytes.len().max(1), 0),
                "cuMemHostAlloc",
            )?
        };
        let ptr = ptr.cast::<u8>();
        // SAFETY: `ptr` holds at least `bytes.len()` bytes and does not overlap `bytes`.
        unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, bytes.len()) };
        Ok(Self {
            ptr,
            len: bytes.len(),
        })
    }

    pub(crate) fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for HostBytes {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc and freed once; the graph that read it is gone.
        let result = unsafe { cuMemFreeHost(self.ptr.cast()) };
        debug_assert_eq!(result, CUresult::CUDA_SUCCESS);
    }
}

/// What a capture gathers, and what its graph then keeps alive.
#[derive(Default)]
pub(crate) struct Capture {
    /// The memory of every buffer allocated while capturing.
    pub(crate) memory: Vec<ManagedMemoryBinding>,
    /// The host side of every copy to the device.
    pub(crate) host: Vec<HostBytes>,
    /// What failed while capturing (a launch, or an operation a graph cannot hold), reported
    /// when the capture ends.
    pub(crate) errors: Vec<String>,
}
