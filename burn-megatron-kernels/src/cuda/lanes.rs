//! Side lanes: the foreign operations that overlap with compute, and the hazards they create.
//!
//! A side-lane operation starts after an event on the compute stream and ends with an event of
//! its own. Until the compute stream has waited for that end (a later launch, copy or foreign
//! operation touching the same memory, an explicit join, or a sync), the operation is pending:
//! its memory ranges are checked against every later user and its bindings keep the memory
//! from being reused.

use std::panic::{AssertUnwindSafe, catch_unwind};

use cubecl_common::backtrace::BackTrace;
use cubecl_core::server::{Binding, ServerError};
use cudarc::driver::sys::{CUstream, CUstream_flags, cuStreamCreateWithPriority};

use super::driver::{DriverFailure, check};
use super::event::Event;
use super::foreign::{Extensions, ForeignContext, ForeignTask, Lane};
use super::profile::{self, Kind};
use super::server::CudaServer;
use super::storage::GpuResource;

/// A foreign operation running on a side lane.
pub(super) struct PendingOp {
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

pub(super) fn range(resource: &GpuResource) -> (u64, u64) {
    (resource.ptr, resource.ptr + resource.size)
}

impl CudaServer {
    /// Drops side-lane operations that are known to be over: joined into the compute stream
    /// (later compute work is ordered after them) or complete.
    pub(super) fn retire(&mut self) {
        self.pending.retain(|op| !op.end.is_complete());
    }

    /// Makes the compute stream wait for every pending side-lane operation touching `ranges`
    /// (or for all of them, with `None`).
    pub(super) fn join_pending(
        &mut self,
        ranges: Option<&[(u64, u64)]>,
    ) -> Result<(), DriverFailure> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let compute = self.compute;
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
        while self.lanes.len() <= index as usize {
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
            self.lanes.push(stream);
        }
        Ok(self.lanes[index as usize])
    }

    /// Runs a foreign operation in queue order (see [`super::foreign`]).
    pub(crate) fn run_foreign(&mut self, task: ForeignTask) {
        let name = task.name;
        if let Err(error) = self.try_run_foreign(task) {
            self.errors.push(ServerError::Generic {
                reason: format!("foreign operation '{name}' failed: {error}"),
                backtrace: BackTrace::capture(),
            });
        }
    }

    fn try_run_foreign(&mut self, task: ForeignTask) -> Result<(), String> {
        self.set_current().map_err(|e| e.to_string())?;
        self.retire();
        let resources = task
            .bindings
            .iter()
            .map(|b| self.resolve(b))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let ranges: Vec<_> = resources.iter().map(range).collect();
        let pointers: Vec<u64> = resources.iter().map(|r| r.ptr).collect();
        let stream = match task.lane {
            Lane::Compute => {
                self.join_pending(Some(&ranges))
                    .map_err(|e| e.to_string())?;
                self.compute
            }
            Lane::Side(index) => {
                let side = self.lane(index).map_err(|e| e.to_string())?;
                Event::record(self.compute)
                    .and_then(|start| start.wait_on(side))
                    .map_err(|e| e.to_string())?;
                for op in self
                    .pending
                    .iter()
                    .filter(|op| overlaps(&ranges, &op.ranges))
                {
                    op.end.wait_on(side).map_err(|e| e.to_string())?;
                }
                side
            }
        };
        let kind = match task.lane {
            Lane::Compute => Kind::Foreign,
            Lane::Side(_) => Kind::SideLane,
        };
        let span = profile::begin(&mut self.extensions, stream, task.name, kind);
        let mut context = ForeignContext {
            stream,
            compute_stream: self.compute,
            pointers: &pointers,
            extensions: &mut self.extensions,
        };
        let result = catch_unwind(AssertUnwindSafe(|| (task.op)(&mut context)))
            .unwrap_or_else(|panic| Err(format!("panicked: {panic:?}")));
        profile::end(&mut self.extensions, stream, span);
        if let Lane::Side(_) = task.lane {
            // Even a failed operation may have enqueued work: track it until it ends.
            let end = Event::record(stream).map_err(|e| e.to_string())?;
            self.pending.push(PendingOp {
                ticket: task.ticket,
                name: task.name,
                end,
                ranges,
                _keep: task.bindings,
            });
        }
        result
    }

    /// Runs `f` with the context current and the per-device extensions.
    pub(crate) fn with_extensions<R>(&mut self, f: impl FnOnce(&mut Extensions) -> R) -> R {
        if let Err(error) = self.set_current() {
            self.errors.push(error.into());
        }
        f(&mut self.extensions)
    }

    /// Makes the compute stream wait for the side-lane operation `ticket` (no host sync).
    pub(crate) fn join(&mut self, ticket: u64) {
        let Some(index) = self.pending.iter().position(|op| op.ticket == ticket) else {
            return;
        };
        let op = self.pending.remove(index);
        if let Err(error) = op.end.wait_on(self.compute) {
            self.errors.push(ServerError::Generic {
                reason: format!("joining foreign operation '{}': {error}", op.name),
                backtrace: BackTrace::capture(),
            });
        }
    }
}
