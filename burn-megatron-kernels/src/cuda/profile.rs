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

use std::collections::HashMap;
use std::sync::LazyLock;

use cudarc::driver::result::event;
use cudarc::driver::sys::{CUevent, CUevent_flags, CUstream};

use super::device::CudaGpu;
use super::foreign::{Extensions, ForeignQueue, Lane};

/// Whether `BM_PROFILE` is set (to anything but `0` or nothing), read once.
static ENABLED: LazyLock<bool> =
    LazyLock::new(|| std::env::var_os("BM_PROFILE").is_some_and(|v| !v.is_empty() && v != "0"));

/// The name of the foreign operations that switch phases: they are not themselves recorded.
const PHASE_OP: &str = "profile phase";

/// Whether the profile records (`BM_PROFILE=1`).
pub fn enabled() -> bool {
    *ENABLED
}

/// What a recorded span timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// A CubeCL kernel (Burn's operations), on the compute stream.
    Kernel,
    /// A foreign operation on the compute stream.
    Foreign,
    /// A foreign operation on a side lane: it overlaps compute, so it is not in the totals.
    SideLane,
}

struct Record {
    name: &'static str,
    kind: Kind,
    phase: &'static str,
    start: CUevent,
    end: CUevent,
}

/// The device's recorded spans and its pool of timing events, kept in the device's
/// [`Extensions`] so that only the device thread touches them.
struct Recorder {
    records: Vec<Record>,
    free: Vec<CUevent>,
    /// Between [`start`] and [`report`].
    recording: bool,
    phase: &'static str,
    /// The first driver failure while recording, reported by [`report`].
    failure: Option<String>,
}

// SAFETY: CUevents are driver handles usable from any thread; the recorder lives in the
// device's extensions and is only used on the device thread.
unsafe impl Send for Recorder {}

impl Default for Recorder {
    fn default() -> Self {
        Self {
            records: Vec::new(),
            free: Vec::new(),
            recording: false,
            phase: "-",
            failure: None,
        }
    }
}

impl Recorder {
    /// A timing event recorded on `stream` now, from the pool when it has one.
    fn record(&mut self, stream: CUstream) -> Option<CUevent> {
        let event = match self.free.pop() {
            Some(event) => event,
            None => match event::create(CUevent_flags::CU_EVENT_DEFAULT) {
                Ok(event) => event,
                Err(e) => return self.fail("cuEventCreate", e),
            },
        };
        // SAFETY: a live event of the current context; `stream` is one of its streams.
        match unsafe { event::record(event, stream) } {
            Ok(()) => Some(event),
            Err(e) => {
                self.free.push(event);
                self.fail("cuEventRecord", e)
            }
        }
    }

    fn fail<T>(&mut self, call: &str, error: cudarc::driver::DriverError) -> Option<T> {
        self.failure
            .get_or_insert_with(|| format!("{call}: {error:?}"));
        None
    }

    /// Returns every recorded event to the pool.
    fn clear(&mut self) {
        for record in self.records.drain(..) {
            self.free.extend([record.start, record.end]);
        }
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.clear();
        for event in self.free.drain(..) {
            // SAFETY: created by `event::create`, destroyed once; pending events are released
            // by the driver when they complete.
            let _ = unsafe { event::destroy(event) };
        }
    }
}

/// A span begun by [`begin`]: its start event and what it times.
pub(crate) struct Span {
    name: &'static str,
    kind: Kind,
    start: CUevent,
}

/// Starts timing `name` on `stream`; `None` (one branch) when the profile is off.
pub(crate) fn begin(
    extensions: &mut Extensions,
    stream: CUstream,
    name: &'static str,
    kind: Kind,
) -> Option<Span> {
    if !enabled() || name == PHASE_OP {
        return None;
    }
    let recorder = extensions.get_or_insert_with(Recorder::default);
    if !recorder.recording {
        return None;
    }
    let start = recorder.record(stream)?;
    Some(Span { name, kind, start })
}

/// Ends a span begun by [`begin`] on the same stream.
pub(crate) fn end(extensions: &mut Extensions, stream: CUstream, span: Option<Span>) {
    let Some(span) = span else { return };
    let recorder = extensions.get_or_insert_with(Recorder::default);
    match recorder.record(stream) {
        Some(end) => {
            let phase = recorder.phase;
            recorder.records.push(Record {
                name: span.name,
                kind: span.kind,
                phase,
                start: span.start,
                end,
            });
        }
        None => recorder.free.push(span.start),
    }
}

/// Records the work submitted to `device` from now on (in queue order), forgetting any
/// earlier records. No-op when off.
pub fn start(device: &CudaGpu) {
    if enabled() {
        ForeignQueue::new(device).submit(PHASE_OP, Vec::new(), Lane::Compute, |context| {
            let recorder = context.extensions.get_or_insert_with(Recorder::default);
            recorder.clear();
            recorder.failure = None;
            recorder.phase = "-";
            recorder.recording = true;
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
                .phase = phase;
            Ok(())
        });
    }
}

/// GPU time of one kernel (or foreign operation) name.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The kernel's name with module paths left out (`UnaryFloat<ExpOp, f32>`), or the foreign
    /// operation's name.
    pub name: String,
    /// What it is.
    pub kind: Kind,
    /// Launches.
    pub count: usize,
    /// Summed GPU time, in milliseconds.
    pub total_ms: f64,
}

/// GPU time of one phase (see [`phase`]).
#[derive(Debug, Clone)]
pub struct PhaseTime {
    /// The phase's name (`-` before the first [`phase`] call).
    pub name: &'static str,
    /// Kernel launches and compute-lane foreign operations in it.
    pub count: usize,
    /// Their summed GPU time, in milliseconds.
    pub total_ms: f64,
}

/// What a device recorded between [`start`] and [`report`].
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Per name, by decreasing total time.
    pub entries: Vec<Entry>,
    /// Per phase, in the order they first appeared.
    pub phases: Vec<PhaseTime>,
    /// Kernel launches.
    pub launches: usize,
    /// Foreign operations on the compute stream.
    pub foreign: usize,
    /// Summed GPU time of the compute stream's spans (kernels and foreign operations), in ms.
    pub busy_ms: f64,
    /// From the first start to the last end on the compute stream, in ms: `busy_ms` plus the
    /// gaps no span covers.
    pub window_ms: f64,
}

/// Waits for everything submitted to `device` so far, sums the spans recorded since
/// [`start`], forgets them and stops recording. An empty report when the profile is off.
pub fn report(device: &CudaGpu) -> Result<Report, String> {
    if !enabled() {
        return Ok(Report::default());
    }
    ForeignQueue::new(device).run_blocking(|extensions| match extensions.get_mut::<Recorder>() {
        Some(recorder) => {
            recorder.recording = false;
            let report = resolve(recorder);
            recorder.clear();
            match recorder.failure.take() {
                Some(failure) => Err(format!("profile: {failure}")),
                None => report,
            }
        }
        None => Ok(Report::default()),
    })
}

fn resolve(recorder: &Recorder) -> Result<Report, String> {
    let driver =
        |call: &'static str| move |e: cudarc::driver::DriverError| format!("{call}: {e:?}");
    let mut by_name: HashMap<(&'static str, Kind), (usize, f64)> = HashMap::new();
    let mut phases: Vec<PhaseTime> = Vec::new();
    let mut report = Report::default();
    let (mut first, mut last) = (None, None);
    for record in &recorder.records {
        // SAFETY: live events of this context, recorded on the same stream; events of one
        // stream complete in order, so these waits return at once after the first ones.
        let ms = unsafe {
            event::synchronize(record.end).map_err(driver("cuEventSynchronize"))?;
            event::elapsed(record.start, record.end).map_err(driver("cuEventElapsedTime"))?
        } as f64;
        let slot = by_name.entry((record.name, record.kind)).or_default();
        slot.0 += 1;
        slot.1 += ms;
        match record.kind {
            Kind::Kernel => report.launches += 1,
            Kind::Foreign => report.foreign += 1,
            Kind::SideLane => continue,
        }
        report.busy_ms += ms;
        first.get_or_insert(record.start);
        last = Some(record.end);
        match phases.iter_mut().find(|p| p.name == record.phase) {
            Some(phase) => {
                phase.count += 1;
                phase.total_ms += ms;
            }
            None => phases.push(PhaseTime {
                name: record.phase,
                count: 1,
                total_ms: ms,
            }),
        }
    }
    if let (Some(first), Some(last)) = (first, last) {
        // SAFETY: as above.
        report.window_ms =
            unsafe { event::elapsed(first, last).map_err(driver("cuEventElapsedTime"))? } as f64;
    }
    let mut merged: HashMap<(String, Kind), (usize, f64)> = HashMap::new();
    for ((name, kind), (count, ms)) in by_name {
        let slot = merged.entry((short_name(name), kind)).or_default();
        slot.0 += count;
        slot.1 += ms;
    }
    report.entries = merged
        .into_iter()
        .map(|((name, kind), (count, total_ms))| Entry {
            name,
            kind,
            count,
            total_ms,
        })
        .collect();
    report
        .entries
        .sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms).then(a.name.cmp(&b.name)));
    report.phases = phases;
    Ok(report)
}

/// A Rust type name without its module paths: `a::b::Kernel<c::Op, f32>` → `Kernel<Op, f32>`.
fn short_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut segment = String::new();
    for c in name.chars() {
        if c.is_alphanumeric() || c == '_' || c == ':' {
            segment.push(c);
        } else {
            out.push_str(segment.rsplit("::").next().unwrap_or_default());
            segment.clear();
            out.push(c);
        }
    }
    out.push_str(segment.rsplit("::").next().unwrap_or_default());
    out
}

/// `name` cut to `max` characters, marked with `…` where cut.
fn clipped(name: &str, max: usize) -> String {
    match name.char_indices().nth(max) {
        Some((end, _)) => format!("{}…", &name[..end]),
        None => name.to_string(),
    }
}

impl Report {
    /// The `top` names by GPU time and the per-phase times, as a text table; times and counts
    /// are divided by `steps` (the number of steps the report covers).
    pub fn table(&self, top: usize, steps: usize) -> String {
        use std::fmt::Write;
        let per = steps.max(1) as f64;
        let busy = self.busy_ms.max(f64::MIN_POSITIVE);
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:>6} {:>10} {:>9} {:>10}  {:<8} name",
            "share", "ms/step", "n/step", "mean µs", "kind"
        );
        for entry in self.entries.iter().take(top) {
            let share = match entry.kind {
                Kind::SideLane => "-".to_string(),
                _ => format!("{:.1}%", 100.0 * entry.total_ms / busy),
            };
            let _ = writeln!(
                out,
                "{share:>6} {:>10.3} {:>9.1} {:>10.1}  {:<8} {}",
                entry.total_ms / per,
                entry.count as f64 / per,
                1e3 * entry.total_ms / entry.count.max(1) as f64,
                format!("{:?}", entry.kind),
                clipped(&entry.name, 160),
            );
        }
        let rest: f64 = self.entries.iter().skip(top).map(|e| e.total_ms).sum();
        let rest_count: usize = self.entries.iter().skip(top).map(|e| e.count).sum();
        let _ = writeln!(
            out,
            "{:>5.1}% {:>10.3} {:>9.1} {:>10}  {:<8} ({} other names)",
            100.0 * rest / busy,
            rest / per,
            rest_count as f64 / per,
            "",
            "",
            self.entries.len().saturating_sub(top),
        );
        let _ = writeln!(
            out,
            "total: {:.3} ms/step of GPU time in {:.1} kernel launches and {:.1} foreign \
             operations per step; compute stream window {:.3} ms/step ({:.1}% covered)",
            self.busy_ms / per,
            self.launches as f64 / per,
            self.foreign as f64 / per,
            self.window_ms / per,
            100.0 * self.busy_ms / self.window_ms.max(f64::MIN_POSITIVE),
        );
        for phase in &self.phases {
            let _ = writeln!(
                out,
                "phase {:<12} {:>10.3} ms/step GPU {:>9.1} launches/step",
                phase.name,
                phase.total_ms / per,
                phase.count as f64 / per,
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::short_name;

    #[test]
    fn short_names_drop_module_paths() {
        assert_eq!(
            short_name("burn_cubecl::kernel::Unary<burn_cubecl::ops::ExpOp, f32>"),
            "Unary<ExpOp, f32>"
        );
        assert_eq!(short_name("cuBLASLt GEMM"), "cuBLASLt GEMM");
        assert_eq!(short_name("a::B<(c::D, [e::F; 2])>"), "B<(D, [F; 2])>");
    }
}
