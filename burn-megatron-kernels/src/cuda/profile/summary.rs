//! What a profile reports: GPU time per kernel (or foreign operation) name and per phase, and
//! its text table. Plain data, filled by [`super::recorder`].

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

/// GPU time of one phase (see [`phase`](super::phase)).
#[derive(Debug, Clone)]
pub struct PhaseTime {
    /// The phase's name (`-` before the first [`phase`](super::phase) call).
    pub name: &'static str,
    /// Kernel launches and compute-lane foreign operations in it.
    pub count: usize,
    /// Their summed GPU time, in milliseconds.
    pub total_ms: f64,
    /// Time the compute stream sat idle before this phase's spans (waiting for the host,
    /// for another stream, or between launches), in milliseconds.
    pub idle_ms: f64,
    /// The part of `idle_ms` the GPU spent waiting for the launch itself: from the end of the
    /// span before to the moment the device thread submitted the next one (the host was
    /// behind), in milliseconds. The rest waited with the launch queued (for another
    /// stream's event, or the launch's own latency).
    pub late_ms: f64,
}

/// Compute-stream idle time between two consecutive spans, summed per phase and pair of names: where
/// the GPU waited, and for what (a host read before `before`, a launch-bound run of small
/// kernels, an event from another stream).
#[derive(Debug, Clone)]
pub struct Idle {
    /// The phase of the span after the gap.
    pub phase: &'static str,
    /// The span that ended before the gap (short name).
    pub after: String,
    /// The span that started after it (short name).
    pub before: String,
    /// Gaps between such pairs.
    pub count: usize,
    /// Their summed length, in milliseconds.
    pub total_ms: f64,
    /// The part of it before the next span was submitted (see [`PhaseTime::late_ms`]).
    pub late_ms: f64,
}

/// What a device recorded between [`start`](super::start) and [`report`](super::report).
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Per name, by decreasing total time.
    pub entries: Vec<Entry>,
    /// Per phase, in the order they first appeared.
    pub phases: Vec<PhaseTime>,
    /// The compute stream's gaps per pair of names, longest total first.
    pub idle: Vec<Idle>,
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

/// A Rust type name without its module paths: `a::b::Kernel<c::Op, f32>` → `Kernel<Op, f32>`.
pub(super) fn short_name(name: &str) -> String {
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
                "phase {:<12} {:>10.3} ms/step GPU {:>9.1} launches/step {:>10.3} ms/step idle \
                 ({:.3} launched late)",
                phase.name,
                phase.total_ms / per,
                phase.count as f64 / per,
                phase.idle_ms / per,
                phase.late_ms / per,
            );
        }
        for gap in self.idle.iter().take(top) {
            let _ = writeln!(
                out,
                "idle {:<12} {:>10.3} ms/step ({:.3} late) {:>9.1} gaps/step after {} before {}",
                gap.phase,
                gap.total_ms / per,
                gap.late_ms / per,
                gap.count as f64 / per,
                clipped(&gap.after, 80),
                clipped(&gap.before, 80),
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
