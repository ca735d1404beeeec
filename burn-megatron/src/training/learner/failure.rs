//! Errors through Burn's `Learner`, whose steps, loaders and optimizer cannot return one.
//!
//! Where Burn's API gives no `Result` (a `TrainStep`, a `DataLoader`'s iterator, an
//! `Optimizer::step`), our implementations end the call with [`fail`]: it keeps the typed
//! error for this thread and unwinds. [`MegatronStrategy`](super::MegatronStrategy) runs its
//! loop inside [`catch`], the panic boundary, which turns the unwind back into that typed
//! error (or, for a panic of someone else's, a [`TrainingError::Learner`] with its message),
//! and hands it to [`pretrain_with_learner`](super::pretrain_with_learner)'s `Result` through
//! a [`FitFailure`].

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result, TrainingError};

thread_local! {
    /// The typed error of the failure unwinding now, set by [`fail`].
    static FAILURE: RefCell<Option<Error>> = const { RefCell::new(None) };
    /// Whether a [`catch`] boundary runs on this thread.
    static INSIDE_BOUNDARY: Cell<bool> = const { Cell::new(false) };
}

/// Ends a call that Burn's API does not let fail: keeps `error` for the [`catch`] boundary
/// and unwinds. Inside the boundary the unwind is silent (the error reaches the caller's
/// `Result`); outside (a model used with another strategy) it is a panic with the message
/// `rank {rank}: {what} failed: {error}`.
pub(crate) fn fail(rank: usize, what: &str, error: Error) -> ! {
    let message = format!("rank {rank}: {what} failed: {error}");
    if INSIDE_BOUNDARY.get() {
        FAILURE.set(Some(error));
        resume_unwind(Box::new(message))
    } else {
        panic!("{message}")
    }
}

/// [`fail`] for a `Result`: its value, or the unwind.
pub(crate) fn or_fail<T>(rank: usize, what: &str, result: Result<T>) -> T {
    result.unwrap_or_else(|e| fail(rank, what, e))
}

/// Runs `f` as the panic boundary of a Learner run on `rank`: a [`fail`] inside comes back as
/// its typed error, any other panic as [`TrainingError::Learner`] naming `what`.
pub(crate) fn catch<T>(rank: usize, what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let outer = INSIDE_BOUNDARY.replace(true);
    FAILURE.set(None);
    let outcome = catch_unwind(AssertUnwindSafe(f));
    INSIDE_BOUNDARY.set(outer);
    match outcome {
        Ok(result) => result,
        Err(panic) => Err(FAILURE.take().unwrap_or_else(|| {
            TrainingError::Learner {
                rank,
                what: what.to_string(),
                message: panic_message(panic.as_ref()),
            }
            .into()
        })),
    }
}

fn panic_message(panic: &(dyn Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(a panic without a message)".to_string()
    }
}

/// Where a [`MegatronStrategy`](super::MegatronStrategy) leaves the error that ended its loop:
/// burn-train's `fit` returns the model, not a `Result`, so the loop stops, burn-train ends
/// the run as usual (its renderer restores the terminal), and the caller takes the error
/// here after `launch` ([`pretrain_with_learner`](super::pretrain_with_learner) does). Clones
/// share one slot; the first error is kept.
#[derive(Clone, Default, Debug)]
pub struct FitFailure(Arc<Mutex<Option<Error>>>);

impl FitFailure {
    /// The error that ended the loop, if any (taken: a second call gives `None`).
    pub fn take(&self) -> Option<Error> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    pub(crate) fn set(&self, error: Error) {
        let mut slot = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            *slot = Some(error);
        }
    }
}
