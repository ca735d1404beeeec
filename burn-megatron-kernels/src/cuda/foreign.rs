//! In-band foreign operations: host code that enqueues GPU work of its own (an NCCL
//! collective, a cuBLASLt GEMM, a memcpy) in program order with Burn's kernels, with no host
//! synchronisation.
//!
//! An operation is submitted to the device's queue, the same first-in-first-out queue Burn's
//! kernels go through, so it runs after every kernel submitted before it. It gets the device
//! pointers of the tensors it names and a stream to enqueue on:
//! - [`Lane::Compute`]: the compute stream itself. Nothing more is needed: later kernels are
//!   ordered after it, and memory it uses is reused only by later work on the same stream.
//! - [`Lane::Side`]: a side stream, to overlap with compute. It starts after the compute work
//!   enqueued so far (an event), and the compute stream waits for its end (another event)
//!   before any later kernel, copy or foreign operation touching the same memory, or when
//!   [`ForeignQueue::join`] asks. Its tensors' memory is kept out of reuse until it ends.
//!
//! This file holds the submitting side, [`ForeignQueue`]; what an operation is and is given
//! ([`Lane`], [`ForeignContext`], [`Extensions`]) is defined below the server and re-exported
//! here.

use std::sync::atomic::{AtomicU64, Ordering};

use burn_cubecl::tensor::CubeTensor;
use cubecl_common::device::Device;
use cubecl_common::device_handle::DeviceHandle;
use cubecl_core::server::Binding;

use super::device::CudaGpu;
use super::device_check::record::DeviceCheck;
use super::foreign_op::ForeignTask;
use super::pinned::PinnedPool;
use super::runtime::MegatronCudaRuntime;
use super::server::{Alarms, CudaServer};

pub use super::extensions::Extensions;
pub use super::foreign_op::{ForeignContext, ForeignOp, Lane};

/// Identifies a submitted side-lane operation, for [`ForeignQueue::join`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket(u64);

/// Submits foreign operations to a device's queue.
#[derive(Clone)]
pub struct ForeignQueue {
    handle: DeviceHandle<CudaServer>,
}

impl core::fmt::Debug for ForeignQueue {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "ForeignQueue({:?})", self.handle.device_id())
    }
}

static NEXT_TICKET: AtomicU64 = AtomicU64::new(1);

impl ForeignQueue {
    /// The queue of `device`: the one Burn's kernels for it go through.
    pub fn new(device: &CudaGpu) -> Self {
        Self {
            handle: DeviceHandle::new(device.to_id()),
        }
    }

    /// Enqueues `op` on `lane` after everything submitted to the device so far. `bindings`
    /// name the memory it touches (see [`binding`]); `name` identifies it in errors.
    pub fn submit(
        &self,
        name: &'static str,
        bindings: Vec<Binding>,
        lane: Lane,
        op: impl FnOnce(&mut ForeignContext<'_>) -> Result<(), String> + Send + 'static,
    ) -> Ticket {
        let ticket = NEXT_TICKET.fetch_add(1, Ordering::Relaxed);
        let task = ForeignTask {
            name,
            bindings,
            lane,
            ticket,
            op: Box::new(op),
        };
        self.handle.submit(move |server| server.run_foreign(task));
        Ticket(ticket)
    }

    /// Makes the compute stream wait for the side-lane operation `ticket`: work submitted
    /// after this call sees its results. No host synchronisation.
    pub fn join(&self, ticket: Ticket) {
        self.handle.submit(move |server| server.join(ticket.0));
    }

    /// Runs `f` on the device's thread, with its context current, after everything queued so
    /// far, and returns its result: for setup such as creating an NCCL communicator.
    pub fn run_blocking<R: Send>(&self, f: impl FnOnce(&mut Extensions) -> R + Send) -> R {
        self.handle
            .submit_blocking(move |server| server.with_extensions(f))
            .expect("the device queue is alive")
    }

    /// The device's pool of page-locked host buffers (see [`super::host`]).
    pub(crate) fn pinned_pool(&self) -> PinnedPool {
        self.handle
            .submit_blocking(|server| server.pinned.clone())
            .expect("the device queue is alive")
    }

    /// The device's alarms: what another thread raises there is returned by the device's
    /// next read, sync or flush.
    pub fn alarms(&self) -> Alarms {
        self.handle
            .submit_blocking(|server| server.alarms.clone())
            .expect("the device queue is alive")
    }

    /// Keeps `check` for the device's next read or sync (see [`super::device_check`]).
    pub(crate) fn queue_check(&self, check: DeviceCheck) {
        self.handle.submit(move |server| server.checks.push(check));
    }

    /// Starts the queued work now. The queue otherwise waits for a batch of tasks; a
    /// collective that peers wait on must not wait in it.
    pub fn flush(&self) {
        self.handle.flush_queue();
    }
}

/// The memory binding of a tensor of [`MegatronCuda`](super::MegatronCuda), for
/// [`ForeignQueue::submit`].
pub fn binding(tensor: &CubeTensor<MegatronCudaRuntime>) -> Binding {
    tensor.handle.clone().binding()
}
