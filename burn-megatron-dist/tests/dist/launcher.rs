//! The `bm-launch` command: launch variables, exit status, and no process left behind.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use burn_megatron_dist::{SpawnConfig, spawn_ranks};

use crate::ranks::{free_port, rank_command, scratch_dir, within};

fn bm_launch(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_bm-launch"))
        .args(args)
        .output()
        .expect("running bm-launch")
}

// ANCHOR: launch_variables
#[test]
fn sets_the_launch_variables_of_each_rank() {
    let script = r#"test "$WORLD_SIZE" = 6 && test "$LOCAL_WORLD_SIZE" = 3 \
        && test "$RANK" = $((3 + LOCAL_RANK)) && test "$MASTER_ADDR:$MASTER_PORT" = "10.0.0.1:1234""#;
    let out = bm_launch(&[
        "--nproc-per-node=3",
        "--nnodes=2",
        "--node-rank=1",
        "--master-addr=10.0.0.1",
        "--master-port=1234",
        "--",
        "sh",
        "-c",
        script,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
// ANCHOR_END: launch_variables

/// Rank 1 fails at once; rank 0 would run for 60 s and is killed after the 1 s grace.
#[test]
fn a_failed_rank_fails_the_launch_and_the_others_are_killed() {
    let start = Instant::now();
    let out = bm_launch(&[
        "--nproc-per-node=2",
        "--grace-secs=1",
        "--",
        "sh",
        "-c",
        r#"if [ "$RANK" = 1 ]; then exit 7; fi; sleep 60"#,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("rank 1 failed first"), "{stderr}");
    assert!(
        stderr.contains("rank 0: killed after the grace period"),
        "{stderr}"
    );
    assert!(start.elapsed() < Duration::from_secs(20));
}

#[test]
fn bad_options_are_refused() {
    let out = bm_launch(&["--nnodes=2", "--node-rank=2", "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--node-rank 2 must be below"));
    let out = bm_launch(&["--nproc-per-node=1", "--", "/nonexistent/program"]);
    assert_eq!(out.status.code(), Some(2));
}

/// SIGTERM to the launcher kills every rank with what it started (their output pipe closes).
#[test]
fn a_signal_to_the_launcher_kills_every_rank() {
    let start = Instant::now();
    let child = Command::new(env!("CARGO_BIN_EXE_bm-launch"))
        .args([
            "--nproc-per-node=2",
            "--",
            "sh",
            "-c",
            "sleep 60; echo late",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: signals our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130));
    assert!(String::from_utf8_lossy(&out.stderr).contains("interrupted"));
    assert!(out.stdout.is_empty());
    assert!(start.elapsed() < Duration::from_secs(20));
}

/// Whether process `pid` still runs (a zombie, dead but not yet reaped, does not).
fn running(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // `pid (comm) state …`: the state follows the last parenthesis.
    let state = stat.rsplit_once(") ").map(|(_, rest)| rest.chars().next());
    !matches!(state, Some(Some('Z' | 'X')))
}

/// A launcher killed with SIGKILL (no handler runs) takes its ranks with it.
#[cfg(target_os = "linux")]
#[test]
fn ranks_die_with_a_killed_launcher() {
    let dir = scratch_dir("orphans");
    let script = format!("echo $$ > {}/pid.$RANK; exec sleep 60", dir.display());
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_bm-launch"))
        .args(["--nproc-per-node=2", "--", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let read_pid = |rank: usize| -> Option<i32> {
        let pid = std::fs::read_to_string(dir.join(format!("pid.{rank}"))).ok()?;
        pid.trim().parse().ok()
    };
    let started = Instant::now();
    let pids = loop {
        if let (Some(a), Some(b)) = (read_pid(0), read_pid(1)) {
            break [a, b];
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the ranks did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    // Both have exec'd `sleep` (its pid is the shell's).
    std::thread::sleep(Duration::from_millis(200));
    // SAFETY: signals our own child.
    unsafe { libc::kill(launcher.id() as libc::pid_t, libc::SIGKILL) };
    launcher.wait().unwrap();
    let killed = Instant::now();
    while pids.iter().any(|&pid| running(pid)) && killed.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let orphans: Vec<i32> = pids.into_iter().filter(|&pid| running(pid)).collect();
    for &pid in &orphans {
        // SAFETY: cleans up the test's own grandchildren.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        orphans.is_empty(),
        "ranks {orphans:?} outlived their launcher"
    );
}

/// Rank 1 fails on the first attempt: rank 0 is killed after the grace period, both start
/// again with the attempt in their variables, and the launch succeeds.
#[test]
fn a_failed_rank_restarts_every_rank() {
    let dir = scratch_dir("restarts");
    let script = format!(
        r#"echo "$BM_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT $BM_MAX_RESTARTS $TORCHELASTIC_MAX_RESTARTS" >> {}/log.$RANK
        if [ "$BM_RESTART_COUNT" = 0 ]; then
            if [ "$RANK" = 1 ]; then exit 3; fi
            exec sleep 60
        fi"#,
        dir.display()
    );
    let start = Instant::now();
    let out = bm_launch(&[
        "--nproc-per-node=2",
        "--grace-secs=1",
        "--max-restarts=2",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "bm-launch: rank 1 failed (exit status: 3); every rank was stopped, restarting all \
             (restart 1 of 2)"
        ),
        "{stderr}"
    );
    assert_eq!(stderr.matches("restarting all").count(), 1, "{stderr}");
    for rank in 0..2 {
        let log = std::fs::read_to_string(dir.join(format!("log.{rank}"))).unwrap();
        assert_eq!(log, "0 0 2 2\n1 1 2 2\n", "rank {rank}");
    }
    assert!(start.elapsed() < Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rank that always fails: the first attempt and two restarts, then the launch fails.
#[test]
fn restarts_stop_at_the_maximum() {
    let out = bm_launch(&[
        "--nproc-per-node=2",
        "--grace-secs=1",
        "--max-restarts=2",
        "--",
        "sh",
        "-c",
        r#"if [ "$RANK" = 0 ]; then kill -9 $$; fi"#,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("rank 0 failed (signal: 9 (SIGKILL)); every rank was stopped"),
        "{stderr}"
    );
    assert!(stderr.contains("(restart 2 of 2)"), "{stderr}");
    assert!(!stderr.contains("(restart 3"), "{stderr}");
    assert!(
        stderr.contains("rank 0 failed first (ended with signal: 9 (SIGKILL), after 2 restarts)"),
        "{stderr}"
    );
}

/// Process ranks on the rendezvous: rank 1 dies on the first attempt (the others are released
/// by the news), and the second attempt, on the same port, completes an all-reduce.
#[test]
fn process_ranks_restart_after_a_crash() {
    let dir = scratch_dir("rank_restarts");
    let (program, args) = rank_command("restart", &dir, Duration::from_secs(10));
    let mut config = SpawnConfig::new(3);
    config.master_port = free_port();
    config.grace = Duration::from_secs(5);
    config.max_restarts = 1;
    let (report, _) = within(Duration::from_secs(90), move || {
        spawn_ranks(&config, &program, &args).expect("starting the ranks")
    });
    assert!(report.success(), "{report:?}");
    // One restart, caused by a failed rank: rank 1, or a peer it released that the launcher
    // saw end in the same poll.
    assert_eq!(report.restarts.len(), 1, "{report:?}");
    let (_, status) = report.restarts[0];
    assert!(status.is_some_and(|s| !s.success()), "{report:?}");
    // On the first attempt, rank 1 died without a note, and the others named it.
    assert!(!dir.join("attempt0-rank1").exists());
    for rank in [0, 2] {
        let note = std::fs::read_to_string(dir.join(format!("attempt0-rank{rank}"))).unwrap();
        assert!(
            note.starts_with("elastic 0 failed:")
                && note.contains("rank 1 ended without reporting"),
            "rank {rank}: {note}"
        );
    }
    for rank in 0..3 {
        let note = std::fs::read_to_string(dir.join(format!("attempt1-rank{rank}"))).unwrap();
        assert_eq!(note, "elastic 1 sum 3", "rank {rank}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
