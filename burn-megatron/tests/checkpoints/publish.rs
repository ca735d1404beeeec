//! The publish protocol killed at each of its steps: a child process (this test binary, run
//! again with `BM_CKPT_CHILD` set) saves on two thread ranks and sends itself SIGKILL when the
//! publishing rank reaches the step; the parent then checks that the previous checkpoint (or
//! the new one, once renamed into place) loads, that `latest` names a complete checkpoint,
//! and that the next save succeeds and cleans up. For a first save, a later save, a re-save
//! of an existing iteration and an asynchronous save. Also: a stale `latest` is not trusted,
//! a failing step is an error on every rank (a failed re-save puts the old checkpoint back),
//! and a failing clean-up after publishing is one warning, not an error.

use std::fs;
use std::io;
use std::path::Path;
use std::process::{Command, Output};

use burn_megatron::checkpointing::{
    AsyncCheckpointer, Checkpoint, Checkpointer, LATEST_FILE, PublishStep, TrainingState,
    latest_checkpoint, list_checkpoints,
};

use crate::{AD, build, run, scratch, tiny_gpt};

/// The step at which the child kills itself (`PublishStep`'s name).
const KILL_AT: &str = "BM_CKPT_KILL_AT";
/// The step at which the child's hook returns an error.
const FAIL_AT: &str = "BM_CKPT_FAIL_AT";

/// What a save writes: its iteration and, to tell a re-save from the checkpoint it replaces,
/// its consumed samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Saved {
    iteration: u64,
    samples: u64,
}

const fn saved(iteration: u64, samples: u64) -> Saved {
    Saved { iteration, samples }
}

impl Saved {
    fn training(self) -> TrainingState {
        TrainingState {
            iteration: self.iteration,
            consumed_samples: self.samples,
            ..Default::default()
        }
    }
}

/// The child's hook: SIGKILL at `$BM_CKPT_KILL_AT`, an error at `$BM_CKPT_FAIL_AT`.
fn env_hook(step: PublishStep) -> io::Result<()> {
    let name = format!("{step:?}");
    if std::env::var(KILL_AT).ok().as_deref() == Some(name.as_str()) {
        let pid = std::process::id().to_string();
        let _ = Command::new("kill").args(["-KILL", &pid]).status();
        // Only if `kill` is missing: as abrupt, without the signal's name.
        std::process::abort();
    }
    if std::env::var(FAIL_AT).ok().as_deref() == Some(name.as_str()) {
        return Err(io::Error::other(format!("injected failure at {name}")));
    }
    Ok(())
}

/// How a save is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// `Checkpointer::save`.
    Sync,
    /// `AsyncCheckpointer::save`, then `finish` (which publishes).
    Async,
    /// `Checkpointer::save` without the atomic exchange of a re-saved directory (the
    /// fallback: the old directory renamed aside first).
    NoExchange,
}

/// Saves `what` under `root` on two thread ranks (TP = 2), keeping `keep`.
fn save(root: &Path, what: Saved, keep: usize) {
    save_with(root, what, keep, None, Mode::Sync);
}

fn save_with(
    root: &Path,
    what: Saved,
    keep: usize,
    hook: Option<fn(PublishStep) -> io::Result<()>>,
    mode: Mode,
) {
    let config = tiny_gpt();
    run(2, |ctx| {
        let (state, chunks) = build(&ctx, &config, 2, 1)?;
        let mut checkpointer = Checkpointer::new(root)
            .with_keep_last(keep)
            .with_exchange(mode != Mode::NoExchange);
        if let Some(hook) = hook {
            checkpointer = checkpointer.with_step_hook(hook);
        }
        let training = what.training();
        let dir = if mode == Mode::Async {
            let mut checkpointer = AsyncCheckpointer::<AD>::new(checkpointer);
            checkpointer.save(&state, &config, &chunks, None, &training)?;
            checkpointer.finish(&state)?.expect("a save in flight")
        } else {
            checkpointer.save(&state, &config, &chunks, None, &training)?
        };
        assert_eq!(dir, root.join(format!("iter_{:07}", what.iteration)));
        Ok(())
    });
}

/// The child: saves as its environment says (`BM_CKPT_CHILD` = root, iteration, samples,
/// keep, [`Mode`]), with [`env_hook`].
#[test]
#[ignore = "run by the publish tests in a child process"]
fn publish_child() {
    let Ok(spec) = std::env::var("BM_CKPT_CHILD") else {
        return;
    };
    let parts: Vec<&str> = spec.split('|').collect();
    let [root, iteration, samples, keep, mode] = parts[..] else {
        panic!("BM_CKPT_CHILD={spec:?}");
    };
    let what = saved(iteration.parse().unwrap(), samples.parse().unwrap());
    let mode = match mode {
        "Sync" => Mode::Sync,
        "Async" => Mode::Async,
        "NoExchange" => Mode::NoExchange,
        _ => panic!("mode {mode:?}"),
    };
    save_with(
        Path::new(root),
        what,
        keep.parse().unwrap(),
        Some(env_hook),
        mode,
    );
}

/// Runs [`publish_child`] in a child process saving `what` with `var=step` set.
fn child(root: &Path, what: Saved, keep: usize, mode: Mode, var: &str, step: &str) -> Output {
    let exe = std::env::current_exe().expect("the test binary's path");
    let spec = format!(
        "{}|{}|{}|{keep}|{mode:?}",
        root.display(),
        what.iteration,
        what.samples
    );
    Command::new(exe)
        .args([
            "--exact",
            "publish::publish_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
            "-q",
        ])
        .env("BM_CKPT_CHILD", spec)
        .env(var, step)
        .output()
        .expect("the child test process starts")
}

/// Saves `what` in a child process killed (by a signal) at `step`.
fn save_killed_at(root: &Path, what: Saved, keep: usize, mode: Mode, step: PublishStep) {
    let out = child(root, what, keep, mode, KILL_AT, &format!("{step:?}"));
    use std::os::unix::process::ExitStatusExt;
    assert!(
        out.status.signal().is_some(),
        "the save of {what:?} was not killed at {step:?} ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Checks what a reader sees under `root`: the newest complete checkpoint is `want` (`None`:
/// there is none) and loads whole; `latest`, if present, names a complete checkpoint (or,
/// only if `aside_window`, one whose checkpoint a re-save moved aside to `.old.<name>`).
fn check(root: &Path, want: Option<Saved>, aside_window: bool, context: &str) {
    let config = tiny_gpt();
    let found = latest_checkpoint(root).unwrap();
    if let Ok(name) = fs::read_to_string(root.join(LATEST_FILE)) {
        let complete = |dir: &str| root.join(dir).join("metadata.json").is_file();
        assert!(
            complete(&name)
                || (aside_window
                    && !root.join(&name).exists()
                    && complete(&format!(".old.{name}"))),
            "{context}: `latest` names {name:?}, not a complete checkpoint"
        );
    }
    let Some(want) = want else {
        assert_eq!(found, None, "{context}");
        assert!(Checkpoint::open_latest(root).is_err(), "{context}");
        return;
    };
    assert!(found.is_some(), "{context}: no checkpoint found");
    let got = run(1, |ctx| {
        let (_, chunks) = build(&ctx, &config, 1, 1)?;
        let checkpoint = Checkpoint::open_latest(root)?;
        checkpoint.check_config(&config)?;
        checkpoint.load_model(chunks.into_iter().next().unwrap())?;
        assert_eq!(Some(checkpoint.dir().to_path_buf()), found);
        let training = checkpoint.training_state();
        Ok(saved(training.iteration, training.consumed_samples))
    })[0];
    assert_eq!(got, want, "{context}");
}

/// The names of the entries of `root`.
fn entries(root: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// The checkpoint of `iteration` under `root`, as saved.
fn stored(root: &Path, iteration: u64) -> Saved {
    let dir = root.join(format!("iter_{iteration:07}"));
    let checkpoint = Checkpoint::open(dir).unwrap();
    let training = checkpoint.training_state();
    saved(training.iteration, training.consumed_samples)
}

/// The steps before the new checkpoint is renamed into place.
fn before_rename(step: PublishStep) -> bool {
    matches!(
        step,
        PublishStep::FilesWritten | PublishStep::MetadataWritten | PublishStep::OldMovedAside
    )
}

/// For each of `steps`: `setup` under a fresh root, `what` saved in a child killed at that
/// step, then the checks: `previous` (before the rename) or `what` (after it) is the newest
/// and loads, `latest` is consistent; a save at iteration 10 succeeds, is the newest, and
/// leaves only `iter_*` and `latest`; `kept(step)` (their iterations and samples) are the
/// checkpoints left after it but iteration 10.
fn kill_at_each_step(
    name: &str,
    setup: &[Saved],
    (what, keep, mode): (Saved, usize, Mode),
    steps: &[PublishStep],
    kept: impl Fn(PublishStep) -> Vec<Saved>,
) {
    let previous = setup.iter().copied().max_by_key(|s| s.iteration);
    for &step in steps {
        let root = scratch(&format!("{name}-{step:?}"));
        for &s in setup {
            save(&root, s, keep);
        }
        save_killed_at(&root, what, keep, mode, step);
        let left = entries(&root);
        let context = format!("{name}, killed at {step:?} (left {left:?})");
        if step == PublishStep::Renamed && setup.iter().any(|s| s.iteration == what.iteration) {
            // A re-save: the old directory was exchanged with the new one (into the temporary
            // directory's name), or renamed aside.
            let (exchanged, aside) = (
                format!(".tmp.iter_{:07}", what.iteration),
                format!(".old.iter_{:07}", what.iteration),
            );
            let expected = if mode == Mode::NoExchange || !cfg!(target_os = "linux") {
                aside
            } else {
                exchanged
            };
            assert!(left.contains(&expected), "{context}");
        }
        let want = if before_rename(step) {
            previous
        } else {
            Some(what)
        };
        check(&root, want, step == PublishStep::OldMovedAside, &context);

        let next = saved(10, 1000);
        save(&root, next, keep.max(setup.len() + 2));
        check(
            &root,
            Some(next),
            false,
            &format!("{context}, then saved at 10"),
        );
        assert_eq!(
            fs::read_to_string(root.join(LATEST_FILE)).unwrap(),
            "iter_0000010",
            "{context}"
        );
        let names = entries(&root);
        assert!(
            names
                .iter()
                .all(|n| n == LATEST_FILE || n.starts_with("iter_")),
            "{context}: left {names:?}"
        );
        let mut want = kept(step);
        want.push(next);
        let got: Vec<Saved> = list_checkpoints(&root)
            .unwrap()
            .into_iter()
            .map(|(i, _)| stored(&root, i))
            .collect();
        assert_eq!(got, want, "{context}: the checkpoints kept");
        fs::remove_dir_all(root).unwrap();
    }
}

const ALL_STEPS: [PublishStep; 7] = [
    PublishStep::FilesWritten,
    PublishStep::MetadataWritten,
    PublishStep::OldMovedAside,
    PublishStep::Renamed,
    PublishStep::LatestWritten,
    PublishStep::LatestUpdated,
    PublishStep::Discarding,
];

#[test]
fn a_first_save_killed_at_each_step_leaves_nothing_or_the_new_checkpoint() {
    // No re-save, nothing to discard: those steps are not reached.
    let steps: Vec<PublishStep> = ALL_STEPS
        .into_iter()
        .filter(|s| !matches!(s, PublishStep::OldMovedAside | PublishStep::Discarding))
        .collect();
    let what = saved(1, 100);
    kill_at_each_step("first", &[], (what, 3, Mode::Sync), &steps, |step| {
        if before_rename(step) {
            vec![]
        } else {
            vec![what]
        }
    });
}

#[test]
fn a_later_save_killed_at_each_step_leaves_the_previous_or_the_new_checkpoint() {
    // Keeping 1, the save discards the previous checkpoint once published.
    let steps: Vec<PublishStep> = ALL_STEPS
        .into_iter()
        .filter(|s| *s != PublishStep::OldMovedAside)
        .collect();
    let previous = saved(1, 100);
    let what = saved(2, 200);
    kill_at_each_step(
        "later",
        &[previous],
        (what, 1, Mode::Sync),
        &steps,
        |step| match step {
            _ if before_rename(step) => vec![previous],
            // Already moved to the trash: removed by the next save.
            PublishStep::Discarding => vec![what],
            // Not discarded yet; the next save keeps 3.
            _ => vec![previous, what],
        },
    );
}

#[test]
fn a_resave_killed_at_each_step_leaves_the_old_or_the_new_checkpoint() {
    let first = saved(1, 100);
    let old = saved(2, 200);
    let new = saved(2, 250);
    // With the atomic exchange (Linux) and without (the old directory renamed aside first).
    for (mode, steps) in [
        (Mode::Sync, &ALL_STEPS[..]),
        (Mode::NoExchange, &ALL_STEPS[..]),
    ] {
        let steps: Vec<PublishStep> = steps
            .iter()
            .copied()
            .filter(|s| mode == Mode::NoExchange || *s != PublishStep::OldMovedAside)
            .collect();
        kill_at_each_step(
            &format!("resave-{mode:?}"),
            &[first, old],
            (new, 3, mode),
            &steps,
            |step| vec![first, if before_rename(step) { old } else { new }],
        );
    }
}

#[test]
fn an_async_save_killed_at_each_step_leaves_the_previous_or_the_new_checkpoint() {
    let steps = [
        PublishStep::FilesWritten,
        PublishStep::MetadataWritten,
        PublishStep::Renamed,
        PublishStep::LatestUpdated,
    ];
    let previous = saved(1, 100);
    let what = saved(2, 200);
    kill_at_each_step(
        "async",
        &[previous],
        (what, 3, Mode::Async),
        &steps,
        |step| {
            if before_rename(step) {
                vec![previous]
            } else {
                vec![previous, what]
            }
        },
    );
}

#[test]
fn a_resave_moved_aside_is_loaded_and_put_back() {
    // What a re-save without the exchange leaves when killed between its two renames.
    let root = scratch("moved-aside");
    save(&root, saved(1, 100), 5);
    save(&root, saved(2, 200), 5);
    fs::rename(root.join("iter_0000002"), root.join(".old.iter_0000002")).unwrap();
    let found = list_checkpoints(&root).unwrap();
    assert_eq!(
        found,
        vec![
            (1, root.join("iter_0000001")),
            (2, root.join(".old.iter_0000002"))
        ]
    );
    check(&root, Some(saved(2, 200)), true, "moved aside");
    // The next save puts it back.
    save(&root, saved(3, 300), 5);
    assert_eq!(
        entries(&root),
        ["iter_0000001", "iter_0000002", "iter_0000003", "latest"]
    );
    assert_eq!(stored(&root, 2), saved(2, 200));
    fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_stale_or_dangling_latest_is_not_trusted() {
    let root = scratch("stale-latest");
    save(&root, saved(1, 100), 5);
    save(&root, saved(2, 200), 5);
    let latest = root.join(LATEST_FILE);
    // Older than the newest complete checkpoint (a save killed after its rename), naming a
    // missing or an incomplete directory, garbage, missing.
    fs::create_dir_all(root.join("iter_0000009")).unwrap();
    for content in [
        Some("iter_0000001"),
        Some("iter_0000008"),
        Some("iter_0000009"),
        Some("../elsewhere"),
        None,
    ] {
        match content {
            Some(c) => fs::write(&latest, c).unwrap(),
            None => fs::remove_file(&latest).unwrap(),
        }
        assert_eq!(
            latest_checkpoint(&root).unwrap(),
            Some(root.join("iter_0000002")),
            "latest = {content:?}"
        );
        let checkpoint = Checkpoint::open_latest(&root).unwrap();
        assert_eq!(checkpoint.training_state().iteration, 2, "{content:?}");
    }
    // The next save is a new iteration (no re-save of a newer one), and repairs `latest`.
    fs::write(&latest, "iter_0000001").unwrap();
    save(&root, saved(3, 300), 5);
    assert_eq!(fs::read_to_string(&latest).unwrap(), "iter_0000003");
    let kept: Vec<u64> = list_checkpoints(&root)
        .unwrap()
        .into_iter()
        .map(|(i, _)| i)
        .collect();
    assert_eq!(kept, vec![1, 2, 3]);
    // A directory without metadata is no checkpoint, and left alone.
    assert!(root.join("iter_0000009").is_dir());
    fs::remove_dir_all(root).unwrap();
}

fn fail_at_old_moved_aside(step: PublishStep) -> io::Result<()> {
    match step {
        PublishStep::OldMovedAside => Err(io::Error::other("injected failure")),
        _ => Ok(()),
    }
}

fn fail_at_renamed(step: PublishStep) -> io::Result<()> {
    match step {
        PublishStep::Renamed => Err(io::Error::other("injected failure")),
        _ => Ok(()),
    }
}

/// The error each of two ranks gets saving `what` under `root` with `hook`.
fn save_errors(
    root: &Path,
    what: Saved,
    hook: fn(PublishStep) -> io::Result<()>,
) -> Vec<Option<String>> {
    let config = tiny_gpt();
    run(2, |ctx| {
        let (state, chunks) = build(&ctx, &config, 2, 1)?;
        let saved = Checkpointer::new(root)
            .with_exchange(false)
            .with_step_hook(hook)
            .save(&state, &config, &chunks, None, &what.training());
        Ok(saved.err().map(|e| e.to_string()))
    })
}

#[test]
fn a_failing_step_is_an_error_on_every_rank_and_a_failed_resave_puts_the_old_one_back() {
    let root = scratch("failing-step");
    save(&root, saved(1, 100), 3);
    save(&root, saved(2, 200), 3);

    // A re-save (without the exchange) failing once the old directory is moved aside: the
    // old one is back.
    let errors = save_errors(&root, saved(2, 250), fail_at_old_moved_aside);
    assert!(errors.iter().all(Option::is_some), "{errors:?}");
    let on_rank_0 = errors[0].as_ref().unwrap();
    assert!(
        on_rank_0.contains(".old.iter_0000002") && on_rank_0.contains("injected failure"),
        "{on_rank_0}"
    );
    check(&root, Some(saved(2, 200)), false, "a failed re-save");
    assert_eq!(entries(&root), ["iter_0000001", "iter_0000002", "latest"]);

    // A failure once renamed (a sync, `latest`): an error, the new checkpoint in place.
    let errors = save_errors(&root, saved(3, 300), fail_at_renamed);
    assert!(errors.iter().all(Option::is_some), "{errors:?}");
    assert!(errors[0].as_ref().unwrap().contains("iter_0000003"));
    check(
        &root,
        Some(saved(3, 300)),
        false,
        "a failure after the rename",
    );
    fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_failing_clean_up_after_publishing_is_one_warning() {
    let root = scratch("failing-clean-up");
    save(&root, saved(1, 100), 5);
    save(&root, saved(2, 200), 5);
    // Keeping 1, the two older checkpoints are discarded, and both removals fail.
    let out = child(&root, saved(3, 300), 1, Mode::Sync, FAIL_AT, "Discarding");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stderr}", out.status);
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(warnings.len(), 1, "{stderr}");
    assert!(
        warnings[0].contains("iter_0000003")
            && warnings[0].contains("trash.iter_0000001")
            && warnings[0].contains("trash.iter_0000002")
            && warnings[0].contains("injected failure at Discarding"),
        "{}",
        warnings[0]
    );
    check(
        &root,
        Some(saved(3, 300)),
        false,
        "after the failed clean-up",
    );
    assert_eq!(
        fs::read_to_string(root.join(LATEST_FILE)).unwrap(),
        "iter_0000003"
    );
    // The next save removes what was left.
    save(&root, saved(4, 400), 1);
    assert_eq!(entries(&root), ["iter_0000004", "latest"]);
    fs::remove_dir_all(root).unwrap();
}
