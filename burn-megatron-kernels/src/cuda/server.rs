//! The compute server: owns the device's streams, memory and kernels, and runs every task of
//! the device queue (Burn's kernels and our foreign operations) in order.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cubecl_common::backtrace::BackTrace;
use cubecl_common::bytes::Bytes;
use cubecl_common::device::{Device, DeviceId, DeviceService, ServerUtilitiesHandle};
use cubecl_common::profile::ProfileDuration;
use cubecl_common::stream_id::StreamId;
use cubecl_core::MemoryUsage;
use cubecl_core::future::DynFut;
use cubecl_core::prelude::{CubeCount, ExecutionMode};
use cubecl_core::server::{
    Binding, CopyDescriptor, Handle, IoError, KernelArguments, ProfileError, ProfilingToken,
    ServerCommunication, ServerError, ServerUtilities,
};
use cubecl_runtime::allocator::PitchedMemoryLayoutPolicy;
use cubecl_runtime::compiler::CubeTask;
use cubecl_runtime::logging::ServerLogger;
use cubecl_runtime::memory_management::{
    ManagedMemoryHandle, MemoryAllocationMode, MemoryManagement, MemoryManagementOptions,
};
use cubecl_runtime::server::ComputeServer;
use cubecl_runtime::storage::{ComputeStorage, ManagedResource};
use cubecl_runtime::timestamp_profiler::TimestampProfiler;
use cudarc::driver::sys::{CUcontext, CUstream, CUstream_flags, cuStreamCreate};

use super::CudaCompiler;
use super::capture::{Capture, HostBytes};
use super::copy::{Direction, copy};
use super::device::CudaGpu;
use super::device_check::record::DeviceCheck;
use super::driver::{DriverFailure, check};
use super::event::Event;
use super::extensions::Extensions;
use super::foreign_op::{ForeignContext, ForeignTask, Lane};
use super::lanes::{Lanes, range};
use super::memory_pools::memory_configuration;
use super::modules::Modules;
use super::pinned::{PinnedBytes, PinnedPool};
use super::profile::recorder;
use super::profile::summary::Kind;
use super::properties::{MEMORY_ALIGNMENT, probe};
use super::storage::{GpuResource, GpuStorage};
use super::tensor_map;

/// The server of one GPU. It runs on the device's queue thread, so it is never shared.
pub struct CudaServer {
    pub(super) context: CUcontext,
    /// Where Burn's kernels, copies and compute-lane foreign operations run, in order.
    pub(super) compute: CUstream,
    pub(super) memory: MemoryManagement<GpuStorage>,
    pub(super) modules: Modules,
    pub(super) utilities: Arc<ServerUtilities<Self>>,
    /// Launch and foreign-operation errors, reported by the next read, sync or flush.
    pub(super) errors: Vec<ServerError>,
    pub(super) timestamps: TimestampProfiler,
    pub(super) cursor: u64,
    /// Side lanes for foreign operations that overlap compute, and their pending operations.
    pub(super) lanes: Lanes,
    pub(super) extensions: Extensions,
    /// Failures reported from outside the device thread (an NCCL watchdog), taken with `errors`.
    pub(super) alarms: Alarms,
    /// Checks of device-computed values, decided at the next read or sync.
    pub(super) checks: Vec<DeviceCheck>,
    /// Page-locked host buffers that large reads land in.
    pub(super) pinned: PinnedPool,
    /// What the capture of the compute stream into a CUDA graph has gathered, while one runs.
    pub(super) capture: Option<Capture>,
}

/// Failures that other threads report to a device (see [`ForeignQueue::alarms`]): the device's
/// next read, sync or flush returns them, so no result of an aborted collective goes unnoticed.
///
/// [`ForeignQueue::alarms`]: super::ForeignQueue::alarms
#[derive(Debug, Clone, Default)]
pub struct Alarms(Arc<std::sync::Mutex<Vec<String>>>);

impl Alarms {
    /// Reports `reason` to the device.
    pub fn raise(&self, reason: String) {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(reason);
    }

    fn take(&self) -> Vec<String> {
        core::mem::take(
            &mut *self
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

// SAFETY: the server only ever runs on its device thread; the raw driver handles it holds are
// not shared.
unsafe impl Send for CudaServer {}

impl core::fmt::Debug for CudaServer {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("CudaServer")
            .field("lanes", &self.lanes.streams())
            .field("pending", &self.lanes.pending())
            .field("errors", &self.errors.len())
            .finish()
    }
}

impl CudaServer {
    fn start(device_id: DeviceId) -> Result<Self, DriverFailure> {
        let gpu = CudaGpu::from_id(device_id);
        use cudarc::driver::result as driver;
        let fail = |call| move |e: cudarc::driver::DriverError| DriverFailure { call, code: e.0 };
        driver::init().map_err(fail("cuInit"))?;
        let device = driver::device::get(gpu.index as i32).map_err(fail("cuDeviceGet"))?;
        // SAFETY: the primary context of a valid device, made current on this thread; NCCL and
        // cuBLASLt use the same context.
        let context = unsafe {
            let context =
                driver::primary_ctx::retain(device).map_err(fail("cuDevicePrimaryCtxRetain"))?;
            driver::ctx::set_current(context).map_err(fail("cuCtxSetCurrent"))?;
            context
        };
        let mut compute = core::ptr::null_mut();
        // SAFETY: creates a stream in the current context.
        unsafe {
            check(
                cuStreamCreate(&mut compute, CUstream_flags::CU_STREAM_NON_BLOCKING as u32),
                "cuStreamCreate",
            )?
        };
        let probe = probe(device)?;
        let logger = Arc::new(ServerLogger::default());
        let memory = MemoryManagement::from_configuration(
            GpuStorage::new(compute, MEMORY_ALIGNMENT),
            &probe.properties.memory,
            memory_configuration(
                probe.properties.memory.max_page_size,
                MEMORY_ALIGNMENT as u64,
            ),
            logger.clone(),
            MemoryManagementOptions::new("burn-megatron CUDA memory"),
        );
        let policy = PitchedMemoryLayoutPolicy::new(MEMORY_ALIGNMENT);
        let modules = Modules::new(probe.arch, probe.compilation);
        let utilities = ServerUtilities::new(probe.properties, logger, (), policy);
        Ok(Self {
            context,
            compute,
            memory,
            modules,
            utilities: Arc::new(utilities),
            errors: Vec::new(),
            timestamps: TimestampProfiler::default(),
            cursor: 0,
            lanes: Lanes::default(),
            extensions: Extensions::default(),
            alarms: Alarms::default(),
            checks: Vec::new(),
            pinned: PinnedPool::new(context),
            capture: None,
        })
    }

    pub(super) fn set_current(&self) -> Result<(), DriverFailure> {
        // SAFETY: our retained primary context.
        unsafe {
            cudarc::driver::result::ctx::set_current(self.context).map_err(|e| DriverFailure {
                call: "cuCtxSetCurrent",
                code: e.0,
            })
        }
    }

    /// Fails with the errors recorded since the last check, if any.
    pub(super) fn take_errors(&mut self) -> Result<(), ServerError> {
        for reason in self.alarms.take() {
            self.errors.push(ServerError::Generic {
                reason,
                backtrace: BackTrace::capture(),
            });
        }
        if self.errors.is_empty() {
            return Ok(());
        }
        let errors = core::mem::take(&mut self.errors);
        self.timestamps.error(ProfileError::Unknown {
            reason: format!("{errors:?}"),
            backtrace: BackTrace::capture(),
        });
        Err(ServerError::ServerUnhealthy {
            errors,
            backtrace: BackTrace::capture(),
        })
    }

    /// A slice of `size` bytes from the memory pool. When the device has no room, the pool's
    /// cached pages that hold no live tensor are given back (after the side lanes' pending
    /// work, which may still read them) and the reservation is tried once more, as PyTorch's
    /// caching allocator does: memory a run freed in one size class (start-up's staging
    /// buffers, an earlier step's gradient buffers) then serves another. A second failure is
    /// an out-of-memory error that says what the pool holds.
    fn reserve(&mut self, size: u64) -> Result<ManagedMemoryHandle, ServerError> {
        match self.memory.reserve(size) {
            Ok(reserved) => return Ok(reserved),
            Err(IoError::BufferTooBig { .. }) if self.capture.is_none() => {}
            Err(other) => return Err(other.into()),
        }
        let before = self.memory.memory_usage();
        self.lanes.join_pending(self.compute, None)?;
        self.memory.cleanup(true);
        self.memory.storage().flush();
        const GIB: f64 = (1u64 << 30) as f64;
        let retried = self.memory.reserve(size);
        let after = self.memory.memory_usage();
        static NOTED: AtomicUsize = AtomicUsize::new(0);
        if retried.is_ok() && NOTED.fetch_add(1, Ordering::Relaxed) < 3 {
            eprintln!(
                "GPU memory: {:.2} GiB of cached pages without live tensors given back to fit \
                 {:.2} GiB ({:.2} GiB in live tensors)",
                before.bytes_reserved.saturating_sub(after.bytes_reserved) as f64 / GIB,
                size as f64 / GIB,
                after.bytes_in_use as f64 / GIB,
            );
        }
        retried.map_err(|error| {
            // What the device itself says: the memory held outside the pool (the CUDA
            // context, NCCL's buffers, library workspaces) is what the pool cannot see.
            let device = match cudarc::driver::result::mem_get_info() {
                Ok((free, total)) => format!(
                    "; the device has {:.2} GiB free of {:.2}, so {:.2} GiB are held outside \
                     the pool (CUDA context, NCCL, library workspaces)",
                    free as f64 / GIB,
                    total as f64 / GIB,
                    total
                        .saturating_sub(free)
                        .saturating_sub(after.bytes_reserved as usize) as f64
                        / GIB,
                ),
                Err(_) => String::new(),
            };
            ServerError::Generic {
                reason: format!(
                    "out of GPU memory: {:.2} GiB requested, {:.2} GiB in live tensors, the \
                     pool held {:.2} GiB before its free pages were given back and {:.2} GiB \
                     after{device} ({error})",
                    size as f64 / GIB,
                    after.bytes_in_use as f64 / GIB,
                    before.bytes_reserved as f64 / GIB,
                    after.bytes_reserved as f64 / GIB,
                ),
                backtrace: BackTrace::capture(),
            }
        })
    }

    /// Whether an earlier operation failed and its error is not reported yet. Launches,
    /// copies and foreign operations are skipped until it is (at the next read, sync or
    /// flush): a tensor whose memory could not be reserved has none, and must not be resolved.
    fn failed(&self) -> bool {
        !self.errors.is_empty()
    }

    fn next_cursor(&mut self) -> u64 {
        self.cursor += 1;
        self.cursor
    }

    pub(super) fn resolve(&mut self, binding: &Binding) -> Result<GpuResource, IoError> {
        self.memory.get_resource(
            binding.memory.clone(),
            binding.offset_start,
            binding.offset_end,
        )
    }

    /// Device memory filled with `bytes`, in stream order.
    fn upload(&mut self, bytes: &[u8]) -> Result<Handle, ServerError> {
        let handle = Handle::new(StreamId::current(), bytes.len() as u64);
        let reserved = self.reserve(bytes.len() as u64)?;
        let cursor = self.next_cursor();
        self.memory.bind(reserved, handle.memory.clone(), cursor)?;
        let target = self.resolve(&handle.clone().binding())?;
        let shape = [bytes.len()].into();
        let strides = [1].into();
        // A captured copy reads its source at every replay: page-locked bytes the graph keeps.
        let mut source = bytes.as_ptr() as *mut u8;
        if let Some(capture) = &mut self.capture {
            let kept = HostBytes::copy_of(bytes)?;
            source = kept.as_mut_ptr();
            debug_assert_eq!(kept.len(), bytes.len());
            capture.host.push(kept);
            capture.memory.push(handle.memory.clone().binding());
        }
        // SAFETY: `target` holds `bytes.len()` bytes; a pageable source is staged before the
        // call returns, a page-locked one lives as long as the graph that reads it.
        unsafe {
            copy(
                Direction::ToDevice,
                source,
                target.ptr,
                &shape,
                &strides,
                1,
                self.compute,
            )?
        };
        Ok(handle)
    }

    fn read_now(&mut self, descriptors: Vec<CopyDescriptor>) -> Result<Vec<Bytes>, ServerError> {
        self.set_current()?;
        self.refuse_in_capture("a read of device memory by the host")?;
        self.take_errors()?;
        let resources = descriptors
            .iter()
            .map(|d| self.resolve(&d.handle))
            .collect::<Result<Vec<_>, _>>()?;
        let ranges: Vec<_> = resources.iter().map(range).collect();
        self.lanes.join_pending(self.compute, Some(&ranges))?;
        let mut out = Vec::with_capacity(descriptors.len());
        for (descriptor, resource) in descriptors.iter().zip(&resources) {
            let len = descriptor.shape.iter().product::<usize>() * descriptor.elem_size;
            // Large reads go to page-locked buffers (see `pinned`), small ones to a `Vec`.
            let mut host = match self.pinned.take(len) {
                Some(pinned) => HostBuffer::Pinned(pinned),
                None => HostBuffer::Pageable(vec![0u8; len]),
            };
            // SAFETY: `host` holds the tensor; it lives until the synchronisation below.
            unsafe {
                copy(
                    Direction::ToHost,
                    host.as_mut_ptr(),
                    resource.ptr,
                    &descriptor.shape,
                    &descriptor.strides,
                    descriptor.elem_size,
                    self.compute,
                )?
            };
            out.push((host, len));
        }
        Event::record(self.compute)?.synchronize()?;
        // A watchdog may have aborted a collective this read waited for.
        self.take_errors()?;
        self.decide_checks()?;
        Ok(out
            .into_iter()
            .map(|(host, len)| match host {
                HostBuffer::Pageable(bytes) => Bytes::from_bytes_vec(bytes),
                // SAFETY: the copy of `len` bytes into it has completed (the event above).
                HostBuffer::Pinned(pinned) => unsafe { pinned.into_bytes(len) },
            })
            .collect())
    }

    /// Reads the values of the queued device checks (the device has passed them: this is
    /// called right after a wait) and fails with the messages of those whose verdict fails.
    fn decide_checks(&mut self) -> Result<(), ServerError> {
        if self.checks.is_empty() {
            return Ok(());
        }
        let checks = core::mem::take(&mut self.checks);
        let descriptors = checks
            .iter()
            .map(|c| {
                let d = &c.descriptor;
                CopyDescriptor::new(
                    d.handle.clone(),
                    d.shape.clone(),
                    d.strides.clone(),
                    d.elem_size,
                )
            })
            .collect();
        let values = self.read_now(descriptors)?;
        let failures: Vec<String> = checks
            .into_iter()
            .zip(&values)
            .filter_map(|(check, bytes)| check.decide(bytes))
            .collect();
        match failures.is_empty() {
            true => Ok(()),
            false => Err(ServerError::Generic {
                reason: failures.join("; "),
                backtrace: BackTrace::capture(),
            }),
        }
    }

    fn write_now(&mut self, descriptors: Vec<(CopyDescriptor, Bytes)>) -> Result<(), ServerError> {
        self.set_current()?;
        self.refuse_in_capture("a copy of host data to the device")?;
        for (descriptor, data) in descriptors {
            let resource = self.resolve(&descriptor.handle)?;
            self.lanes
                .join_pending(self.compute, Some(&[range(&resource)]))?;
            // SAFETY: the tensor's memory and the host bytes match its shape; a pageable source
            // is staged before the call returns.
            unsafe {
                copy(
                    Direction::ToDevice,
                    data.as_ptr() as *mut u8,
                    resource.ptr,
                    &descriptor.shape,
                    &descriptor.strides,
                    descriptor.elem_size,
                    self.compute,
                )?
            };
        }
        Ok(())
    }

    fn launch_checked(
        &mut self,
        kernel: Box<dyn CubeTask<CudaCompiler>>,
        count: CubeCount,
        args: KernelArguments,
        mode: ExecutionMode,
    ) -> Result<(), ServerError> {
        self.set_current()?;
        let mut id = kernel.id();
        id.mode(mode);
        let loaded =
            self.modules
                .get_or_load(&id, kernel.as_ref(), mode, &self.utilities.properties)?;
        let count = match count {
            CubeCount::Static(x, y, z) => (x, y, z),
            // CUDA has no indirect launch: read the three counts (a host round trip).
            CubeCount::Dynamic(binding) => {
                self.refuse_in_capture("a launch whose size is read from the device")?;
                super::host_syncs::record();
                let descriptor = CopyDescriptor::new(binding, [3].into(), [1].into(), 4);
                let bytes = self.read_now(vec![descriptor])?;
                let counts: &[u32] = bytemuck::cast_slice(&bytes[0]);
                (counts[0], counts[1], counts[2])
            }
        };
        let info = &args.info;
        let grid_constants = self.modules.options().supports_features.grid_constants;
        let (constant, info_buffer) = if grid_constants {
            let dynamic = &info.data[info.dynamic_metadata_offset.min(info.data.len())..];
            let buffer = match dynamic.is_empty() {
                true => None,
                false => Some(self.upload(bytemuck::cast_slice(dynamic))?),
            };
            (Some(info.data.as_ptr() as *mut core::ffi::c_void), buffer)
        } else {
            let buffer = match info.data.is_empty() {
                true => None,
                false => Some(self.upload(bytemuck::cast_slice(&info.data))?),
            };
            (None, buffer)
        };

        // Arguments: tensor maps, then every buffer (tensor maps' buffers first), then the
        // metadata buffer, then the metadata passed by value.
        let mut resources = Vec::with_capacity(args.tensor_maps.len() + args.buffers.len() + 1);
        let mut maps = Vec::with_capacity(args.tensor_maps.len());
        for tensor_map in &args.tensor_maps {
            let resource = self.resolve(&tensor_map.binding)?;
            maps.push(tensor_map::encode(&tensor_map.map, resource.ptr)?);
            resources.push(resource);
        }
        for binding in &args.buffers {
            resources.push(self.resolve(binding)?);
        }
        if let Some(buffer) = &info_buffer {
            resources.push(self.resolve(&buffer.clone().binding())?);
        }
        let ranges: Vec<_> = resources.iter().map(range).collect();
        self.lanes.join_pending(self.compute, Some(&ranges))?;

        let mut pointers: Vec<u64> = resources.iter().map(|r| r.ptr).collect();
        let mut params: Vec<*mut core::ffi::c_void> =
            maps.iter().map(|m| m as *const _ as *mut _).collect();
        params.extend(
            pointers
                .iter_mut()
                .map(|p| p as *mut u64 as *mut core::ffi::c_void),
        );
        params.extend(constant);
        let dim = loaded.cube_dim;
        let span = recorder::begin(
            &mut self.extensions,
            self.compute,
            kernel.name(),
            Kind::Kernel,
        );
        // SAFETY: `params` points at live values laid out as the kernel's signature expects;
        // the driver copies them before returning.
        unsafe {
            cudarc::driver::result::launch_kernel(
                loaded.function,
                count,
                (dim.x, dim.y, dim.z),
                loaded.shared_memory as u32,
                self.compute,
                &mut params,
            )
            .map_err(|e| DriverFailure {
                call: "cuLaunchKernel",
                code: e.0,
            })?;
        }
        recorder::end(&mut self.extensions, self.compute, span);
        // The metadata buffer may be reused now: later users are ordered after this launch.
        drop(info_buffer);
        Ok(())
    }

    fn sync_now(&mut self) -> Result<Event, ServerError> {
        self.set_current()?;
        self.refuse_in_capture("a wait for the device")?;
        self.take_errors()?;
        self.lanes.join_pending(self.compute, None)?;
        Ok(Event::record(self.compute)?)
    }

    /// Runs a foreign operation in queue order (see [`super::foreign`]).
    pub(crate) fn run_foreign(&mut self, task: ForeignTask) {
        if self.failed() {
            return;
        }
        let name = task.name;
        let mut task = task;
        if self.capture.is_some() {
            // A side lane's work is captured on the compute stream: a graph's launches run in
            // its order anyway, and the capture sees one stream.
            task.lane = Lane::Compute;
        }
        if let Err(error) = self.try_run_foreign(task) {
            if let Some(capture) = &mut self.capture {
                capture
                    .errors
                    .push(format!("foreign operation '{name}': {error}"));
                return;
            }
            self.errors.push(ServerError::Generic {
                reason: format!("foreign operation '{name}' failed: {error}"),
                backtrace: BackTrace::capture(),
            });
        }
    }

    fn try_run_foreign(&mut self, task: ForeignTask) -> Result<(), String> {
        self.set_current().map_err(|e| e.to_string())?;
        self.lanes.retire();
        let resources = task
            .bindings
            .iter()
            .map(|b| self.resolve(b))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let ranges: Vec<_> = resources.iter().map(range).collect();
        let pointers: Vec<u64> = resources.iter().map(|r| r.ptr).collect();
        let stream = self.lanes.stream_for(task.lane, self.compute, &ranges)?;
        let kind = match task.lane {
            Lane::Compute => Kind::Foreign,
            Lane::Side(_) => Kind::SideLane,
        };
        let span = recorder::begin(&mut self.extensions, stream, task.name, kind);
        let mut context = ForeignContext {
            stream,
            compute_stream: self.compute,
            pointers: &pointers,
            extensions: &mut self.extensions,
            capturing: self.capture.is_some(),
        };
        let result = catch_unwind(AssertUnwindSafe(|| (task.op)(&mut context)))
            .unwrap_or_else(|panic| Err(format!("panicked: {panic:?}")));
        recorder::end(&mut self.extensions, stream, span);
        if let Lane::Side(_) = task.lane {
            // Even a failed operation may have enqueued work: track it until it ends.
            self.lanes
                .track(task.ticket, task.name, stream, ranges, task.bindings)?;
        }
        result
    }

    /// Runs `f` with the context current and the per-device extensions.
    pub(crate) fn with_extensions<R>(&mut self, f: impl FnOnce(&mut Extensions) -> R) -> R {
        if let Err(error) = self.set_current() {
            self.errors.push(error.into());
        }
        f(&mut self.extensions)
    }

    /// An error naming `what` while the compute stream is captured into a graph: work that
    /// needs the host in the middle of the stream cannot be replayed.
    fn refuse_in_capture(&mut self, what: &str) -> Result<(), ServerError> {
        let Some(capture) = &mut self.capture else {
            return Ok(());
        };
        let reason = format!("{what} while a CUDA graph is captured");
        capture.errors.push(reason.clone());
        Err(ServerError::Generic {
            reason,
            backtrace: BackTrace::capture(),
        })
    }

    /// Starts capturing the compute stream into a CUDA graph (see [`super::graph`]), after
    /// every side-lane operation has joined it. Errors reported so far fail it.
    pub(crate) fn begin_capture(&mut self) -> Result<(), String> {
        if self.capture.is_some() {
            return Err("a CUDA graph is already being captured on this device".into());
        }
        self.set_current().map_err(|e| e.to_string())?;
        self.take_errors().map_err(|e| format!("{e:?}"))?;
        self.lanes
            .join_pending(self.compute, None)
            .map_err(|e| e.to_string())?;
        // Pages freed before the capture are given back now, none while it runs.
        self.memory.storage().flush();
        // SAFETY: our live stream; relaxed mode lets this thread allocate pages meanwhile.
        unsafe {
            check(
                cudarc::driver::sys::cuStreamBeginCapture_v2(
                    self.compute,
                    cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
                ),
                "cuStreamBeginCapture",
            )
            .map_err(|e| e.to_string())?
        };
        self.memory.storage().set_capturing(true);
        self.capture = Some(Capture::default());
        Ok(())
    }

    /// Ends the capture: the graph, instantiated, with the memory and host bytes it must keep,
    /// and its number of nodes; or what failed while capturing.
    pub(crate) fn end_capture(&mut self) -> Result<(u64, Capture, usize), String> {
        use cudarc::driver::sys as cu;
        let capture = self
            .capture
            .take()
            .ok_or("no CUDA graph is being captured on this device")?;
        self.memory.storage().set_capturing(false);
        let mut graph = core::ptr::null_mut();
        // SAFETY: ends the capture this server began on its stream.
        let ended = unsafe {
            check(
                cu::cuStreamEndCapture(self.compute, &mut graph),
                "cuStreamEndCapture",
            )
        };
        let destroy = |graph: cu::CUgraph| {
            if !graph.is_null() {
                // SAFETY: the graph this capture made, destroyed once.
                unsafe { cu::cuGraphDestroy(graph) };
            }
        };
        if !capture.errors.is_empty() {
            destroy(graph);
            return Err(capture.errors.join("; "));
        }
        if let Err(e) = ended {
            destroy(graph);
            return Err(e.to_string());
        }
        let mut nodes = 0usize;
        let mut exec = core::ptr::null_mut();
        // SAFETY: a valid graph; the executable graph is independent of it once instantiated.
        let made = unsafe {
            check(
                cu::cuGraphGetNodes(graph, core::ptr::null_mut(), &mut nodes),
                "cuGraphGetNodes",
            )
            .and_then(|()| {
                check(
                    cu::cuGraphInstantiateWithFlags(&mut exec, graph, 0),
                    "cuGraphInstantiateWithFlags",
                )
            })
        };
        destroy(graph);
        made.map_err(|e| e.to_string())?;
        Ok((exec as u64, capture, nodes))
    }

    /// Launches the instantiated graph `exec` on the compute stream.
    pub(crate) fn replay(&mut self, exec: u64) {
        if self.failed() {
            return;
        }
        let launched = self.set_current().and_then(|()| {
            // SAFETY: a graph instantiated by `end_capture` and not destroyed yet.
            unsafe {
                check(
                    cudarc::driver::sys::cuGraphLaunch(exec as _, self.compute),
                    "cuGraphLaunch",
                )
            }
        });
        if let Err(error) = launched {
            self.errors.push(error.into());
        }
    }

    /// Destroys the instantiated graph `exec` once the work enqueued so far no longer needs
    /// it; its kept memory (`capture`) goes back to the pool with it.
    pub(crate) fn destroy_graph(&mut self, exec: u64, capture: Capture) {
        // Replays already enqueued keep running: the driver defers the destruction.
        // SAFETY: instantiated by `end_capture`, destroyed once.
        unsafe { cudarc::driver::sys::cuGraphExecDestroy(exec as _) };
        // The host bytes may still be read by an enqueued replay: wait for them.
        if !capture.host.is_empty() {
            let _ = self.lanes.join_pending(self.compute, None);
            if let Ok(event) = Event::record(self.compute) {
                let _ = event.synchronize();
            }
        }
        drop(capture);
    }

    /// Makes the compute stream wait for the side-lane operation `ticket` (no host sync).
    pub(crate) fn join(&mut self, ticket: u64) {
        if let Err(reason) = self.lanes.join(self.compute, ticket) {
            self.errors.push(ServerError::Generic {
                reason,
                backtrace: BackTrace::capture(),
            });
        }
    }
}

impl DeviceService for CudaServer {
    fn init(device_id: DeviceId) -> Self {
        Self::start(device_id).unwrap_or_else(|e| {
            panic!(
                "burn-megatron CUDA runtime: cannot start {:?}: {e}",
                CudaGpu::from_id(device_id)
            )
        })
    }

    fn utilities(&self) -> ServerUtilitiesHandle {
        self.utilities.clone() as ServerUtilitiesHandle
    }
}

impl ServerCommunication for CudaServer {
    // Collectives run as foreign operations (NCCL on our streams), not through CubeCL.
    const SERVER_COMM_ENABLED: bool = false;
}

/// An event the caller's thread can wait on.
struct Fence(Event);

/// Where a read lands on the host.
enum HostBuffer {
    Pageable(Vec<u8>),
    Pinned(PinnedBytes),
}

impl HostBuffer {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        match self {
            HostBuffer::Pageable(bytes) => bytes.as_mut_ptr(),
            HostBuffer::Pinned(pinned) => pinned.as_mut_ptr(),
        }
    }
}

impl ComputeServer for CudaServer {
    type Kernel = Box<dyn CubeTask<CudaCompiler>>;
    type Info = ();
    type MemoryLayoutPolicy = PitchedMemoryLayoutPolicy;
    type Storage = GpuStorage;

    fn initialize_memory(&mut self, memory: ManagedMemoryHandle, size: u64, _: StreamId) {
        let cursor = self.next_cursor();
        if let Some(capture) = &mut self.capture {
            capture.memory.push(memory.clone().binding());
        }
        let result = self
            .reserve(size)
            .and_then(|reserved| Ok(self.memory.bind(reserved, memory, cursor)?));
        if let Err(error) = result {
            match &mut self.capture {
                Some(capture) => capture.errors.push(format!("{error:?}")),
                None => self.errors.push(error),
            }
        }
    }

    fn logger(&self) -> Arc<ServerLogger> {
        self.utilities.logger.clone()
    }

    fn utilities(&self) -> Arc<ServerUtilities<Self>> {
        self.utilities.clone()
    }

    fn read(
        &mut self,
        descriptors: Vec<CopyDescriptor>,
        _: StreamId,
    ) -> DynFut<Result<Vec<Bytes>, ServerError>> {
        super::host_syncs::record();
        let result = self.read_now(descriptors);
        Box::pin(async move { result })
    }

    fn write(&mut self, descriptors: Vec<(CopyDescriptor, Bytes)>, _: StreamId) {
        if self.failed() {
            return;
        }
        if let Err(error) = self.write_now(descriptors) {
            self.errors.push(error);
        }
    }

    fn sync(&mut self, _: StreamId) -> DynFut<Result<(), ServerError>> {
        super::host_syncs::record();
        // Deciding the queued checks waits for the device, as the sync would.
        if let Err(error) = self
            .set_current()
            .map_err(ServerError::from)
            .and_then(|()| self.decide_checks())
        {
            return Box::pin(async move { Err(error) });
        }
        let fence = self.sync_now().map(Fence);
        let alarms = self.alarms.clone();
        Box::pin(async move {
            fence?.0.synchronize()?;
            // A watchdog may have aborted a collective this sync waited for.
            match alarms.take() {
                raised if raised.is_empty() => Ok(()),
                raised => Err(ServerError::Generic {
                    reason: raised.join("; "),
                    backtrace: BackTrace::capture(),
                }),
            }
        })
    }

    fn get_resource(
        &mut self,
        binding: Binding,
        _: StreamId,
    ) -> Result<ManagedResource<GpuResource>, ServerError> {
        self.set_current()?;
        self.take_errors()?;
        let resource = self.resolve(&binding)?;
        Ok(ManagedResource::new(binding.memory, resource))
    }

    unsafe fn launch(
        &mut self,
        kernel: Self::Kernel,
        count: CubeCount,
        args: KernelArguments,
        mode: ExecutionMode,
        _: StreamId,
    ) {
        if self.failed() {
            return;
        }
        if let Err(error) = self.launch_checked(kernel, count, args, mode) {
            if let Some(capture) = &mut self.capture {
                capture.errors.push(format!("{error:?}"));
                return;
            }
            match self.timestamps.is_empty() {
                true => self.errors.push(error),
                false => self.timestamps.error(ProfileError::Server(Box::new(error))),
            }
        }
    }

    fn flush(&mut self, _: StreamId) -> Result<(), ServerError> {
        self.set_current()?;
        self.take_errors()?;
        self.lanes.retire();
        // Pages freed while capturing stay allocated until the capture ends (see `storage`).
        self.memory.storage().flush();
        Ok(())
    }

    fn memory_usage(&mut self, _: StreamId) -> Result<MemoryUsage, ServerError> {
        Ok(self.memory.memory_usage())
    }

    fn memory_cleanup(&mut self, _: StreamId) {
        if self.capture.is_some() {
            return;
        }
        // Pages are only freed once no pending side-lane operation can still use them.
        if let Err(error) = self.lanes.join_pending(self.compute, None) {
            self.errors.push(error.into());
        }
        self.memory.cleanup(true);
    }

    fn start_profile(&mut self, stream: StreamId) -> Result<ProfilingToken, ServerError> {
        cubecl_common::future::block_on(self.sync(stream))?;
        Ok(self.timestamps.start())
    }

    fn end_profile(
        &mut self,
        stream: StreamId,
        token: ProfilingToken,
    ) -> Result<ProfileDuration, ProfileError> {
        if let Err(error) = cubecl_common::future::block_on(self.sync(stream)) {
            self.timestamps.error(ProfileError::Server(Box::new(error)));
        }
        self.timestamps.stop(token)
    }

    fn allocation_mode(&mut self, mode: MemoryAllocationMode, _: StreamId) {
        self.memory.mode(mode);
    }
}
