//! A device check as the server keeps it until the device's next read or sync: the values to
//! read back and the verdict on them (see [`super`]).

use burn::tensor::DType;
use cubecl_core::server::CopyDescriptor;

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

#[cfg(test)]
mod tests {
    use burn::tensor::DType;
    use cubecl_common::stream_id::StreamId;
    use cubecl_core::server::{CopyDescriptor, Handle};

    use super::DeviceCheck;

    /// A check of `dtype` values whose verdict fails with the values it was given.
    fn check(dtype: DType) -> DeviceCheck {
        let binding = Handle::new(StreamId::current(), 16).binding();
        DeviceCheck {
            descriptor: CopyDescriptor::new(binding, [2].into(), [1].into(), dtype.size()),
            dtype,
            verdict: Box::new(|values| Some(format!("{values:?}"))),
        }
    }

    fn bytes<const N: usize>(values: [[u8; N]; 2]) -> Vec<u8> {
        values.concat()
    }

    #[test]
    fn values_are_read_as_their_dtype() {
        let i32s = bytes([(-3i32).to_ne_bytes(), 7i32.to_ne_bytes()]);
        assert_eq!(check(DType::I32).decide(&i32s).as_deref(), Some("[-3, 7]"));
        let i64s = bytes([(-(1i64 << 40)).to_ne_bytes(), 9i64.to_ne_bytes()]);
        assert_eq!(
            check(DType::I64).decide(&i64s).as_deref(),
            Some("[-1099511627776, 9]")
        );
        // u32 values are widened, not reinterpreted as negative.
        let u32s = bytes([u32::MAX.to_ne_bytes(), 1u32.to_ne_bytes()]);
        assert_eq!(
            check(DType::U32).decide(&u32s).as_deref(),
            Some("[4294967295, 1]")
        );
    }

    #[test]
    fn a_passing_verdict_is_none() {
        let mut check = check(DType::I32);
        check.verdict = Box::new(|values| values.iter().any(|&v| v < 0).then(|| "negative".into()));
        assert_eq!(
            check.decide(&bytes([1i32.to_ne_bytes(), 2i32.to_ne_bytes()])),
            None
        );
    }

    #[test]
    fn other_dtypes_fail_without_a_verdict() {
        let message = check(DType::F32).decide(&[0; 8]).expect("a failure");
        assert_eq!(message, "a device check cannot read F32 values");
    }
}
