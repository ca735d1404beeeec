//! The `bm-launch` command: launch variables, exit status, and no process left behind.

use std::process::Command;
use std::time::{Duration, Instant};

fn bm_launch(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_bm-launch"))
        .args(args)
        .output()
        .expect("running bm-launch")
}

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
