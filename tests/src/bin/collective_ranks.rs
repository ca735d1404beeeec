//! One rank of a multi-process collective check, started by `bm-launch` (or `spawn_ranks`):
//!
//! ```text
//! bm-launch --nproc-per-node 2 -- collective_ranks suite [--cuda]
//! ```
//!
//! Modes: `suite` runs the collective suite; `crash` has rank 1 die before the first
//! collective, and the others must report that it crashed; `sleep` (with `--cuda`) has rank 1
//! sleep past the timeout, and the others must return the watchdog's timeout error within
//! timeout + 5 s. Exits 0 when the rank saw what it should.

use std::process::ExitCode;
use std::time::Duration;
#[cfg(feature = "cuda")]
use std::time::Instant;

use burn::backend::NdArray;
use burn::tensor::{DType, Tensor};
use burn_megatron_dist::{LaunchConfig, ProcessEnv, RankContext, ReduceOp, run_rank};
use burn_megatron_tests::collective_suite::Suite;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args
        .first()
        .map(String::as_str)
        .unwrap_or("suite")
        .to_string();
    let cuda = args.iter().any(|a| a == "--cuda");
    let timeout_ms = args
        .iter()
        .find_map(|a| a.strip_prefix("--timeout-ms="))
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let timeout = Duration::from_millis(timeout_ms);
    let env = match ProcessEnv::from_env() {
        Ok(env) => env,
        Err(e) => {
            eprintln!("collective_ranks: {e}");
            return ExitCode::from(2);
        }
    };
    let rank = env.rank;
    // BM_CHECK_COLLECTIVES=0 sends GPU collectives straight to NCCL.
    let checks = std::env::var("BM_CHECK_COLLECTIVES").map_or(true, |v| v != "0")
        && !args.iter().any(|a| a == "--no-checks");
    let config = LaunchConfig::new(env.world_size)
        .with_timeout(timeout)
        .with_collective_checks(checks);
    let outcome = run_rank(&env, config, |ctx| match (mode.as_str(), cuda) {
        ("suite", false) => cpu_suite(&ctx),
        ("suite", true) => gpu_suite(&ctx),
        ("crash", false) => crash(&ctx),
        ("crash", true) => crash_gpu(&ctx, timeout),
        ("sleep", true) => sleep(&ctx, timeout),
        _ => Err(format!("unknown mode {mode:?} (cuda: {cuda})")),
    });
    match outcome {
        Ok(report) => {
            println!("rank {rank}: ok: {report}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("rank {rank}: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

fn cpu_suite(ctx: &RankContext) -> Result<String, String> {
    let device = Default::default();
    let cases = Suite::<NdArray>::new(ctx, &device, DType::F64)
        .run()
        .map_err(|e| e.to_string())?;
    Ok(format!(
        "{cases} cases passed on {} CPU process ranks",
        ctx.world_size()
    ))
}

#[cfg(feature = "cuda")]
fn gpu_suite(ctx: &RankContext) -> Result<String, String> {
    use burn_megatron_kernels::cuda::{CudaGpu, MegatronCuda};
    let device = CudaGpu::new(ctx.local_rank());
    let mut cases = 0;
    for dtype in [DType::BF16, DType::F16] {
        let suite = Suite::<MegatronCuda>::new(ctx, &device, dtype);
        let suite = match std::env::args().any(|a| a == "--no-checks") {
            true => suite.equal_shards_only(),
            false => suite,
        };
        cases += suite.run().map_err(|e| e.to_string())?;
    }
    Ok(format!(
        "{cases} cases passed over NCCL on {} process ranks",
        ctx.world_size()
    ))
}

#[cfg(not(feature = "cuda"))]
fn gpu_suite(_: &RankContext) -> Result<String, String> {
    Err("built without the cuda feature".into())
}

/// Rank 1 dies before the first collective; the others must say so.
fn crash(ctx: &RankContext) -> Result<String, String> {
    if ctx.rank() == 1 {
        std::process::exit(3);
    }
    let x = Tensor::<NdArray, 1>::from_floats([1.0], &Default::default());
    match ctx.world().all_reduce(x, ReduceOp::Sum) {
        Err(e) if e.to_string().contains("rank 1 ended without reporting") => {
            Ok(format!("saw: {e}"))
        }
        other => Err(format!(
            "expected the news of rank 1's crash, got {other:?}"
        )),
    }
}

/// A GPU tensor, after a first collective that created the communicator on every rank.
#[cfg(feature = "cuda")]
fn after_first_collective(
    ctx: &RankContext,
) -> Result<Tensor<burn_megatron_kernels::cuda::MegatronCuda, 1>, String> {
    use burn_megatron_kernels::cuda::CudaGpu;
    let x = Tensor::ones([1 << 20], &CudaGpu::new(ctx.local_rank()));
    let world = ctx.world();
    world
        .all_reduce(x.clone(), ReduceOp::Sum)
        .and_then(|_| world.synchronize())
        .map_err(|e| e.to_string())?;
    Ok(x)
}

/// An all-reduce and the wait for it, with how long they took.
#[cfg(feature = "cuda")]
fn timed_all_reduce(
    ctx: &RankContext,
    x: Tensor<burn_megatron_kernels::cuda::MegatronCuda, 1>,
) -> (Result<(), burn_megatron_dist::DistError>, Duration) {
    let start = Instant::now();
    let world = ctx.world();
    let outcome = world
        .all_reduce(x, ReduceOp::Sum)
        .and_then(|_| world.synchronize());
    (outcome, start.elapsed())
}

#[cfg(feature = "cuda")]
fn sleep(ctx: &RankContext, timeout: Duration) -> Result<String, String> {
    let x = after_first_collective(ctx)?;
    if ctx.rank() == 1 {
        std::thread::sleep(timeout + Duration::from_secs(8));
        return Ok("slept".into());
    }
    let (outcome, elapsed) = timed_all_reduce(ctx, x);
    match outcome {
        Err(e)
            if e.to_string().contains("timed out")
                && elapsed < timeout + Duration::from_secs(5) =>
        {
            Ok(format!(
                "timeout error after {elapsed:?} (timeout {timeout:?}): {e}"
            ))
        }
        other => Err(format!(
            "expected a timeout error within timeout + 5 s, got {other:?} after {elapsed:?}"
        )),
    }
}

/// Rank 1's process dies after a first GPU collective; rank 0's next one must fail with the
/// news, well before the timeout.
#[cfg(feature = "cuda")]
fn crash_gpu(ctx: &RankContext, timeout: Duration) -> Result<String, String> {
    let x = after_first_collective(ctx)?;
    if ctx.rank() == 1 {
        std::process::exit(3);
    }
    let (outcome, elapsed) = timed_all_reduce(ctx, x);
    match outcome {
        Err(e) if e.to_string().contains("crashed or was killed") && elapsed < timeout / 2 => Ok(
            format!("error after {elapsed:?} (timeout {timeout:?}): {e}"),
        ),
        other => Err(format!(
            "expected the news of rank 1's crash, got {other:?} after {elapsed:?}"
        )),
    }
}

#[cfg(not(feature = "cuda"))]
fn crash_gpu(_: &RankContext, _: Duration) -> Result<String, String> {
    Err("built without the cuda feature".into())
}

#[cfg(not(feature = "cuda"))]
fn sleep(_: &RankContext, _: Duration) -> Result<String, String> {
    Err("built without the cuda feature".into())
}
