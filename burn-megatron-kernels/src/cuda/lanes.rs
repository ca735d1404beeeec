//! Side lanes: the foreign operations that overlap with compute, and the hazards they create.
//!
//! A side-lane operation starts after an event on the compute stream and ends with an event of
//! its own. Until the compute stream has waited for that end (a later launch, copy or foreign
//! operation touching the same memory, an explicit join, or a sync), the operation is pending:
//! its memory ranges are checked against every later user and its bindings keep the memory
//! from being reused.
//!
//! This file holds [`Lanes`], a device's side streams and pending operations, which the server
//! owns and consults before each launch, copy and foreign operation.

use cubecl_core::server::Binding;
use cudarc::driver::sys::{CUstream, CUstream_flags, cuStreamCreateWithPriority};

use super::driver::{DriverFailure, check};
use super::event::Event;
use super::foreign_op::Lane;
use super::storage::GpuResource;

/// A foreign operation running on a side lane.
struct PendingOp {
    ticket: u64,
    name: &'static str,
    end: Event,
    ranges: Vec<(u64, u64)>,
    /// Keeps the operation's memory from being reused or freed before it ends.
    _keep: Vec<Binding>,
}

fn overlaps(a: &[(u64, u64)], b: &[(u64, u64)]) -> bool {
    a.iter()
        .any(|&(s1, e1)| b.iter().any(|&(s2, e2)| s1 < e2 && s2 < e1))
}

/// The device memory range `[start, end)` of `resource`.
pub(super) fn range(resource: &GpuResource) -> (u64, u64) {
    (resource.ptr, resource.ptr + resource.size)
}

/// A device's side lanes: their streams and the side-lane operations whose end the compute
/// stream has not waited for yet.
#[derive(Default)]
pub(super) struct Lanes {
    /// Side streams for foreign operations that overlap compute (created on first use).
    streams: Vec<CUstream>,
    /// Side-lane operations whose end the compute stream has not waited for yet.
    pending: Vec<PendingOp>,
}

impl Lanes {
    /// Side streams created so far.
    pub(super) fn streams(&self) -> usize {
        self.streams.len()
    }

    /// Side-lane operations pending.
    pub(super) fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Drops side-lane operations that are known to be over: joined into the compute stream
    /// (later compute work is ordered after them) or complete.
    pub(super) fn retire(&mut self) {
        self.pending.retain(|op| !op.end.is_complete());
    }

    /// Makes the `compute` stream wait for every pending side-lane operation touching `ranges`
    /// (or for all of them, with `None`).
    pub(super) fn join_pending(
        &mut self,
        compute: CUstream,
        ranges: Option<&[(u64, u64)]>,
    ) -> Result<(), DriverFailure> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let mut kept = Vec::with_capacity(self.pending.len());
        for op in self.pending.drain(..) {
            if ranges.is_none_or(|r| overlaps(r, &op.ranges)) {
                op.end.wait_on(compute)?;
            } else {
                kept.push(op);
            }
        }
        self.pending = kept;
        Ok(())
    }

    fn lane(&mut self, index: u8) -> Result<CUstream, DriverFailure> {
        while self.streams.len() <= index as usize {
            let mut stream = core::ptr::null_mut();
            // SAFETY: creates a stream in the current context. Side lanes get the highest
            // priority (the lowest number): communication should not wait behind compute.
            unsafe {
                let (mut least, mut greatest) = (0, 0);
                cudarc::driver::sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest);
                check(
                    cuStreamCreateWithPriority(
                        &mut stream,
                        CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                        greatest,
                    ),
                    "cuStreamCreateWithPriority",
                )?;
            }
            self.streams.push(stream);
        }
        Ok(self.streams[index as usize])
    }

    /// The stream a foreign operation on `lane` touching `ranges` runs on, ordered after what
    /// it must follow. On [`Lane::Compute`], the `compute` stream, made to wait for the pending
    /// operations touching `ranges`; on [`Lane::Side`], the side stream, made to wait for the
    /// compute work enqueued so far and for the pending operations touching `ranges`.
    pub(super) fn stream_for(
        &mut self,
        lane: Lane,
        compute: CUstream,
        ranges: &[(u64, u64)],
    ) -> Result<CUstream, String> {
        Ok(match lane {
            Lane::Compute => {
                self.join_pending(compute, Some(ranges))
                    .map_err(|e| e.to_string())?;
                compute
            }
            Lane::Side(index) => {
                let side = self.lane(index).map_err(|e| e.to_string())?;
                Event::record(compute)
                    .and_then(|start| start.wait_on(side))
                    .map_err(|e| e.to_string())?;
                for op in self
                    .pending
                    .iter()
                    .filter(|op| overlaps(ranges, &op.ranges))
                {
                    op.end.wait_on(side).map_err(|e| e.to_string())?;
                }
                side
            }
        })
    }

    /// Tracks the side-lane operation `ticket`, just enqueued on `stream`, until it ends: its
    /// end is an event recorded now, `ranges` its memory and `keep` the bindings that keep that
    /// memory from reuse.
    pub(super) fn track(
        &mut self,
        ticket: u64,
        name: &'static str,
        stream: CUstream,
        ranges: Vec<(u64, u64)>,
        keep: Vec<Binding>,
    ) -> Result<(), String> {
        let end = Event::record(stream).map_err(|e| e.to_string())?;
        self.pending.push(PendingOp {
            ticket,
            name,
            end,
            ranges,
            _keep: keep,
        });
        Ok(())
    }

    /// Makes the `compute` stream wait for the side-lane operation `ticket` (no host sync), if
    /// it is pending. An error names the operation.
    pub(super) fn join(&mut self, compute: CUstream, ticket: u64) -> Result<(), String> {
        let Some(index) = self.pending.iter().position(|op| op.ticket == ticket) else {
            return Ok(());
        };
        let op = self.pending.remove(index);
        op.end
            .wait_on(compute)
            .map_err(|error| format!("joining foreign operation '{}': {error}", op.name))
    }
}

#[cfg(test)]
mod tests {
    use super::overlaps;

    #[test]
    fn ranges_overlap_when_they_share_a_byte() {
        assert!(overlaps(&[(0, 10)], &[(5, 15)]));
        assert!(overlaps(&[(5, 15)], &[(0, 10)]));
        assert!(overlaps(&[(0, 100)], &[(40, 41)]));
        assert!(overlaps(&[(0, 4), (50, 60)], &[(20, 30), (59, 70)]));
        // Touching ends share no byte: [0, 10) and [10, 20).
        assert!(!overlaps(&[(0, 10)], &[(10, 20)]));
        assert!(!overlaps(&[(10, 20)], &[(0, 10)]));
        assert!(!overlaps(&[(0, 4), (50, 60)], &[(20, 30)]));
        assert!(!overlaps(&[], &[(0, 10)]));
    }
}
