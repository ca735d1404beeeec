//! NCCL collectives on our CUDA backend (foreign operations on Burn's buffers), one thread per
//! GPU: a correctness check, then bus bandwidth from 8 KiB to 1 GiB. Run next to
//! `bench/torch_nccl.py` in the same device call on a machine with two or more GPUs:
//!
//!     ../shared/gpu/pack build --release --features cuda --example nccl_bench
//!     source .gpu/env.sh && .gpu/bin/nccl_bench
//!     torchrun --nproc-per-node 2 bench/torch_nccl.py

use std::sync::Barrier;
use std::time::Instant;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_megatron_dist::ReduceOp;
use burn_megatron_dist::nccl::{NcclCommunicator, NcclId};
use burn_megatron_kernels::cuda::{CudaGpu, MegatronCuda};

#[derive(Clone, Copy, Debug)]
enum Op {
    AllReduce,
    AllGather,
    ReduceScatter,
}

fn main() {
    let world = cudarc::driver::CudaContext::device_count().expect("CUDA") as usize;
    assert!(world >= 2, "needs at least two GPUs, found {world}");
    let id = NcclId::new().expect("NCCL");
    let barrier = Barrier::new(world);
    std::thread::scope(|scope| {
        for rank in 0..world {
            let barrier = &barrier;
            scope.spawn(move || run(rank, world, id, barrier));
        }
    });
}

fn run(rank: usize, world: usize, id: NcclId, barrier: &Barrier) {
    let gpu = CudaGpu::new(rank);
    let comm = NcclCommunicator::new(&gpu, id, rank, world).expect("ncclCommInitRank");
    let sync = || <MegatronCuda as Backend>::sync(&gpu).expect("sync");

    // Correctness: each rank contributes rank + 1.
    let x = Tensor::<MegatronCuda, 1>::full([1 << 20], (rank + 1) as f32, &gpu);
    let sum: Vec<f32> = comm
        .all_reduce(x.clone(), ReduceOp::Sum)
        .unwrap()
        .into_data()
        .to_vec()
        .unwrap();
    let expected = (world * (world + 1) / 2) as f32;
    assert!(
        sum.iter().all(|&v| v == expected),
        "all_reduce gave {} instead of {expected}",
        sum[0]
    );
    let gathered: Vec<f32> = comm
        .all_gather(x.clone().narrow(0, 0, 4))
        .unwrap()
        .into_data()
        .to_vec()
        .unwrap();
    assert_eq!(gathered.len(), 4 * world);
    assert!(
        (0..world).all(|r| gathered[4 * r] == (r + 1) as f32),
        "all_gather order"
    );
    let scattered: Vec<f32> = comm
        .reduce_scatter(x, ReduceOp::Sum)
        .unwrap()
        .into_data()
        .to_vec()
        .unwrap();
    assert!(scattered.iter().all(|&v| v == expected) && scattered.len() == (1 << 20) / world);
    if rank == 0 {
        println!("correct: all_reduce, all_gather, reduce_scatter over {world} GPUs");
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
                let once = || match op {
                    Op::AllReduce => comm.all_reduce(x.clone(), ReduceOp::Sum).unwrap(),
                    Op::AllGather => comm.all_gather(x.clone()).unwrap(),
                    Op::ReduceScatter => comm.reduce_scatter(x.clone(), ReduceOp::Sum).unwrap(),
                };
                let iterations = if bytes >= 256 << 20 { 20 } else { 100 };
                for _ in 0..5 {
                    let _ = once();
                }
                sync();
                barrier.wait();
                let start = Instant::now();
                for _ in 0..iterations {
                    let _ = once();
                }
                sync();
                let seconds = start.elapsed().as_secs_f64() / iterations as f64;
                let n = world as f64;
                let factor = match op {
                    Op::AllReduce => 2.0 * (n - 1.0) / n,
                    _ => (n - 1.0) / n,
                };
                let busbw = bytes as f64 * factor / seconds / 1e9;
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
                        busbw
                    );
                }
                barrier.wait();
            }
        }
    }
}
