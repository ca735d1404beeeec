//! CUDA events: points in a stream that other streams or the host can wait for.

use cudarc::driver::sys::{
    CUevent, CUevent_flags, CUstream, cuEventCreate, cuEventDestroy_v2, cuEventQuery,
    cuEventRecord, cuEventSynchronize, cuStreamWaitEvent,
};

use super::driver::{DriverFailure, check};

/// An event recorded on a stream. It is destroyed when dropped.
#[derive(Debug)]
pub struct Event {
    raw: CUevent,
}

// SAFETY: a CUevent is a driver handle usable from any thread; we destroy it exactly once.
unsafe impl Send for Event {}

// SAFETY: querying, waiting on and synchronising with an event are thread-safe driver calls.
unsafe impl Sync for Event {}

impl Event {
    /// Records an event after the work enqueued so far on `stream`.
    pub(crate) fn record(stream: CUstream) -> Result<Self, DriverFailure> {
        let mut raw = core::ptr::null_mut();
        // SAFETY: `raw` receives a new event; `stream` is a live stream of the current context.
        unsafe {
            check(
                cuEventCreate(&mut raw, CUevent_flags::CU_EVENT_DISABLE_TIMING as u32),
                "cuEventCreate",
            )?;
            let event = Self { raw };
            check(cuEventRecord(event.raw, stream), "cuEventRecord")?;
            Ok(event)
        }
    }

    /// Makes `stream` wait, on the GPU, for the work before this event.
    pub(crate) fn wait_on(&self, stream: CUstream) -> Result<(), DriverFailure> {
        // SAFETY: both handles are live.
        unsafe { check(cuStreamWaitEvent(stream, self.raw, 0), "cuStreamWaitEvent") }
    }

    /// Blocks the calling thread until the work before this event has completed.
    pub fn synchronize(&self) -> Result<(), DriverFailure> {
        // SAFETY: the event is live.
        unsafe { check(cuEventSynchronize(self.raw), "cuEventSynchronize") }
    }

    /// Whether the work before this event has completed (never blocks).
    pub fn is_complete(&self) -> bool {
        // SAFETY: the event is live.
        unsafe { cuEventQuery(self.raw) == cudarc::driver::sys::CUresult::CUDA_SUCCESS }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by cuEventCreate and destroyed only here; destroying an event whose
        // work is pending is allowed (the driver releases it once complete).
        unsafe {
            cuEventDestroy_v2(self.raw);
        }
    }
}
