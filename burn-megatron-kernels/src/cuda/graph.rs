//! CUDA graphs: the device's work of one step (kernels, copies and foreign operations such
//! as cuBLASLt GEMMs and NCCL collectives), recorded once and replayed with one launch.
//!
//! A decode step of a 1B model launches some 175 small kernels and GEMMs, and launching
//! them takes the host longer than the GPU takes to run them. Captured, the step is one
//! `cuGraphLaunch`. Side-lane operations (NCCL's collectives) are captured on the compute
//! stream, in the step's order; the NCCL watchdog then follows each replay as a whole.
//!
//! A replay runs the captured launches with the captured arguments and addresses, so the
//! captured work must be the same every step and read its inputs from, and write its state to,
//! the same buffers: tensors created before the capture and updated in place. Buffers allocated
//! while capturing stay allocated for the graph's life. What a graph cannot hold fails the
//! capture with an error naming it, and leaves the device usable: a host read or write, a
//! wait, a launch sized by device data, or a kernel compiled or tuned for the first time (run
//! the step once before capturing it).

use cubecl_common::device::Device;
use cubecl_common::device_handle::DeviceHandle;

use super::capture::Capture;
use super::device::CudaGpu;
use super::server::CudaServer;

/// An instantiated CUDA graph of `device`'s compute stream, with the memory it writes.
/// Dropping it destroys the graph and gives the memory back.
pub struct CapturedGraph {
    handle: DeviceHandle<CudaServer>,
    exec: u64,
    kept: Option<Capture>,
    nodes: usize,
}

impl core::fmt::Debug for CapturedGraph {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "CapturedGraph({} nodes)", self.nodes)
    }
}

impl CapturedGraph {
    /// The graph's nodes: about one per kernel, copy and library call captured.
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// Enqueues the graph on the compute stream, after everything submitted so far: one
    /// launch, no host synchronisation.
    pub fn replay(&self) {
        let exec = self.exec;
        self.handle.submit(move |server| server.replay(exec));
    }
}

impl Drop for CapturedGraph {
    fn drop(&mut self) {
        let (exec, kept) = (self.exec, self.kept.take().unwrap_or_default());
        self.handle
            .submit(move |server| server.destroy_graph(exec, kept));
    }
}

/// Starts capturing `device`'s compute stream: the work submitted to it from now until
/// [`end_capture`] is recorded, not run. Fails if a capture is already running or the device
/// has an unreported error.
pub fn begin_capture(device: &CudaGpu) -> Result<(), String> {
    let handle = DeviceHandle::<CudaServer>::new(device.to_id());
    handle
        .submit_blocking(|server| server.begin_capture())
        .map_err(|e| format!("{e:?}"))?
}

/// Ends the capture [`begin_capture`] started on `device` and instantiates its graph; or says
/// what failed while capturing (the device stays usable, the work captured is not run).
pub fn end_capture(device: &CudaGpu) -> Result<CapturedGraph, String> {
    let handle = DeviceHandle::<CudaServer>::new(device.to_id());
    let (exec, kept, nodes) = handle
        .submit_blocking(|server| server.end_capture())
        .map_err(|e| format!("{e:?}"))??;
    Ok(CapturedGraph {
        handle,
        exec,
        kept: Some(kept),
        nodes,
    })
}

/// The device address of `tensor`'s memory, resolved by its device's server: two tensors
/// share memory when their addresses are equal (`None` if it cannot be resolved). A step meant
/// for capture checks with it that its state was updated in place.
pub fn address(
    tensor: &burn_cubecl::tensor::CubeTensor<super::MegatronCudaRuntime>,
) -> Option<u64> {
    let binding = tensor.handle.clone().binding();
    let handle = DeviceHandle::<CudaServer>::new(tensor.device.to_id());
    handle
        .submit_blocking(move |server| server.resolve(&binding).ok().map(|r| r.ptr))
        .ok()
        .flatten()
}
