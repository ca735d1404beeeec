//! Asynchronous save: the files hold the state at the call, while training goes on (optimizer
//! steps with TP collectives run during the background writes); the checkpoint is published
//! only by the next save or `finish`, byte-identical to a synchronous save; a failed write
//! surfaces there on every rank and publishes nothing; dropping waits for the writer.

use std::fs;
use std::path::Path;

use burn::optim::{AdamWConfig, Optimizer};
use burn_megatron::checkpointing::{
    AsyncCheckpointer, Checkpoint, CheckpointMetadata, Checkpointer, TrainingState,
    latest_checkpoint,
};

use crate::{build, microbatches, run, scratch, step, tiny_gpt};

fn at(iteration: u64) -> TrainingState {
    TrainingState {
        iteration,
        ..Default::default()
    }
}

/// The files (name → size and checksums) of the checkpoint in `dir`.
fn files(dir: &Path) -> Vec<(String, u64, u32)> {
    CheckpointMetadata::read(dir)
        .unwrap()
        .files
        .into_iter()
        .map(|(name, e)| (name, e.bytes, e.crc32))
        .collect()
}

#[test]
fn an_async_save_holds_the_state_at_the_call_and_publishes_later() {
    let config = tiny_gpt();
    let (sync_root, async_root) = (scratch("async-sync"), scratch("async"));
    run(2, |ctx| {
        let (state, mut chunks) = build(&ctx, &config, 2, 1)?;
        Checkpointer::new(&sync_root).save(&state, &config, &chunks, None, &at(1))?;
        let mut checkpointer = AsyncCheckpointer::new(Checkpointer::new(&async_root));
        assert_eq!(
            checkpointer.save(&state, &config, &chunks, None, &at(1))?,
            None
        );
        assert_eq!(checkpointer.in_flight(), Some(1));
        // Not published before every rank has called finish (or the next save).
        assert_eq!(latest_checkpoint(&async_root)?, None);
        // Training goes on, with collectives, while the files are written.
        let mut optim = AdamWConfig::new().init();
        for s in 0..2 {
            let (_, grads) = step(&state, &chunks, &microbatches(s, 2, config.vocab_size))?;
            let grads = grads.into_iter().next().unwrap();
            chunks = vec![optim.step(1e-2, chunks.remove(0), grads)];
        }
        let published = checkpointer.finish(&state)?;
        assert_eq!(published, Some(async_root.join("iter_0000001")));
        assert_eq!(checkpointer.in_flight(), None);
        assert_eq!(checkpointer.finish(&state)?, None);
        Ok(())
    });
    // The state at the call, byte for byte, not the trained one.
    let (sync_dir, async_dir) = (
        sync_root.join("iter_0000001"),
        async_root.join("iter_0000001"),
    );
    assert_eq!(files(&async_dir), files(&sync_dir));
    for (name, _, _) in files(&sync_dir) {
        assert_eq!(
            fs::read(async_dir.join(&name)).unwrap(),
            fs::read(sync_dir.join(&name)).unwrap(),
            "{name}"
        );
    }
    fs::remove_dir_all(sync_root).unwrap();
    fs::remove_dir_all(async_root).unwrap();
}

#[test]
fn the_next_save_publishes_the_one_in_flight() {
    let config = tiny_gpt();
    let root = scratch("async-next");
    run(2, |ctx| {
        let (state, chunks) = build(&ctx, &config, 1, 2)?;
        let mut checkpointer = AsyncCheckpointer::new(Checkpointer::new(&root).with_keep_last(5));
        checkpointer.save(&state, &config, &chunks, None, &at(1))?;
        let previous = checkpointer.save(&state, &config, &chunks, None, &at(2))?;
        assert_eq!(previous, Some(root.join("iter_0000001")));
        assert_eq!(latest_checkpoint(&root)?, Some(root.join("iter_0000001")));
        assert_eq!(checkpointer.in_flight(), Some(2));
        assert_eq!(
            checkpointer.finish(&state)?,
            Some(root.join("iter_0000002"))
        );
        Ok(())
    });
    let checkpoint = Checkpoint::open_latest(&root).unwrap();
    assert_eq!(checkpoint.training_state().iteration, 2);
    fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_failed_background_write_surfaces_on_every_rank_and_publishes_nothing() {
    let config = tiny_gpt();
    let root = scratch("async-fail");
    let errors = run(2, |ctx| {
        let (state, chunks) = build(&ctx, &config, 2, 1)?;
        Checkpointer::new(&root).save(&state, &config, &chunks, None, &at(1))?;
        let mut checkpointer =
            AsyncCheckpointer::new(Checkpointer::new(&root).with_injected_failure(1));
        // The call itself succeeds: the failure happens on the writer thread.
        checkpointer.save(&state, &config, &chunks, None, &at(2))?;
        let finished = checkpointer.finish(&state);
        Ok(finished.err().map(|e| e.to_string()))
    });
    assert!(errors.iter().all(Option::is_some), "{errors:?}");
    let on_rank_1 = errors[1].as_ref().unwrap();
    assert!(
        on_rank_1.contains("injected failure on rank 1"),
        "{on_rank_1}"
    );
    assert!(!root.join("iter_0000002").exists());
    assert!(!root.join(".tmp.iter_0000002").exists());
    assert_eq!(
        latest_checkpoint(&root).unwrap(),
        Some(root.join("iter_0000001"))
    );
    fs::remove_dir_all(root).unwrap();
}

#[test]
fn dropping_waits_for_the_writer_and_leaves_the_previous_checkpoint_latest() {
    let config = tiny_gpt();
    let root = scratch("async-drop");
    run(1, |ctx| {
        let (state, chunks) = build(&ctx, &config, 1, 1)?;
        Checkpointer::new(&root).save(&state, &config, &chunks, None, &at(1))?;
        let mut checkpointer = AsyncCheckpointer::new(Checkpointer::new(&root));
        checkpointer.save(&state, &config, &chunks, None, &at(2))?;
        drop(checkpointer);
        // The writer had finished: its manifest is the last thing it writes.
        let tmp = root.join(".tmp.iter_0000002");
        assert!(tmp.join("rank_0.json").is_file());
        assert!(tmp.join("model_tp0_pp0.safetensors").is_file());
        assert_eq!(latest_checkpoint(&root)?, Some(root.join("iter_0000001")));
        // The next save removes the unpublished files.
        Checkpointer::new(&root).save(&state, &config, &chunks, None, &at(3))?;
        assert!(!tmp.exists());
        Ok(())
    });
    fs::remove_dir_all(root).unwrap();
}
