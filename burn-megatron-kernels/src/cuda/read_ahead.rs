//! A read of a device tensor to the host that starts now and is waited for later, on a side
//! lane: the host waits for the tensor, not for the compute work queued after it.
//!
//! Why: the MoE dispatcher reads the all-gathered token counts to the host in every layer
//! (they size the exchange). A read through Burn copies on the compute stream and waits for
//! it to drain, so the GPU idles from the end of that copy until the host has planned the
//! exchange and launched again. Read ahead, the copy runs on a side lane as soon as the
//! tensor is ready; the host queues independent work (the shared expert) before it waits, and
//! the GPU runs that work while the host plans.
//!
//! The copy lands in a page-locked buffer from the device's pool (see `pinned`), so that the
//! device thread only enqueues it; the host then waits on an event recorded after it.

use std::sync::mpsc;

use burn_cubecl::tensor::CubeTensor;
use cudarc::driver::sys::cuMemcpyDtoHAsync_v2;

use super::driver::check;
use super::event::Event;
use super::foreign::{ForeignQueue, Lane, binding};
use super::host::pool;
use super::host_syncs;
use super::pinned::{PINNED_MIN_BYTES, PinnedBytes};
use super::runtime::MegatronCudaRuntime;

/// The side lane reads ahead run on (the NCCL groups take lanes from 1 on).
const READ_LANE: Lane = Lane::Side(0);

/// A read started by [`read_ahead`]; [`wait`](Self::wait) for its bytes. Dropped unwaited, it
/// waits for the copy before its buffer goes back to the pool.
pub struct ReadAhead {
    len: usize,
    buffer: Option<PinnedBytes>,
    done: mpsc::Receiver<Event>,
    queue: ForeignQueue,
}

impl core::fmt::Debug for ReadAhead {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "ReadAhead({} bytes)", self.len)
    }
}

/// Starts copying `tensor` to the host after the work submitted so far, on a side lane;
/// `None` where it cannot (a tensor that is not contiguous, or no page-locked buffer to be
/// had): read it the usual way then.
pub fn read_ahead(tensor: &CubeTensor<MegatronCudaRuntime>) -> Option<ReadAhead> {
    if !tensor.is_contiguous() {
        return None;
    }
    let len = tensor.meta.shape().num_elements() * tensor.dtype.size();
    let mut buffer = pool(&tensor.device).take(len.max(PINNED_MIN_BYTES))?;
    let host = buffer.as_mut_ptr() as usize;
    let (sender, done) = mpsc::channel();
    let queue = ForeignQueue::new(&tensor.device);
    queue.submit("read ahead", vec![binding(tensor)], READ_LANE, move |ctx| {
        if ctx.capturing {
            return Err("a read to the host while a CUDA graph is captured".into());
        }
        // SAFETY: the tensor's memory holds `len` bytes (contiguous) and the page-locked
        // buffer at least as many; the buffer lives until the event below has passed (the
        // `ReadAhead` waits for it, even when dropped unwaited).
        unsafe {
            check(
                cuMemcpyDtoHAsync_v2(host as *mut _, ctx.pointers[0], len, ctx.stream),
                "cuMemcpyDtoHAsync",
            )
            .map_err(|e| e.to_string())?;
        }
        // The receiver may be gone only if the `ReadAhead` was leaked.
        let _ = sender.send(ctx.record_event()?);
        Ok(())
    });
    queue.flush();
    Some(ReadAhead {
        len,
        buffer: Some(buffer),
        done,
        queue,
    })
}

impl ReadAhead {
    /// The tensor's bytes, once the copy is done. An error if the device did not run the
    /// copy (an earlier failure, which the device's next read or sync reports too).
    pub fn wait(mut self) -> Result<Vec<u8>, String> {
        host_syncs::record();
        self.finish()?;
        let buffer = self.buffer.take().expect("waited once");
        // SAFETY: the copy of `len` bytes into the buffer has completed (`finish`).
        let bytes = unsafe { buffer.into_bytes(self.len) };
        Ok(bytes.to_vec())
    }

    /// Waits for the copy: for the device thread to enqueue it, then for its event.
    fn finish(&mut self) -> Result<(), String> {
        self.queue.flush();
        let event = self.done.recv().map_err(|_| {
            "the device did not run a read ahead (an earlier operation failed)".to_string()
        })?;
        event.synchronize().map_err(|e| e.to_string())
    }
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        if self.buffer.is_some() {
            // The copy may still be writing into the buffer: wait before it is lent again.
            let _ = self.finish();
        }
    }
}
