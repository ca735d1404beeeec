//! The profile's recording: the timing events around each launch and foreign operation
//! ([`begin`], [`end`], called by the server), kept per device in its extensions, and their
//! resolution into a [`Report`].

use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use cudarc::driver::result::event;
use cudarc::driver::sys::{CUevent, CUevent_flags, CUstream};

use super::summary::{Entry, Idle, Kind, PhaseTime, Report, short_name};
use crate::cuda::extensions::Extensions;

/// Whether `BM_PROFILE` is set (to anything but `0` or nothing), read once.
static ENABLED: LazyLock<bool> =
    LazyLock::new(|| std::env::var_os("BM_PROFILE").is_some_and(|v| !v.is_empty() && v != "0"));

/// The name of the foreign operations that switch phases: they are not themselves recorded.
pub(super) const PHASE_OP: &str = "profile phase";

/// Whether the profile records (`BM_PROFILE=1`).
pub fn enabled() -> bool {
    *ENABLED
}

struct Record {
    name: &'static str,
    kind: Kind,
    phase: &'static str,
    /// When the device thread submitted it.
    submitted: Instant,
    start: CUevent,
    end: CUevent,
}

/// The device's recorded spans and its pool of timing events, kept in the device's
/// [`Extensions`] so that only the device thread touches them.
pub(super) struct Recorder {
    records: Vec<Record>,
    free: Vec<CUevent>,
    /// Between [`start`](super::start) and [`report`](super::report).
    recording: bool,
    phase: &'static str,
    /// The first driver failure while recording, reported by [`report`](super::report).
    failure: Option<String>,
    /// An event on the compute stream and the host's clock when it completed: the two
    /// clocks' common origin, to tell when the GPU waited for a launch.
    origin: Option<(CUevent, Instant)>,
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
            origin: None,
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
        if let Some((event, _)) = self.origin.take() {
            self.free.push(event);
        }
    }

    /// Forgets earlier records and records from now on (see [`start`](super::start)), after
    /// the work queued on the compute `stream` so far: the host waits for it once, to set the
    /// clocks' common origin.
    pub(super) fn restart(&mut self, stream: CUstream) {
        self.clear();
        self.failure = None;
        self.phase = "-";
        self.recording = true;
        if let Some(event) = self.record(stream) {
            // SAFETY: a live event just recorded on `stream`.
            match unsafe { event::synchronize(event) } {
                Ok(()) => self.origin = Some((event, Instant::now())),
                Err(e) => {
                    self.free.push(event);
                    self.fail::<()>("cuEventSynchronize", e);
                }
            }
        }
    }

    /// Tags later records with `phase` (see [`phase`](super::phase)).
    pub(super) fn set_phase(&mut self, phase: &'static str) {
        self.phase = phase;
    }

    /// Stops recording, sums the records and forgets them (see [`report`](super::report)).
    pub(super) fn finish(&mut self) -> Result<Report, String> {
        self.recording = false;
        let report = resolve(self);
        self.clear();
        match self.failure.take() {
            Some(failure) => Err(format!("profile: {failure}")),
            None => report,
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
    submitted: Instant,
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
    let submitted = Instant::now();
    let start = recorder.record(stream)?;
    Some(Span {
        name,
        kind,
        submitted,
        start,
    })
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
                submitted: span.submitted,
                start: span.start,
                end,
            });
        }
        None => recorder.free.push(span.start),
    }
}

fn resolve(recorder: &Recorder) -> Result<Report, String> {
    let driver =
        |call: &'static str| move |e: cudarc::driver::DriverError| format!("{call}: {e:?}");
    let mut by_name: HashMap<(&'static str, Kind), (usize, f64)> = HashMap::new();
    let mut phases: Vec<PhaseTime> = Vec::new();
    let mut idle: HashMap<(&'static str, &'static str, &'static str), (usize, f64, f64)> =
        HashMap::new();
    // The host's clock when a span ended on the GPU, from the common origin.
    let ended_at = |end: CUevent| -> Result<Option<Instant>, String> {
        let Some((origin, at)) = recorder.origin else {
            return Ok(None);
        };
        // SAFETY: live events of this context, both completed (see below).
        let ms = unsafe { event::elapsed(origin, end).map_err(driver("cuEventElapsedTime"))? };
        Ok(Some(
            at + Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3),
        ))
    };
    let mut report = Report::default();
    let (mut first, mut last): (Option<CUevent>, Option<&Record>) = (None, None);
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
        // The gap since the previous compute-stream span ended (spans of one stream do not
        // overlap; a negative or zero elapsed time is no gap).
        let gap = match last {
            // SAFETY: as above; both events have completed.
            Some(previous) => unsafe {
                event::elapsed(previous.end, record.start).map_err(driver("cuEventElapsedTime"))?
            }
            .max(0.0) as f64,
            None => 0.0,
        };
        // The part of the gap before this span was submitted: the GPU waited for the host.
        let mut late = 0.0;
        if let Some(previous) = last.filter(|_| gap > 0.0) {
            if let Some(ended) = ended_at(previous.end)? {
                let behind = record.submitted.saturating_duration_since(ended);
                late = (behind.as_secs_f64() * 1e3).min(gap);
            }
            let slot = idle
                .entry((record.phase, previous.name, record.name))
                .or_default();
            slot.0 += 1;
            slot.1 += gap;
            slot.2 += late;
        }
        last = Some(record);
        match phases.iter_mut().find(|p| p.name == record.phase) {
            Some(phase) => {
                phase.count += 1;
                phase.total_ms += ms;
                phase.idle_ms += gap;
                phase.late_ms += late;
            }
            None => phases.push(PhaseTime {
                name: record.phase,
                count: 1,
                total_ms: ms,
                idle_ms: gap,
                late_ms: late,
            }),
        }
    }
    if let (Some(first), Some(last)) = (first, last.map(|record| record.end)) {
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
    let mut gaps: HashMap<(&'static str, String, String), (usize, f64, f64)> = HashMap::new();
    for ((phase, after, before), (count, ms, late)) in idle {
        let slot = gaps
            .entry((phase, short_name(after), short_name(before)))
            .or_default();
        slot.0 += count;
        slot.1 += ms;
        slot.2 += late;
    }
    report.idle = gaps
        .into_iter()
        .map(
            |((phase, after, before), (count, total_ms, late_ms))| Idle {
                phase,
                after,
                before,
                count,
                total_ms,
                late_ms,
            },
        )
        .collect();
    report.idle.sort_by(|a, b| {
        b.total_ms
            .total_cmp(&a.total_ms)
            .then(a.phase.cmp(b.phase))
            .then(a.after.cmp(&b.after))
            .then(a.before.cmp(&b.before))
    });
    Ok(report)
}
