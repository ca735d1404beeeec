use burn::tensor::{DType, Tensor};
use burn_megatron_dist::{ParallelSizes, ReduceOp};

use crate::{B, iota, run, tensor, values};

/// Rank r holds `[r, r + 10]`-style data so every reduction has a known answer.
fn rank_tensor(rank: usize) -> Tensor<B, 2> {
    iota::<B, 2>([2, 3], 1.0, 10.0 * rank as f32)
}

#[test]
fn all_reduce_sum_avg_max_min() {
    for n in [1, 2, 4] {
        let results = run(n, |ctx| {
            let g = ctx.world();
            let r = ctx.rank();
            Ok([ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min]
                .map(|op| values(g.all_reduce(rank_tensor(r), op).unwrap())))
        });
        let ranks_sum: f32 = (0..n).map(|r| 10.0 * r as f32).sum();
        for [sum, avg, max, min] in results {
            for i in 0..6 {
                let base = i as f32;
                assert_eq!(sum[i], n as f32 * base + ranks_sum);
                assert!((avg[i] - (base + ranks_sum / n as f32)).abs() < 1e-6);
                assert_eq!(max[i], base + 10.0 * (n - 1) as f32);
                assert_eq!(min[i], base);
            }
        }
    }
}

/// The check against Megatron: world 8, TP=4, PP=2; each rank all-reduces its own
/// rank number over its TP group.
#[test]
fn tp_group_all_reduce_matches_megatron() {
    let results = run(8, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(4).with_pp(2))?;
        let x = tensor::<B, 1>(vec![ctx.rank() as f32], [1]);
        Ok(values(state.tp().all_reduce(x, ReduceOp::Sum)?)[0])
    });
    assert_eq!(results, vec![6.0, 6.0, 6.0, 6.0, 22.0, 22.0, 22.0, 22.0]);
}

#[test]
fn all_gather_along_each_dimension_with_uneven_last_shard() {
    for n in [1, 2, 4] {
        let results = run(n, |ctx| {
            let r = ctx.rank() as f32;
            let g = ctx.world();
            let d0 = g.all_gather(iota::<B, 2>([1, 2], 1.0, 100.0 * r), 0)?;
            let d1 = g.all_gather(iota::<B, 2>([2, 1], 1.0, 100.0 * r), 1)?;
            // The last rank holds a shorter shard.
            let len = if ctx.rank() + 1 == n && n > 1 { 1 } else { 2 };
            let uneven = g.all_gather(iota::<B, 1>([len], 1.0, 100.0 * r), 0)?;
            Ok((d0.dims(), values(d0), d1.dims(), values(d1), values(uneven)))
        });
        for (d0_shape, d0, d1_shape, d1, uneven) in results {
            assert_eq!(d0_shape, [n, 2]);
            assert_eq!(d1_shape, [2, n]);
            let mut expect_d0 = vec![];
            let mut expect_uneven = vec![];
            for r in 0..n {
                expect_d0.extend([100.0 * r as f32, 100.0 * r as f32 + 1.0]);
                expect_uneven.push(100.0 * r as f32);
                if r + 1 < n || n == 1 {
                    expect_uneven.push(100.0 * r as f32 + 1.0);
                }
            }
            assert_eq!(d0, expect_d0);
            assert_eq!(uneven, expect_uneven);
            let expect_d1: Vec<f32> = (0..2)
                .flat_map(|row| (0..n).map(move |r| 100.0 * r as f32 + row as f32))
                .collect();
            assert_eq!(d1, expect_d1);
        }
    }
}

#[test]
fn reduce_scatter_gives_each_rank_its_shard_of_the_sum() {
    for n in [1, 2, 4] {
        let results = run(n, |ctx| {
            let x = iota::<B, 2>([2, 8], 1.0, ctx.rank() as f32);
            let d1 = ctx.world().reduce_scatter(x.clone(), 1, ReduceOp::Sum)?;
            let avg = ctx.world().reduce_scatter(x, 1, ReduceOp::Avg)?;
            Ok((ctx.rank(), d1.dims(), values(d1), values(avg)))
        });
        let offsets: f32 = (0..n).map(|r| r as f32).sum();
        for (rank, shape, sum, avg) in results {
            let w = 8 / n;
            assert_eq!(shape, [2, w]);
            let expect: Vec<f32> = (0..2)
                .flat_map(|row| (0..w).map(move |c| (row * 8 + rank * w + c) as f32))
                .collect();
            let expect_sum: Vec<f32> = expect.iter().map(|v| n as f32 * v + offsets).collect();
            assert_eq!(sum, expect_sum);
            let expect_avg: Vec<f32> = expect.iter().map(|v| v + offsets / n as f32).collect();
            assert_eq!(avg, expect_avg);
        }
    }
}

#[test]
fn broadcast_and_barrier() {
    let results = run(4, |ctx| {
        ctx.world().barrier()?;
        let mine = iota::<B, 2>([2, 2], 1.0, 10.0 * ctx.rank() as f32);
        let got = ctx.world().broadcast(mine, 2)?;
        ctx.world().barrier()?;
        Ok(values(got))
    });
    for got in results {
        assert_eq!(got, vec![20.0, 21.0, 22.0, 23.0]);
    }
}

#[test]
fn all_to_all_transposes_shards() {
    for n in [1, 2, 4] {
        let results = run(n, |ctx| {
            // Rank r holds a [n, 2] tensor whose row j is meant for rank j.
            let x = iota::<B, 2>([n, 2], 1.0, 100.0 * ctx.rank() as f32);
            let y = ctx.world().all_to_all(x, 0, 1)?;
            Ok((ctx.rank(), y.dims(), values(y)))
        });
        for (rank, shape, y) in results {
            assert_eq!(shape, [1, 2 * n]);
            let expect: Vec<f32> = (0..n)
                .flat_map(|src| {
                    let base = 100.0 * src as f32 + 2.0 * rank as f32;
                    [base, base + 1.0]
                })
                .collect();
            assert_eq!(y, expect);
        }
    }
}

#[test]
fn send_recv_and_nonblocking_pairs_in_a_ring() {
    let results = run(4, |ctx| {
        let g = ctx.world();
        let (rank, n) = (g.rank(), g.size());
        let next = (rank + 1) % n;
        let prev = (rank + n - 1) % n;
        // Blocking sends are buffered, so everybody can send first.
        g.send(tensor::<B, 1>(vec![rank as f32], [1]), next)?;
        let a: Tensor<B, 1> = g.recv(prev, &Default::default())?;
        // Non-blocking pairs, posted in the order a pipeline schedule would post them.
        let recv = g.irecv::<B, 1>(next, &Default::default())?;
        let send = g.isend(tensor::<B, 1>(vec![10.0 * rank as f32, 1.0], [2]), prev)?;
        send.wait()?;
        let b = recv.wait()?;
        Ok((values(a), values(b)))
    });
    for (rank, (a, b)) in results.into_iter().enumerate() {
        assert_eq!(a, vec![((rank + 3) % 4) as f32]);
        assert_eq!(b, vec![10.0 * ((rank + 1) % 4) as f32, 1.0]);
    }
}

/// Asynchronous collectives on several groups, started before any is waited on, complete with
/// the right pairing (calls are matched by order per group).
#[test]
fn async_collectives_are_matched_in_order_per_group() {
    let results = run(4, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(2))?;
        let r = ctx.rank() as f32;
        let first = state
            .tp()
            .all_reduce_async(tensor::<B, 1>(vec![r], [1]), ReduceOp::Sum)?;
        let on_dp = state
            .dp()
            .all_gather_async(tensor::<B, 1>(vec![r], [1]), 0)?;
        let second = state
            .tp()
            .all_reduce_async(tensor::<B, 1>(vec![100.0 * r], [1]), ReduceOp::Max)?;
        // Waited on out of order.
        let second = values(second.wait()?);
        let on_dp = values(on_dp.wait()?);
        let first = values(first.wait()?);
        Ok((first, on_dp, second))
    });
    assert_eq!(results[0], (vec![1.0], vec![0.0, 2.0], vec![100.0]));
    assert_eq!(results[1], (vec![1.0], vec![1.0, 3.0], vec![100.0]));
    assert_eq!(results[2], (vec![5.0], vec![0.0, 2.0], vec![300.0]));
    assert_eq!(results[3], (vec![5.0], vec![1.0, 3.0], vec![300.0]));
}

/// Collectives keep the tensor's dtype, not the device default.
#[test]
fn collectives_keep_dtype() {
    let results = run(2, |ctx| {
        let x = tensor::<B, 1>(vec![1.5, 2.5], [2]).cast(DType::F64);
        let y = ctx.world().all_reduce(x, ReduceOp::Sum)?;
        let z = ctx.world().all_gather(y.clone(), 0)?;
        Ok((y.dtype(), z.dtype(), values(z)))
    });
    for (y, z, v) in results {
        assert_eq!((y, z), (DType::F64, DType::F64));
        assert_eq!(v, vec![3.0, 5.0, 3.0, 5.0]);
    }
}

#[test]
fn every_rank_gets_bit_identical_sums() {
    let results = run(4, |ctx| {
        let x = iota::<B, 1>(
            [64],
            0.1 + ctx.rank() as f32 * 0.37,
            1.0 / (1.0 + ctx.rank() as f32),
        );
        Ok(values(ctx.world().all_reduce(x, ReduceOp::Sum)?))
    });
    for r in &results[1..] {
        assert_eq!(
            r.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            results[0].iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
}
