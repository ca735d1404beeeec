//! The device type of our CUDA runtime.

use cubecl_common::device::{Device, DeviceId};

/// A CUDA GPU driven by burn-megatron's runtime (by index, as `CUDA_VISIBLE_DEVICES` numbers
/// them).
#[derive(Clone, PartialEq, Eq, Default, Hash)]
pub struct CudaGpu {
    /// The device ordinal.
    pub index: usize,
}

impl CudaGpu {
    /// The GPU with ordinal `index`.
    pub fn new(index: usize) -> Self {
        Self { index }
    }

    /// The GPU with ordinal `index` if this machine has a CUDA driver and such a GPU; else
    /// a message saying which is missing, instead of the panic inside the runtime that using
    /// it would give.
    pub fn available(index: usize) -> Result<Self, String> {
        use cudarc::driver::{result, sys};
        // SAFETY: only tries to open the driver library.
        if !unsafe { sys::is_culib_present() } {
            return Err("no CUDA driver (libcuda) here: run this on a GPU machine".into());
        }
        result::init().map_err(|e| format!("cuInit failed: {e:?}"))?;
        let count = result::device::get_count().map_err(|e| format!("no CUDA device: {e:?}"))?;
        if index >= count as usize {
            return Err(format!("GPU {index} asked for, {count} found"));
        }
        Ok(Self::new(index))
    }
}

/// Our devices' type id. It differs from cubecl-cuda's (0), so that our server and burn-cuda's
/// never share a device thread or an autotune cache entry.
const TYPE_ID: u16 = 0x4D47;

impl Device for CudaGpu {
    fn from_id(device_id: DeviceId) -> Self {
        Self {
            index: device_id.index_id as usize,
        }
    }

    fn to_id(&self) -> DeviceId {
        DeviceId {
            type_id: TYPE_ID,
            index_id: self.index as u16,
        }
    }
}

impl core::fmt::Debug for CudaGpu {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "MegatronCuda({})", self.index)
    }
}

impl burn::tensor::backend::DeviceOps for CudaGpu {}
