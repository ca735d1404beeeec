//! Our CUDA backend: a CubeCL runtime that owns its streams, so that NCCL and cuBLASLt run in
//! stream order with Burn's kernels without host synchronisation.
//!
//! [`MegatronCuda`] is Burn's `CubeBackend` over [`MegatronCudaRuntime`]: every Burn op and
//! CubeCL kernel runs on it as on burn-cuda (same compiler, same kernels, same autotune). What
//! it adds is [`foreign`]: host operations in the device's queue, on its streams.
//!
//! Its files import one way, from the driver up to the entry points:
//! - the driver and the device's resources: `driver`, [`event`], `copy`, `pinned`, `storage`,
//!   `properties`, `modules`, `tensor_map`, `device`, `host_syncs`;
//! - what the server keeps and runs: `extensions` (per-device state of foreign libraries),
//!   `foreign_op` (a foreign operation and its lane), `capture` (what a CUDA graph's capture
//!   keeps), `lanes` (side streams and their pending
//!   operations), `device_check::record` and `profile::{summary, recorder}`;
//! - `server`, the compute server, which owns all of the above, then `runtime`, CubeCL's
//!   runtime over it;
//! - the entry points, which submit to the device's queue: [`foreign`] (`ForeignQueue`),
//!   [`device_check`], [`profile`], [`graph`], [`gemm`], [`grouped_gemm`], [`cudnn`] and [`host`].

mod capture;
mod copy;
pub mod cudnn;
mod device;
pub mod device_check;
mod driver;
pub mod event;
mod extensions;
pub mod foreign;
mod foreign_op;
pub mod gemm;
pub mod graph;
pub mod grouped_gemm;
pub mod host;
mod host_syncs;
mod lanes;
mod memory_pools;
mod modules;
mod pinned;
pub mod profile;
mod properties;
pub mod read_ahead;
mod runtime;
mod server;
mod storage;
mod tensor_map;

pub use device::CudaGpu;
pub use device_check::check_on_device;
pub use event::Event;
pub use foreign::{ForeignContext, ForeignQueue, Lane, Ticket, binding};
pub use host_syncs::host_syncs;
pub use runtime::MegatronCudaRuntime;
pub use server::{Alarms, CudaServer};
pub use storage::GpuResource;

/// CubeCL's CUDA C++ compiler, as cubecl-cuda configures it.
pub type CudaCompiler = cubecl_cpp::shared::CppCompiler<
    cubecl_cpp::cuda::CudaDialect<cubecl_cpp::cuda::mma::CudaWmmaCompiler>,
>;

/// Burn's backend on our CUDA runtime.
pub type MegatronCuda<F = f32, I = i32> = burn_cubecl::CubeBackend<MegatronCudaRuntime, F, I, u8>;

/// [`MegatronCuda`] with Burn's operation fusion, as burn-cuda's default `Cuda` has it.
/// Foreign operations take tensors of the unfused backend.
pub type MegatronCudaFusion<F = f32, I = i32> = burn_fusion::Fusion<MegatronCuda<F, I>>;
