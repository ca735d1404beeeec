//! Handles of asynchronous operations.

use crate::error::DistResult;

/// An operation that has been started and completes when waited on.
///
/// Starting an operation hands this rank's part to the group at once; `wait` blocks until
/// the peers' parts are there and returns the result. Work on different groups, or later work
/// on the same group, may be started before earlier work is waited on: calls on a group are
/// matched across ranks by the order in which they were started, as in NCCL. Every handle
/// must be waited on.
#[must_use = "a started collective must be waited on"]
pub struct Work<T> {
    complete: Box<dyn FnOnce() -> DistResult<T>>,
}

impl<T: 'static> Work<T> {
    /// Work whose completion runs `complete`.
    pub(crate) fn new(complete: impl FnOnce() -> DistResult<T> + 'static) -> Self {
        Self {
            complete: Box::new(complete),
        }
    }

    /// Work that is already complete (a group of one, a buffered send).
    pub(crate) fn ready(value: T) -> Self {
        Self::new(move || Ok(value))
    }

    /// Blocks until the operation has completed and returns its result.
    pub fn wait(self) -> DistResult<T> {
        (self.complete)()
    }
}

impl<T> std::fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Work { .. }")
    }
}
