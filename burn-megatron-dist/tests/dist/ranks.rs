//! Rank programs for the tests that need real processes: this test binary, started again
//! with `BM_TEST_RANK_MODE` set, runs [`rank_program`] as one rank of a launch (the ignored
//! test does nothing when the variable is unset).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use burn::tensor::Tensor;
use burn_megatron_dist::{DistError, LaunchConfig, ProcessEnv, ReduceOp, run_rank};

use crate::B;

/// `program, args` that run this binary as a rank in `mode`, writing what it saw under `out`,
/// with collective timeout `timeout` (`env` sets the variables and execs, so the rank's pid is
/// the one the launcher started).
pub fn rank_command(mode: &str, out: &Path, timeout: Duration) -> (String, Vec<String>) {
    let exe = std::env::current_exe().expect("the test binary's path");
    let args = [
        format!("BM_TEST_RANK_MODE={mode}"),
        format!("BM_TEST_OUT={}", out.display()),
        format!("BM_TEST_TIMEOUT_MS={}", timeout.as_millis()),
        exe.display().to_string(),
        "--exact".into(),
        "ranks::rank_program".into(),
        "--ignored".into(),
        "--nocapture".into(),
        "--test-threads=1".into(),
        "-q".into(),
    ];
    ("env".into(), args.to_vec())
}

/// A fresh directory for one test's files.
pub fn scratch_dir(test: &str) -> PathBuf {
    burn_megatron_testing::scratch_dir("bm-dist", test)
}

/// A port nothing listens on (just released by the OS).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A port nothing listens on and that no test's `bind(":0")` can be handed while it is used:
/// one below the kernel's ephemeral range (where [`free_port`]'s come from), free when
/// checked. A port from [`free_port`] may be handed again to a parallel test that listens on
/// it, and then a connection to it is accepted instead of refused.
pub fn quiet_port() -> u16 {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let low = ephemeral_low.saturating_sub(8000).max(1024);
    let span = ephemeral_low - low;
    let start = (std::process::id() as u16).wrapping_mul(7) % span;
    (0..span)
        .map(|i| low + (start + i) % span)
        .find(|&port| TcpListener::bind(("127.0.0.1", port)).is_ok())
        .expect("a free port below the ephemeral range")
}

/// Runs `f` on a thread and returns its result and how long it took, failing the test if it
/// has not ended within `limit`.
pub fn within<T: Send + 'static>(
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> (T, Duration) {
    let (done, result) = mpsc::channel();
    let start = Instant::now();
    std::thread::spawn(move || {
        let _ = done.send(f());
    });
    match result.recv_timeout(limit) {
        Ok(value) => (value, start.elapsed()),
        Err(_) => panic!("did not end within {limit:?}"),
    }
}

/// Milliseconds since the epoch: a clock all processes share.
pub fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("a clock after 1970")
        .as_millis()
}

#[test]
#[ignore = "a rank program, started by the process tests"]
fn rank_program() {
    let Ok(mode) = std::env::var("BM_TEST_RANK_MODE") else {
        return;
    };
    let var = |name: &str| std::env::var(name).unwrap_or_default();
    let out = PathBuf::from(var("BM_TEST_OUT"));
    let timeout = Duration::from_millis(var("BM_TEST_TIMEOUT_MS").parse().unwrap_or(3000));
    let env = ProcessEnv::from_env().expect("launch variables");
    let config = LaunchConfig::new(env.world_size).with_timeout(timeout);
    let code = match mode.as_str() {
        "kill0" | "freeze0" => master_dies(&env, config, &mode, &out),
        "restart" => fails_once(&env, config, &out),
        _ => panic!("unknown mode {mode:?}"),
    };
    std::process::exit(code);
}

/// After a first barrier, rank 0 kills (`kill0`) or stops (`freeze0`) itself, noting when in
/// `rank0`; the others call barriers until one fails, and note when and why in `rank<r>`.
fn master_dies(env: &ProcessEnv, config: LaunchConfig, mode: &str, out: &Path) -> i32 {
    let rank = env.rank;
    let outcome = run_rank(env, config, |ctx| -> Result<(), DistError> {
        ctx.world().barrier()?;
        if rank == 0 {
            std::fs::write(out.join("rank0"), now_ms().to_string()).unwrap();
            let signal = match mode {
                "kill0" => libc::SIGKILL,
                _ => libc::SIGSTOP,
            };
            // SAFETY: signals this process.
            unsafe { libc::raise(signal) };
        }
        loop {
            ctx.world().barrier()?;
        }
    });
    let message = match outcome {
        Ok(()) => "finished".to_string(),
        Err(e) => e.to_string(),
    };
    std::fs::write(
        out.join(format!("rank{rank}")),
        format!("{}\n{message}", now_ms()),
    )
    .unwrap();
    1
}

/// Rank 1 dies on the first attempt (`BM_RESTART_COUNT` 0), after a barrier; on a later
/// attempt every rank all-reduces its rank and notes the restart variables and the sum in
/// `attempt<n>-rank<r>`.
fn fails_once(env: &ProcessEnv, config: LaunchConfig, out: &Path) -> i32 {
    let attempt: usize = std::env::var("BM_RESTART_COUNT")
        .expect("BM_RESTART_COUNT is set")
        .parse()
        .unwrap();
    let elastic = std::env::var("TORCHELASTIC_RESTART_COUNT").unwrap_or_default();
    let outcome = run_rank(env, config, |ctx| -> Result<f32, DistError> {
        ctx.world().barrier()?;
        if attempt == 0 && ctx.rank() == 1 {
            std::process::exit(3);
        }
        let x = Tensor::<B, 1>::from_floats([ctx.rank() as f32], &Default::default());
        Ok(ctx.world().all_reduce(x, ReduceOp::Sum)?.into_scalar())
    });
    let line = match &outcome {
        Ok(sum) => format!("elastic {elastic} sum {sum}"),
        Err(e) => format!("elastic {elastic} failed: {e}"),
    };
    std::fs::write(out.join(format!("attempt{attempt}-rank{}", env.rank)), line).unwrap();
    i32::from(outcome.is_err())
}
