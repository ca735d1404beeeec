//! Megatron's mappings on thread ranks: forward values and gradients against the analytic
//! result, for groups of 1, 2 and 4 ranks.

use burn::tensor::Tensor;
use burn_megatron_dist::mapping::*;
use burn_megatron_dist::{DistResult, ProcessGroup};

use crate::{AD, iota, run, values};

/// Output and input gradient of `f` at `x`, when the output's gradient is `upstream`.
fn forward_backward<const D: usize>(
    x: Tensor<AD, D>,
    upstream: Tensor<AD, D>,
    f: impl FnOnce(Tensor<AD, D>) -> DistResult<Tensor<AD, D>>,
) -> DistResult<(Vec<usize>, Vec<f32>, Vec<f32>)> {
    let x = x.require_grad();
    let y = f(x.clone())?;
    let dims = y.dims().to_vec();
    let grads = (y.clone() * upstream).sum().backward();
    let grad = x.grad(&grads).expect("the input has a gradient");
    Ok((dims, values(y), values(grad)))
}

/// Runs `case(group, rank, n)` on `n` ranks for n in 1, 2, 4.
fn each_size<T: Send>(
    case: impl Fn(&ProcessGroup, usize, usize) -> DistResult<T> + Sync,
) -> Vec<(usize, Vec<T>)> {
    [1, 2, 4]
        .into_iter()
        .map(|n| (n, run(n, |ctx| Ok(case(ctx.world(), ctx.rank(), n)?))))
        .collect()
}

fn scaled(v: &[f32], s: f32) -> Vec<f32> {
    v.iter().map(|x| x * s).collect()
}

#[test]
fn copy_to_tp_is_identity_forward_and_all_reduce_backward() {
    for (n, results) in each_size(|g, r, _| {
        let up = iota::<AD, 2>([2, 3], 0.0, (r + 1) as f32);
        forward_backward(iota([2, 3], 1.0, 0.0), up, |x| {
            copy_to_tensor_parallel_region(x, g)
        })
    }) {
        for (_, y, grad) in results {
            assert_eq!(y, vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
            // Upstream (r + 1) · ones on rank r: the gradient is their sum on every rank;
            // with ones everywhere it would be TP · ones.
            assert_eq!(grad, vec![(n * (n + 1) / 2) as f32; 6]);
        }
    }
}

#[test]
fn reduce_from_tp_is_all_reduce_forward_and_identity_backward() {
    for (n, results) in each_size(|g, r, _| {
        let x = iota::<AD, 2>([2, 3], 1.0, 10.0 * r as f32);
        let up = iota::<AD, 2>([2, 3], (r + 1) as f32, 0.0);
        forward_backward(x, up, |x| reduce_from_tensor_parallel_region(x, g))
    }) {
        let offset: f32 = (0..n).map(|r| 10.0 * r as f32).sum();
        for (r, (_, y, grad)) in results.into_iter().enumerate() {
            assert_eq!(
                y,
                (0..6)
                    .map(|i| n as f32 * i as f32 + offset)
                    .collect::<Vec<_>>()
            );
            assert_eq!(
                grad,
                scaled(&values(iota::<AD, 1>([6], 1.0, 0.0)), (r + 1) as f32)
            );
        }
    }
}

#[test]
fn scatter_and_gather_along_the_last_dimension() {
    for (n, results) in each_size(|g, r, n| {
        let w = 4 / n;
        let up = iota::<AD, 2>([2, w], 1.0, 100.0 * r as f32);
        let scatter = forward_backward(iota([2, 4], 1.0, 0.0), up, |x| {
            scatter_to_tensor_parallel_region(x, g)
        })?;
        let up = iota::<AD, 2>([2, 2 * n], (r + 1) as f32, 0.0);
        let gather = forward_backward(iota([2, 2], 1.0, 100.0 * r as f32), up, |x| {
            gather_from_tensor_parallel_region(x, g)
        })?;
        Ok((scatter, gather))
    }) {
        let w = 4 / n;
        for (r, ((s_dims, s_y, s_grad), (g_dims, g_y, g_grad))) in results.into_iter().enumerate() {
            // Scatter: own columns forward; backward, the ranks' upstreams side by side.
            assert_eq!(s_dims, vec![2, w]);
            let own: Vec<f32> = (0..2)
                .flat_map(|row| (0..w).map(move |c| (row * 4 + r * w + c) as f32))
                .collect();
            assert_eq!(s_y, own);
            let gathered: Vec<f32> = (0..2)
                .flat_map(|row| {
                    (0..4).map(move |c| 100.0 * (c / w) as f32 + (row * w + c % w) as f32)
                })
                .collect();
            assert_eq!(s_grad, gathered);
            // Gather: everybody's columns forward; backward, this rank's columns of its upstream.
            assert_eq!(g_dims, vec![2, 2 * n]);
            let all: Vec<f32> = (0..2)
                .flat_map(|row| {
                    (0..2 * n).map(move |c| 100.0 * (c / 2) as f32 + (row * 2 + c % 2) as f32)
                })
                .collect();
            assert_eq!(g_y, all);
            let own_grad: Vec<f32> = (0..2)
                .flat_map(|row| (0..2).map(move |c| ((row * 2 * n + 2 * r + c) * (r + 1)) as f32))
                .collect();
            assert_eq!(g_grad, own_grad);
        }
    }
}

#[test]
fn sequence_parallel_scatter_gather_and_reduce_scatter() {
    // Activations are [batch 1, seq, hidden 2]; the sequence dimension is 1.
    for (n, results) in each_size(|g, r, n| {
        let s = 4 / n;
        let scatter = forward_backward(
            iota([1, 4, 2], 1.0, 0.0),
            iota::<AD, 3>([1, s, 2], 1.0, 100.0 * r as f32),
            |x| scatter_to_sequence_parallel_region(x, g, 1),
        )?;
        let gather = |tp_grad| {
            forward_backward(
                iota([1, 2, 2], 1.0, 100.0 * r as f32),
                iota::<AD, 3>([1, 2 * n, 2], (r + 1) as f32, 0.0),
                |x| gather_from_sequence_parallel_region(x, g, 1, tp_grad),
            )
        };
        let reduce_scatter = forward_backward(
            iota([1, 2 * n, 2], (r + 1) as f32, 0.0),
            iota::<AD, 3>([1, 2, 2], 1.0, 100.0 * r as f32),
            |x| reduce_scatter_to_sequence_parallel_region(x, g, 1),
        )?;
        Ok((scatter, gather(true)?, gather(false)?, reduce_scatter))
    }) {
        let s = 4 / n;
        let ranks_sum = (n * (n + 1) / 2) as f32;
        // Upstream "iota + 100 r" of shape [1, len, 2] from every rank, concatenated on seq.
        let cat = |len: usize| -> Vec<f32> {
            (0..n)
                .flat_map(|r| (0..len * 2).map(move |i| 100.0 * r as f32 + i as f32))
                .collect()
        };
        for (r, (scatter, gather_rs, gather_split, reduce_scatter)) in
            results.into_iter().enumerate()
        {
            assert_eq!(scatter.0, vec![1, s, 2]);
            assert_eq!(
                scatter.1,
                (r * s * 2..(r + 1) * s * 2)
                    .map(|i| i as f32)
                    .collect::<Vec<_>>()
            );
            assert_eq!(scatter.2, cat(s));

            assert_eq!(gather_rs.0, vec![1, 2 * n, 2]);
            assert_eq!(gather_rs.1, cat(2));
            let own: Vec<f32> = (4 * r..4 * r + 4).map(|i| i as f32).collect();
            assert_eq!(
                gather_rs.2,
                scaled(&own, ranks_sum),
                "reduce-scattered gradient"
            );
            assert_eq!(
                gather_split.2,
                scaled(&own, (r + 1) as f32),
                "split gradient"
            );

            assert_eq!(reduce_scatter.0, vec![1, 2, 2]);
            assert_eq!(reduce_scatter.1, scaled(&own, ranks_sum));
            assert_eq!(reduce_scatter.2, cat(2));
        }
    }
}

#[test]
fn all_to_all_backward_is_the_inverse_all_to_all() {
    for (n, results) in each_size(|g, r, n| {
        forward_backward(
            iota([n, 2], 1.0, 100.0 * r as f32),
            iota::<AD, 2>([1, 2 * n], 1.0, 1000.0 * r as f32),
            |x| all_to_all(x, g, 0, 1),
        )
    }) {
        for (j, (dims, y, grad)) in results.into_iter().enumerate() {
            assert_eq!(dims, vec![1, 2 * n]);
            // Row j of every rank's input, side by side.
            let expect_y: Vec<f32> = (0..n)
                .flat_map(|src| {
                    [
                        100.0 * src as f32 + 2.0 * j as f32,
                        100.0 * src as f32 + 2.0 * j as f32 + 1.0,
                    ]
                })
                .collect();
            assert_eq!(y, expect_y);
            // d x_j[row r] = upstream_r[columns of block j].
            let expect_grad: Vec<f32> = (0..n)
                .flat_map(|r| {
                    [
                        1000.0 * r as f32 + 2.0 * j as f32,
                        1000.0 * r as f32 + 2.0 * j as f32 + 1.0,
                    ]
                })
                .collect();
            assert_eq!(grad, expect_grad);
        }
    }
}

/// Blocks of different sizes, some empty: rank `s` sends `(s + 2q + 1) % 3` rows to rank
/// `q`, row `i` of that block holding `1000 s + 10 q + i` (and the same plus 0.5). Each rank
/// gets its blocks in rank order, and the gradient of each sent row is the upstream row it
/// became on its receiver.
#[test]
fn all_to_all_v_moves_blocks_of_any_size_and_back() {
    use burn::tensor::TensorData;

    let rows = |s: usize, q: usize| (s + 2 * q + 1) % 3;
    let upstream = |q: usize, k: usize, c: usize| 100.0 * q as f32 + k as f32 + 0.25 * c as f32;
    for (n, results) in each_size(|g, r, n| {
        let send: Vec<usize> = (0..n).map(|q| rows(r, q)).collect();
        let recv: Vec<usize> = (0..n).map(|s| rows(s, r)).collect();
        let x: Vec<f32> = (0..n)
            .flat_map(|q| (0..rows(r, q)).map(move |i| (q, i)))
            .flat_map(|(q, i)| {
                let v = 1000.0 * r as f32 + 10.0 * q as f32 + i as f32;
                [v, v + 0.5]
            })
            .collect();
        let out_rows: usize = recv.iter().sum();
        let up: Vec<f32> = (0..out_rows)
            .flat_map(|k| [upstream(r, k, 0), upstream(r, k, 1)])
            .collect();
        let device = Default::default();
        let x = Tensor::<AD, 2>::from_data(TensorData::new(x, [send.iter().sum(), 2]), &device);
        let up = Tensor::<AD, 2>::from_data(TensorData::new(up, [out_rows, 2]), &device);
        forward_backward(x, up, |x| all_to_all_v(x, g, &send, &recv))
    }) {
        for (r, (dims, y, grad)) in results.into_iter().enumerate() {
            let expect_y: Vec<f32> = (0..n)
                .flat_map(|s| (0..rows(s, r)).map(move |i| (s, i)))
                .flat_map(|(s, i)| {
                    let v = 1000.0 * s as f32 + 10.0 * r as f32 + i as f32;
                    [v, v + 0.5]
                })
                .collect();
            assert_eq!(dims, vec![expect_y.len() / 2, 2], "rank {r} of {n}");
            assert_eq!(y, expect_y, "rank {r} of {n}");
            // Row i of the block for q lands at row `Σ_{s < r} rows(s, q) + i` on rank q.
            let expect_grad: Vec<f32> = (0..n)
                .flat_map(|q| {
                    let start: usize = (0..r).map(|s| rows(s, q)).sum();
                    (0..rows(r, q)).map(move |i| (q, start + i))
                })
                .flat_map(|(q, k)| [upstream(q, k, 0), upstream(q, k, 1)])
                .collect();
            assert_eq!(grad, expect_grad, "rank {r} of {n}");
        }
    }
}

#[test]
fn all_to_all_v_refuses_sizes_that_cannot_match() {
    let errors = run(2, |ctx| {
        let x = iota::<AD, 2>([3, 2], 1.0, 0.0);
        // Rank r keeps 1 + r rows but says it receives 2 from itself.
        let own = 1 + ctx.rank();
        let error = all_to_all_v(x, ctx.world(), &[own, 2 - own], &[2, 2]).unwrap_err();
        Ok(error.to_string())
    });
    for e in errors {
        assert!(
            e.contains("this rank's own block must be the same both ways"),
            "{e}"
        );
    }
}

/// A column-parallel then row-parallel product, the shape of Megatron's MLP, gives the
/// single-device gradients of both weights and of the input.
#[test]
fn f_and_g_around_a_split_matmul_give_single_device_gradients() {
    let x_full = || iota::<AD, 2>([3, 4], 0.1, -0.5);
    let a_full = || iota::<AD, 2>([4, 8], 0.05, -0.7);
    let b_full = || iota::<AD, 2>([8, 2], -0.03, 0.4);
    let reference = {
        let (x, a, b) = (
            x_full().require_grad(),
            a_full().require_grad(),
            b_full().require_grad(),
        );
        let loss = x
            .clone()
            .matmul(a.clone())
            .matmul(b.clone())
            .powf_scalar(2.0)
            .sum();
        let grads = loss.backward();
        [
            x.grad(&grads).unwrap(),
            a.grad(&grads).unwrap(),
            b.grad(&grads).unwrap(),
        ]
        .map(values)
    };
    for n in [1, 2, 4] {
        let shards = run(n, |ctx| {
            let g = ctx.world();
            let w = 8 / n;
            let x = x_full().require_grad();
            let a = a_full().narrow(1, g.rank() * w, w).require_grad();
            let b = b_full().narrow(0, g.rank() * w, w).require_grad();
            let h = copy_to_tensor_parallel_region(x.clone(), g)?.matmul(a.clone());
            let y = reduce_from_tensor_parallel_region(h.matmul(b.clone()), g)?;
            let grads = y.powf_scalar(2.0).sum().backward();
            Ok([
                x.grad(&grads).unwrap(),
                a.grad(&grads).unwrap(),
                b.grad(&grads).unwrap(),
            ]
            .map(values))
        });
        for [gx, _, _] in &shards {
            assert_close(gx, &reference[0]);
        }
        let w = 8 / n;
        let ga: Vec<f32> = (0..4)
            .flat_map(|row| {
                shards
                    .iter()
                    .flat_map(move |s| s[1][row * w..(row + 1) * w].to_vec())
            })
            .collect();
        assert_close(&ga, &reference[1]);
        let gb: Vec<f32> = shards.iter().flat_map(|s| s[2].clone()).collect();
        assert_close(&gb, &reference[2]);
    }
}

fn assert_close(a: &[f32], b: &[f32]) {
    let widen = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    burn_megatron_testing::assert_close(
        "gradient",
        &widen(a),
        &widen(b),
        burn_megatron_testing::tolerance::F32,
    );
}
