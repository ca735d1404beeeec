//! Checks of values the device computes, decided when the host next waits for the device.
//!
//! Validating data on the GPU (token ids against the vocabulary, say) must not stop the host
//! every step. A check names a small integer tensor the device computes and a verdict on its
//! values. The server keeps it; at the device's next read or sync, which waits for the device
//! anyway, it copies the values back and hands them to the verdict, and an error the verdict
//! returns makes that read or sync fail. Nothing waits earlier.

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use cubecl_core::server::CopyDescriptor;

use super::foreign::ForeignQueue;
use super::runtime::MegatronCudaRuntime;

/// The verdict on a check's values: `Some(message)` fails the device's next read or sync.
pub type Verdict = Box<dyn FnOnce(&[i64]) -> Option<String> + Send>;

/// A check waiting for the device's next read or sync.
pub(crate) struct DeviceCheck {
    /// The values to read; the binding keeps their memory alive until then.
    pub descriptor: CopyDescriptor,
    pub dtype: DType,
    pub verdict: Verdict,
}

impl DeviceCheck {
    /// The verdict on the values read back as `bytes`.
    pub fn decide(self, bytes: &[u8]) -> Option<String> {
        let values: Vec<i64> = match self.dtype {
            DType::I64 => bytes
                .chunks_exact(8)
                .map(|b| i64::from_ne_bytes(b.try_into().expect("8 bytes")))
                .collect(),
            DType::I32 => bytes
                .chunks_exact(4)
                .map(|b| i32::from_ne_bytes(b.try_into().expect("4 bytes")).into())
                .collect(),
            DType::U32 => bytes
                .chunks_exact(4)
                .map(|b| u32::from_ne_bytes(b.try_into().expect("4 bytes")).into())
                .collect(),
            other => return Some(format!("a device check cannot read {other:?} values")),
        };
        (self.verdict)(&values)
    }
}

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
