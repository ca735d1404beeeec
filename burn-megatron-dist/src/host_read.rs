//! A read of a tensor to the host, started before the work that does not need it and waited
//! for after ([`DeviceTransport::read_ahead`]).
//!
//! [`DeviceTransport::read_ahead`]: crate::DeviceTransport::read_ahead

use burn::tensor::{Tensor, TensorData, backend::Backend};

/// A tensor on its way to the host: [`wait`](Self::wait) for its values.
pub struct HostRead {
    wait: Box<dyn FnOnce() -> Result<TensorData, String>>,
}

impl core::fmt::Debug for HostRead {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("HostRead")
    }
}

impl HostRead {
    /// A read that happens when waited for: the usual read, for backends that cannot start
    /// one early.
    pub fn later<B: Backend, const D: usize>(x: Tensor<B, D>) -> Self {
        Self::new(move || x.try_into_data().map_err(|e| e.to_string()))
    }

    /// A read whose values `wait` gives.
    pub fn new(wait: impl FnOnce() -> Result<TensorData, String> + 'static) -> Self {
        Self {
            wait: Box::new(wait),
        }
    }

    /// The tensor's values; the device's error message if it failed.
    pub fn wait(self) -> Result<TensorData, String> {
        (self.wait)()
    }
}
