//! A foreign operation as the server runs it: the lane it runs on ([`Lane`]), what it is given
//! ([`ForeignContext`]), its body ([`ForeignOp`]) and the queued task ([`ForeignTask`]).
//!
//! [`super::foreign`] submits these to the device's queue; the server runs them in queue order.

use cubecl_core::server::Binding;
use cudarc::driver::sys::CUstream;

use super::extensions::Extensions;

/// Where a foreign operation runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// On the compute stream, in order with the kernels.
    Compute,
    /// On side stream `n`, overlapping with compute.
    Side(u8),
}

/// What a foreign operation is given.
pub struct ForeignContext<'a> {
    /// The stream to enqueue the operation's work on.
    pub stream: CUstream,
    /// The compute stream (equal to `stream` on [`Lane::Compute`]).
    pub compute_stream: CUstream,
    /// Device pointers of the submitted tensors, in order (offsets applied).
    pub pointers: &'a [u64],
    /// Per-device state of foreign libraries (a cuBLASLt handle, NCCL communicators, …).
    pub extensions: &'a mut Extensions,
    /// Whether the compute stream is being captured into a CUDA graph (see
    /// [`super::graph`]): the operation's work is recorded into the graph, on the compute
    /// stream whatever its lane, and runs at each replay, not now.
    pub capturing: bool,
}

impl ForeignContext<'_> {
    /// An event after the work enqueued on this operation's stream so far: the host can
    /// wait for it or ask whether it has passed (an NCCL watchdog does). An error while
    /// capturing: nothing runs then, so there is nothing to wait for.
    pub fn record_event(&self) -> Result<super::Event, String> {
        if self.capturing {
            return Err("no event while a CUDA graph is captured".into());
        }
        super::Event::record(self.stream).map_err(|e| e.to_string())
    }
}

/// The body of a foreign operation. An error (or a panic) is reported by the device's next
/// read, sync or flush, naming the operation.
pub type ForeignOp = Box<dyn FnOnce(&mut ForeignContext<'_>) -> Result<(), String> + Send>;

/// A submitted foreign operation, as the device queue carries it to the server.
pub(crate) struct ForeignTask {
    pub name: &'static str,
    pub bindings: Vec<Binding>,
    pub lane: Lane,
    pub ticket: u64,
    pub op: ForeignOp,
}
