//! Checks of values the device computes, decided when the host next waits for the device.
//!
//! Validating data on the GPU (token ids against the vocabulary, say) must not stop the host
//! every step. A check names a small integer tensor the device computes and a verdict on its
//! values. The server keeps it; at the device's next read or sync, which waits for the device
//! anyway, it copies the values back and hands them to the verdict, and an error the verdict
//! returns makes that read or sync fail. Nothing waits earlier.
//!
//! This file holds the entry point, [`check_on_device`]; the check as the server keeps it is
//! in `record`.

pub(crate) mod record;

use burn_cubecl::tensor::CubeTensor;
use cubecl_core::server::CopyDescriptor;

use super::foreign::ForeignQueue;
use super::runtime::MegatronCudaRuntime;
use record::DeviceCheck;

pub use record::Verdict;

/// Queues a check of `values` (an i32, i64 or u32 tensor of [`MegatronCuda`]) after the work
/// submitted so far: at the device's next read or sync, `verdict` gets the values, and the
/// message it returns, if any, is that read's or sync's error. Returns at once.
///
/// [`MegatronCuda`]: super::MegatronCuda
pub fn check_on_device(
    values: CubeTensor<MegatronCudaRuntime>,
    verdict: impl FnOnce(&[i64]) -> Option<String> + Send + 'static,
) {
    let check = DeviceCheck {
        descriptor: CopyDescriptor::new(
            values.handle.clone().binding(),
            values.meta.shape().clone(),
            values.meta.strides().clone(),
            values.dtype.size(),
        ),
        dtype: values.dtype,
        verdict: Box::new(verdict),
    };
    ForeignQueue::new(&values.device).queue_check(check);
}
