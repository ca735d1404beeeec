//! Process ranks never wait forever on rank 0's rendezvous: a master that is down, hung,
//! killed, silent or speaking another protocol is an error naming it (its address, rank 0)
//! within the timeout plus a few seconds, and rank 0 does not wait forever for a silent rank.
//!
//! Timeouts are a few seconds so that the suite stays fast; each test bounds its own wait, so
//! a hang fails it instead of hanging the suite.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use burn_megatron_dist::{
    DistError, LaunchConfig, LaunchError, ProcessEnv, SpawnConfig, run_rank, spawn_ranks,
};

use crate::ranks::{free_port, quiet_port, rank_command, scratch_dir, within};

fn process_env(rank: usize, world_size: usize, port: u16) -> ProcessEnv {
    ProcessEnv {
        rank,
        world_size,
        local_rank: rank,
        master_addr: "127.0.0.1".into(),
        master_port: port,
    }
}

/// Rank 1 of 2 with `timeout`, doing one barrier; its error.
fn lone_rank(port: u16, timeout: Duration) -> LaunchError {
    let config = LaunchConfig::new(2).with_timeout(timeout);
    run_rank(&process_env(1, 2, port), config, |ctx| {
        ctx.world().barrier()
    })
    .unwrap_err()
}

#[test]
fn a_master_port_with_nothing_listening_is_named_within_seconds() {
    let port = quiet_port();
    let (error, took) = within(Duration::from_secs(30), move || {
        lone_rank(port, Duration::from_secs(3))
    });
    // The refused connection is retried for the 5 s a starting master may take, not a minute.
    assert!(took < Duration::from_secs(9), "took {took:?}: {error}");
    let message = error.to_string();
    assert!(
        message.contains(&format!(
            "rank 1: cannot reach rank 0's rendezvous at 127.0.0.1:{port}"
        )),
        "{message}"
    );
}

/// A master that starts a second after the other rank is still reached.
#[test]
fn a_master_that_starts_late_is_waited_for() {
    let port = free_port();
    let config = LaunchConfig::new(2).with_timeout(Duration::from_secs(10));
    let (sums, _) = within(Duration::from_secs(30), move || {
        let late_master = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(1));
            run_rank(&process_env(0, 2, port), config, |ctx| {
                ctx.world().barrier()
            })
        });
        let other = run_rank(&process_env(1, 2, port), config, |ctx| {
            ctx.world().barrier()
        });
        (late_master.join().unwrap(), other)
    });
    sums.0.unwrap();
    sums.1.unwrap();
}

/// Something listens (the kernel accepts the connection into the backlog) but never answers.
#[test]
fn a_master_that_accepts_and_never_answers_is_named_within_the_timeout() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let timeout = Duration::from_secs(2);
    let (error, took) = within(Duration::from_secs(30), move || {
        let _never_accepting = listener;
        lone_rank(port, timeout)
    });
    assert!(took < timeout + Duration::from_secs(5), "took {took:?}");
    let message = error.to_string();
    assert!(
        message.contains(&format!(
            "rank 1: rank 0's rendezvous at 127.0.0.1:{port} accepted the connection but did \
             not answer within 2s"
        )),
        "{message}"
    );
}

/// A peer that answers every request with a frame of 2^62 bytes (without the bound, the rank
/// would try to allocate them and abort).
#[test]
fn an_oversized_frame_is_an_error_naming_the_master() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                // Skip the request's header and payload, then answer with a huge length.
                for _ in 0..2 {
                    let mut len = [0u8; 8];
                    if stream.read_exact(&mut len).is_err() {
                        return;
                    }
                    let mut block = vec![0u8; u64::from_le_bytes(len).min(1 << 20) as usize];
                    let _ = stream.read_exact(&mut block);
                }
                let _ = stream.write_all(&(1u64 << 62).to_le_bytes());
                std::thread::sleep(Duration::from_secs(30));
            });
        }
    });
    let (error, _) = within(Duration::from_secs(30), move || {
        lone_rank(port, Duration::from_secs(2))
    });
    let message = error.to_string();
    assert!(
        message.contains(&format!("rank 0's rendezvous at 127.0.0.1:{port}")),
        "{message}"
    );
    assert!(
        message.contains("a frame announced a header of 4611686018427387904 bytes"),
        "{message}"
    );
}

/// Rank 0 finishes; rank 1 stays alive but silent (its closure waits, outside any collective):
/// rank 0 fails naming it once it has been silent for the timeout (+ 3 s), instead of
/// waiting for it forever.
#[test]
fn rank_0_gives_up_on_a_silent_rank() {
    let port = free_port();
    let timeout = Duration::from_secs(2);
    let config = LaunchConfig::new(2).with_timeout(timeout);
    let (release, released) = mpsc::channel::<()>();
    let silent = std::thread::spawn(move || {
        run_rank(&process_env(1, 2, port), config, move |_| {
            let _ = released.recv_timeout(Duration::from_secs(60));
            Ok::<_, DistError>(())
        })
    });
    let (error, took) = within(Duration::from_secs(30), move || {
        run_rank(&process_env(0, 2, port), config, |_| Ok::<_, DistError>(())).unwrap_err()
    });
    assert!(took < timeout + Duration::from_secs(8), "took {took:?}");
    assert_eq!(error.rank, 0);
    assert!(
        error.message.contains(
            "rank 0 finished, but ranks [1] have neither ended nor called the rendezvous for 5s"
        ),
        "{error}"
    );
    // Rank 1 ends normally once released (the rendezvous lives on in this test process).
    release.send(()).unwrap();
    silent.join().unwrap().unwrap();
}

/// The ranks of a `master_dies` launch: rank 0's time of death and, per other rank, how long
/// after it that rank ended and with what error.
fn others_after_master(dir: &Path, world: usize) -> Vec<(u128, String)> {
    let died: u128 = std::fs::read_to_string(dir.join("rank0"))
        .expect("rank 0 noted when it died")
        .parse()
        .unwrap();
    (1..world)
        .map(|rank| {
            let note = std::fs::read_to_string(dir.join(format!("rank{rank}")))
                .unwrap_or_else(|_| panic!("rank {rank} noted how it ended"));
            let (time, message) = note.split_once('\n').unwrap();
            (time.parse::<u128>().unwrap() - died, message.to_string())
        })
        .collect()
}

/// Three process ranks; after a barrier rank 0 kills or stops itself. The launch report, and
/// how the others ended.
fn master_dies(
    mode: &str,
    timeout: Duration,
) -> (burn_megatron_dist::SpawnReport, Vec<(u128, String)>, u16) {
    let dir = scratch_dir(mode);
    let (program, args) = rank_command(mode, &dir, timeout);
    let mut config = SpawnConfig::new(3);
    config.master_port = free_port();
    config.grace = Duration::from_secs(1);
    let port = config.master_port;
    let (report, _) = within(Duration::from_secs(60), move || {
        spawn_ranks(&config, &program, &args).expect("starting the ranks")
    });
    let others = others_after_master(&dir, 3);
    let _ = std::fs::remove_dir_all(&dir);
    (report, others, port)
}

#[test]
fn rank_0_killed_mid_run_is_named_by_the_others() {
    let timeout = Duration::from_secs(3);
    let (report, others, port) = master_dies("kill0", timeout);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        report.statuses[0].and_then(|s| s.signal()),
        Some(libc::SIGKILL),
        "{report:?}"
    );
    for (rank, (after_ms, message)) in others.iter().enumerate() {
        assert!(
            *after_ms < (timeout + Duration::from_secs(5)).as_millis(),
            "rank {}: {after_ms} ms: {message}",
            rank + 1
        );
        assert!(
            message.contains(&format!("lost rank 0's rendezvous at 127.0.0.1:{port}")),
            "rank {}: {message}",
            rank + 1
        );
    }
}

/// A stopped rank 0 sends nothing, not even a reset: the others' calls end by their deadline.
#[test]
fn rank_0_frozen_mid_run_is_named_by_the_others() {
    let timeout = Duration::from_secs(3);
    let (report, others, port) = master_dies("freeze0", timeout);
    // Rank 0 never ended by itself: the launcher killed it after the others failed.
    assert!(report.statuses[0].is_none(), "{report:?}");
    for (rank, (after_ms, message)) in others.iter().enumerate() {
        assert!(
            *after_ms < (timeout + Duration::from_secs(5)).as_millis(),
            "rank {}: {after_ms} ms: {message}",
            rank + 1
        );
        assert!(
            message.contains(&format!(
                "rank 0's rendezvous at 127.0.0.1:{port} did not answer"
            )),
            "rank {}: {message}",
            rank + 1
        );
    }
}
