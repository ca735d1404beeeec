//! A built-in profile of where a device's GPU time goes, per kernel name, for `BM_PROFILE=1`.
//!
//! The device machine has no Nsight Systems, and our runtime owns its streams, so it can time
//! its own work: with `BM_PROFILE` set, between [`start`] and [`report`], every kernel launch
//! and every foreign operation (cuBLASLt, NCCL, copies) gets a pair of CUDA timing events
//! around it on the stream it runs on, keyed by its name. Nothing is resolved while the
//! program runs: [`report`] waits for the recorded events (after everything queued so far)
//! and sums them. With the variable unset, each launch pays one branch on a flag read once;
//! with it set but outside a window, a lookup in the device's extensions.
//!
//! Reading a report: a span runs from the stream reaching the start event to it passing the end
//! event. When the GPU is ahead of the host, that is the kernel's own time; when it waits for
//! the host, the span also holds the host's few microseconds between the two records. The gap
//! between the first start and the last end on the compute stream that no span covers is time
//! the GPU spent on copies, waiting for the host, or between launches.
//!
//! ```ignore
//! profile::start(&device);                 // record from here (after the warm-up)
//! profile::phase(&device, "forward");      // later records belong to this phase
//! // ... a training step ...
//! let report = profile::report(&device)?;  // waits for the GPU, resolves, stops recording
//! println!("{}", report.table(15, 1));
//! ```
//!
//! This file holds the entry points ([`start`], [`phase`], [`report`]); the recording the
//! server does around each launch is in `recorder`, what a report holds in `summary`.

pub(crate) mod recorder;
pub(crate) mod summary;

use super::device::CudaGpu;
use super::foreign::{ForeignQueue, Lane};
use recorder::{PHASE_OP, Recorder};

pub use recorder::enabled;
pub use summary::{Entry, Idle, Kind, PhaseTime, Report};

/// Records the work submitted to `device` from now on (in queue order), forgetting any
/// earlier records. No-op when off.
pub fn start(device: &CudaGpu) {
    if enabled() {
        ForeignQueue::new(device).submit(PHASE_OP, Vec::new(), Lane::Compute, |context| {
            let stream = context.stream;
            context
                .extensions
                .get_or_insert_with(Recorder::default)
                .restart(stream);
            Ok(())
        });
    }
}

/// Tags the work submitted to `device` from now on with `phase` (such as "forward"), in queue
/// order, without waiting. No-op when off.
pub fn phase(device: &CudaGpu, phase: &'static str) {
    if enabled() {
        ForeignQueue::new(device).submit(PHASE_OP, Vec::new(), Lane::Compute, move |context| {
            context
                .extensions
                .get_or_insert_with(Recorder::default)
                .set_phase(phase);
            Ok(())
        });
    }
}

/// Waits for everything submitted to `device` so far, sums the spans recorded since
/// [`start`], forgets them and stops recording. An empty report when the profile is off.
pub fn report(device: &CudaGpu) -> Result<Report, String> {
    if !enabled() {
        return Ok(Report::default());
    }
    ForeignQueue::new(device).run_blocking(|extensions| match extensions.get_mut::<Recorder>() {
        Some(recorder) => recorder.finish(),
        None => Ok(Report::default()),
    })
}
