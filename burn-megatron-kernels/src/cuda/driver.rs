//! Checked calls into the CUDA driver: every failure becomes an error that names the call.

use cubecl_common::backtrace::BackTrace;
use cubecl_core::server::{IoError, LaunchError, ServerError};
use cudarc::driver::sys::CUresult;

/// A driver call that failed.
#[derive(Debug, Clone)]
pub struct DriverFailure {
    /// What was being done, e.g. `"cuStreamWaitEvent"`.
    pub call: &'static str,
    /// The driver's result code.
    pub code: CUresult,
}

impl core::fmt::Display for DriverFailure {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{} failed: {:?}", self.call, self.code)
    }
}

/// `Ok` for `CUDA_SUCCESS`, otherwise the failure of `call`.
pub fn check(code: CUresult, call: &'static str) -> Result<(), DriverFailure> {
    match code {
        CUresult::CUDA_SUCCESS => Ok(()),
        code => Err(DriverFailure { call, code }),
    }
}

impl From<DriverFailure> for ServerError {
    fn from(failure: DriverFailure) -> Self {
        ServerError::Generic {
            reason: failure.to_string(),
            backtrace: BackTrace::capture(),
        }
    }
}

impl From<DriverFailure> for LaunchError {
    fn from(failure: DriverFailure) -> Self {
        LaunchError::Unknown {
            reason: failure.to_string(),
            backtrace: BackTrace::capture(),
        }
    }
}

impl From<DriverFailure> for IoError {
    fn from(failure: DriverFailure) -> Self {
        match failure.code {
            CUresult::CUDA_ERROR_OUT_OF_MEMORY => IoError::Unknown {
                description: format!("out of GPU memory: {failure}"),
                backtrace: BackTrace::capture(),
            },
            _ => IoError::Unknown {
                description: failure.to_string(),
                backtrace: BackTrace::capture(),
            },
        }
    }
}
