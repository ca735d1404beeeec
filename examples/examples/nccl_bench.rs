//! Bus bandwidth of `ProcessGroup` collectives over NCCL on our CUDA backend, from 8 KiB to
//! 1 GiB, after a correctness check. Ranks are threads (one per GPU) or, under `bm-launch`,
//! processes. Run next to `bench/torch_nccl.py` in the same device call:
//!
//!     ../shared/gpu/pack build --release --features cuda --example nccl_bench
//!     source .gpu/env.sh && .gpu/bin/nccl_bench                        # thread ranks
//!     .gpu/bin/bm-launch --nproc-per-node 2 -- .gpu/bin/nccl_bench     # process ranks
//!     torchrun --nproc-per-node 2 bench/torch_nccl.py
//!
//! `--checks` turns on the host-side matching of each collective (off here, as in torch).

use std::time::{Duration, Instant};

use burn::tensor::{DType, Tensor};
use burn_megatron_dist::{
    DistError, LaunchConfig, ProcessEnv, RankContext, ReduceOp, launch, run_rank,
};
use burn_megatron_kernels::cuda::{CudaGpu, MegatronCuda};

#[derive(Clone, Copy, Debug)]
enum Op {
    AllReduce,
    AllGather,
    ReduceScatter,
}

fn main() {
    let checks = std::env::args().any(|a| a == "--checks");
    let config = |world| {
        LaunchConfig::new(world)
            .with_timeout(Duration::from_secs(120))
            .with_collective_checks(checks)
    };
    let outcome = match ProcessEnv::from_env() {
        Ok(env) => run_rank(&env, config(env.world_size), |ctx| {
            bench(&ctx, "process", checks)
        })
        .map(|_| ()),
        Err(_) => {
            let world = cudarc::driver::CudaContext::device_count().expect("CUDA") as usize;
            assert!(world >= 2, "needs at least two GPUs, found {world}");
            launch(config(world), |ctx| bench(&ctx, "thread", checks)).map(|_| ())
        }
    };
    if let Err(e) = outcome {
        eprintln!("nccl_bench failed: {e}");
        std::process::exit(1);
    }
}

fn bench(ctx: &RankContext, ranks: &str, checks: bool) -> Result<(), DistError> {
    let (rank, world) = (ctx.rank(), ctx.world_size());
    let gpu = CudaGpu::new(ctx.local_rank());
    let group = ctx.world();

    // Correctness: each rank contributes rank + 1.
    let x = Tensor::<MegatronCuda, 1>::full([1 << 20], (rank + 1) as f32, &gpu);
    let expected = (world * (world + 1) / 2) as f32;
    let sum: Vec<f32> = group
        .all_reduce(x.clone(), ReduceOp::Sum)?
        .into_data()
        .to_vec()
        .unwrap();
    assert!(
        sum.iter().all(|&v| v == expected),
        "all_reduce gave {}",
        sum[0]
    );
    let gathered: Vec<f32> = group
        .all_gather(x.clone().narrow(0, 0, 4), 0)?
        .into_data()
        .to_vec()
        .unwrap();
    assert!(
        (0..world).all(|r| gathered[4 * r] == (r + 1) as f32),
        "all_gather order"
    );
    let scattered: Vec<f32> = group
        .reduce_scatter(x, 0, ReduceOp::Sum)?
        .into_data()
        .to_vec()
        .unwrap();
    assert!(scattered.iter().all(|&v| v == expected) && scattered.len() == (1 << 20) / world);
    if rank == 0 {
        println!("== ProcessGroup over NCCL: {world} {ranks} ranks, collective checks {checks} ==");
        println!(
            "{:<15} {:<5} {:>10} {:>12} {:>12}",
            "collective", "dtype", "size", "time (µs)", "busbw (GB/s)"
        );
    }

    for op in [Op::AllReduce, Op::AllGather, Op::ReduceScatter] {
        for dtype in [DType::F32, DType::BF16] {
            for bytes in [8usize << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30] {
                let elements = bytes / dtype.size();
                // The "size" is the full buffer: all-reduce's, all-gather's output,
                // reduce-scatter's input.
                let input_len = match op {
                    Op::AllGather => elements / world,
                    _ => elements,
                };
                let x = Tensor::<MegatronCuda, 1>::ones([input_len], &gpu).cast(dtype);
                // All-reduce in place (`y = all_reduce(y)`), as torch's `all_reduce(x)`; the
                // others into new buffers (torch's into preallocated ones).
                let mut y = Some(x.clone());
                let mut once = || match op {
                    Op::AllReduce => {
                        let reduced = group.all_reduce(y.take().expect("y"), ReduceOp::Sum)?;
                        y = Some(reduced);
                        Ok(())
                    }
                    Op::AllGather => group.all_gather(x.clone(), 0).map(|_| ()),
                    Op::ReduceScatter => group
                        .reduce_scatter(x.clone(), 0, ReduceOp::Sum)
                        .map(|_| ()),
                };
                let iterations = if bytes >= 256 << 20 { 50 } else { 100 };
                // Warm up as long as we measure: the memory pool grows to what this many calls
                // in flight need (a training loop gets there in its first step).
                for _ in 0..iterations {
                    once()?;
                }
                group.synchronize()?;
                group.barrier()?;
                let start = Instant::now();
                for _ in 0..iterations {
                    once()?;
                }
                group.synchronize()?;
                let seconds = start.elapsed().as_secs_f64() / iterations as f64;
                let n = world as f64;
                let factor = match op {
                    Op::AllReduce => 2.0 * (n - 1.0) / n,
                    _ => (n - 1.0) / n,
                };
                if rank == 0 {
                    let size = if bytes >= 1 << 20 {
                        format!("{} MiB", bytes >> 20)
                    } else {
                        format!("{} KiB", bytes >> 10)
                    };
                    println!(
                        "{:<15} {:<5} {:>10} {:>12.1} {:>12.1}",
                        format!("{op:?}"),
                        format!("{dtype:?}"),
                        size,
                        seconds * 1e6,
                        bytes as f64 * factor / seconds / 1e9
                    );
                }
                group.barrier()?;
            }
        }
    }
    Ok(())
}
