//! Asynchronous save: the step waits only for the host copies; the files are written on a
//! background thread while training goes on; the checkpoint is published later, when every
//! rank has finished writing (Megatron's `--async-save`).
//!
//! Publishing needs every rank (an agreement that all files were written, then rank 0 writes
//! the metadata and renames the directory), so it cannot happen on the writer threads: it
//! happens at the next call every rank makes anyway, the next [`AsyncCheckpointer::save`], or
//! [`AsyncCheckpointer::finish`] at the end of training. Until then the previous checkpoint
//! is the latest, so a crash while writing loses only the save in flight.

use std::marker::PhantomData;
use std::path::PathBuf;
use std::thread::JoinHandle;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn_megatron_dist::ParallelState;

use super::metadata::TrainingState;
use super::save::Checkpointer;
use crate::ModelBackend;
use crate::error::CheckpointError;
use crate::error::Result;
use crate::models::GptModel;
use crate::optimizer::state::OptimizerState;
use crate::transformer::TransformerConfig;

/// A [`Checkpointer`] whose saves write in the background; at most one save is in flight.
/// `B` is the model's backend (the ranks agree through it that every file was written).
///
/// ```ignore
/// let mut checkpointer = AsyncCheckpointer::new(Checkpointer::new("ckpt"));
/// for iteration in 1..=iters {
///     model = train_step(model);
///     if iteration % 100 == 0 {
///         // Returns once this rank's tensors are on the host; publishes the previous save.
///         checkpointer.save(&state, &config, &chunks, None, &training)?;
///     }
/// }
/// checkpointer.finish(&state)?; // waits for the last save and publishes it
/// ```
///
/// Dropping it waits for the files being written, but cannot publish them (that needs every
/// rank): call [`finish`](Self::finish) before the end.
#[derive(Debug)]
pub struct AsyncCheckpointer<B: ModelBackend> {
    checkpointer: Checkpointer,
    in_flight: Option<InFlight>,
    backend: PhantomData<fn() -> B>,
}

/// A save whose files are being written.
#[derive(Debug)]
struct InFlight {
    writer: JoinHandle<Result<()>>,
    tmp: PathBuf,
    config: TransformerConfig,
    training: TrainingState,
}

impl<B: ModelBackend> AsyncCheckpointer<B> {
    /// Saves with `checkpointer`'s settings (root, checkpoints kept, checksum blocks), in the
    /// background.
    pub fn new(checkpointer: Checkpointer) -> Self {
        Self {
            checkpointer,
            in_flight: None,
            backend: PhantomData,
        }
    }

    /// Prepares, in the background, the host buffers this rank's first save will read its
    /// parameters into (page-locked on our CUDA backend: locking 2 GB of pages takes about a
    /// second, which the first save would otherwise spend while the step waits). Call it once
    /// the model is built; saves work without it. The optimizer state's buffers are locked by
    /// the first save.
    pub fn prepare(&self, state: &ParallelState, chunks: &[GptModel<B>]) {
        // The ranks that write the model (see the snapshot); others read no parameters.
        if state.dp().rank() != 0 || state.coords().cp != 0 {
            return;
        }
        struct Sizes(Vec<usize>);
        impl<B: burn::tensor::backend::Backend> ModuleVisitor<B> for Sizes {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let value = param.val();
                self.0
                    .push(value.shape().num_elements() * value.dtype().size());
            }
        }
        for chunk in chunks {
            let mut sizes = Sizes(Vec::new());
            chunk.visit(&mut sizes);
            if let Some(device) = chunk.devices().into_iter().next() {
                B::prepare_host_buffers(&device, sizes.0);
            }
        }
    }

    /// The settings.
    pub fn checkpointer(&self) -> &Checkpointer {
        &self.checkpointer
    }

    /// The iteration of the save being written, if any.
    pub fn in_flight(&self) -> Option<u64> {
        self.in_flight.as_ref().map(|s| s.training.iteration)
    }

    /// Starts saving `chunks` as [`Checkpointer::save`] does, returning once this rank's
    /// tensors are copied to the host; its files are written in the background. The save in
    /// flight before it, if any, is waited for and published first: its directory is
    /// returned, and its error, if a rank failed to write it, is returned instead (the new
    /// save is then not started). Every rank must call it.
    pub fn save(
        &mut self,
        state: &ParallelState,
        config: &TransformerConfig,
        chunks: &[GptModel<B>],
        optimizer: Option<&[OptimizerState]>,
        training: &TrainingState,
    ) -> Result<Option<PathBuf>> {
        let previous = self.finish(state)?;
        let started = self
            .checkpointer
            .begin(state, config, chunks, None, optimizer, training)?;
        let checkpointer = self.checkpointer.clone();
        let tmp = started.tmp.clone();
        let rank = state.world().rank();
        let writer = std::thread::Builder::new()
            .name(format!("checkpoint-writer-{rank}"))
            .spawn(move || checkpointer.write(started.snapshot, &tmp, rank))
            .map_err(|e| CheckpointError::io(&started.tmp, "start its writer thread", e))?;
        self.in_flight = Some(InFlight {
            writer,
            tmp: started.tmp,
            config: started.config,
            training: started.training,
        });
        Ok(previous)
    }

    /// Waits for the save in flight and publishes it: its directory, `None` when there was
    /// none. If any rank failed to write it, every rank returns an error and nothing is
    /// published (the previous checkpoint stays the latest). Every rank must call it.
    pub fn finish(&mut self, state: &ParallelState) -> Result<Option<PathBuf>> {
        let Some(save) = self.in_flight.take() else {
            return Ok(None);
        };
        let written = join(save.writer, &save.tmp);
        self.checkpointer
            .finish(state, &save.config, &save.training, &save.tmp, written)
            .map(Some)
    }
}

/// The writer's result; a panic on the writer thread is an error naming the directory.
fn join(writer: JoinHandle<Result<()>>, tmp: &std::path::Path) -> Result<()> {
    writer.join().unwrap_or_else(|_| {
        Err(CheckpointError::file(tmp, "the checkpoint writer thread panicked").into())
    })
}

impl<B: ModelBackend> Drop for AsyncCheckpointer<B> {
    /// Waits for the files being written. They are not published (that needs every rank): the
    /// next save removes them. What happened can only be reported on standard error here.
    fn drop(&mut self) {
        if let Some(save) = self.in_flight.take() {
            let iteration = save.training.iteration;
            match join(save.writer, &save.tmp) {
                Ok(()) => eprintln!(
                    "checkpoint of iteration {iteration} was written to {} but not published: \
                     AsyncCheckpointer::finish was not called",
                    save.tmp.display()
                ),
                Err(e) => eprintln!("checkpoint of iteration {iteration} was not written: {e}"),
            }
        }
    }
}
