//! The collective suite on CPU ranks: threads of one process, and processes over TCP.

use std::net::TcpListener;
use std::time::Duration;

use burn::backend::NdArray;
use burn::tensor::DType;
use burn_megatron_dist::{LaunchConfig, SpawnConfig, launch, spawn_ranks};
use burn_megatron_tests::collective_suite::Suite;

#[test]
fn suite_passes_on_thread_ranks() {
    for n in [1, 2, 4] {
        let config = LaunchConfig::new(n).with_timeout(Duration::from_secs(20));
        let cases = launch(config, |ctx| {
            Suite::<NdArray>::new(&ctx, &Default::default(), DType::F64).run()
        })
        .unwrap_or_else(|e| panic!("world of {n}: {e}"));
        assert_eq!(cases, vec![10; n]);
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

fn spawn(nproc: usize, mode: &str) -> burn_megatron_dist::SpawnReport {
    let mut config = SpawnConfig::new(nproc);
    config.master_port = free_port();
    config.grace = Duration::from_secs(30);
    let program = env!("CARGO_BIN_EXE_collective_ranks");
    spawn_ranks(&config, program, &[mode.to_string()]).expect("starting the ranks")
}

#[test]
fn suite_passes_on_process_ranks() {
    for nproc in [2, 4] {
        let report = spawn(nproc, "suite");
        assert!(report.success(), "{nproc} processes: {report:?}");
    }
}

/// Rank 1's process dies before a collective: rank 0 is released with an error that says so
/// (its process checks the message and exits 0), and no process is left behind.
#[test]
fn a_crashed_process_releases_its_peers() {
    let report = spawn(2, "crash");
    let codes: Vec<_> = report
        .statuses
        .iter()
        .map(|s| s.and_then(|s| s.code()))
        .collect();
    assert_eq!(codes, vec![Some(0), Some(3)], "{report:?}");
    assert_eq!(report.first_failure.map(|f| f.0), Some(1));
}
