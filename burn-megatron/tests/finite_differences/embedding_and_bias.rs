//! The token-embedding lookup (also with ids past the table, as a vocabulary-parallel rank
//! passes the other ranks' tokens, and as the MoE dispatcher's row gather), the bias add and the
//! output-major linear, whose backwards are
//! written out (a scatter of the output's gradient into the table's rows in token order; the
//! bias's column sum; GEMMs with folded transposes): their gradients against central
//! differences of the forward, one element at a time.

use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::ops::embedding::{
    embedding, embedding_or_zero, gather_rows, gather_rows_or_zero,
};
use burn_megatron::ops::{bias_add, linear_output_major};
use burn_megatron_testing::{assert_close, tolerance, values};

use crate::{AD, B, STEP, device};

fn normal<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<B, D> {
    init_full::<B, D>(
        shape,
        InitDistribution::Normal { std: 1.0 },
        seed,
        &device(),
    )
}

/// Central differences of `loss` at `x`, one element at a time.
fn finite_differences<const D: usize>(
    x: &Tensor<B, D>,
    loss: impl Fn(Tensor<B, D>) -> f64,
) -> Vec<f64> {
    let shape = x.dims();
    let base = values(x.clone());
    (0..base.len())
        .map(|i| {
            let shifted = |h: f64| {
                let mut v = base.clone();
                v[i] += h;
                loss(Tensor::from_data(TensorData::new(v, shape), &device()))
            };
            (shifted(STEP) - shifted(-STEP)) / (2.0 * STEP)
        })
        .collect()
}

/// The gradient of `loss` with respect to a table at `table`, by autodiff and by central
/// differences.
fn table_gradient(
    table: &Tensor<B, 2>,
    loss: impl Fn(Tensor<AD, 2>) -> Tensor<AD, 1>,
) -> (Vec<f64>, Vec<f64>) {
    let tracked = Tensor::<AD, 2>::from_inner(table.clone()).require_grad();
    let grads = loss(tracked.clone()).backward();
    let got = values(tracked.grad(&grads).expect("the table has a gradient"));
    let fd = finite_differences(table, |t| values(loss(Tensor::from_inner(t)).inner())[0]);
    (got, fd)
}

/// A 7-row table looked up by 2 × 5 ids with repeats (id 3 three times, id 0 twice) and rows
/// no token uses (their gradient is exactly zero).
#[test]
fn the_embedding_gradient_matches_finite_differences() {
    let (vocab, hidden) = (7, 5);
    let ids = Tensor::<B, 2, Int>::from_data(
        TensorData::new(vec![3i64, 0, 3, 6, 1, 0, 3, 2, 6, 1], [2, 5]),
        &device(),
    );
    let table = normal([vocab, hidden], 1);
    let w = normal([2, 5, hidden], 2);
    let loss = |table: Tensor<AD, 2>| {
        let y = embedding(table, Tensor::<AD, 2, Int>::from_inner(ids.clone()));
        (y * Tensor::from_inner(w.clone())).sum()
    };
    let (got, fd) = table_gradient(&table, loss);
    assert_close("embedding dW", &got, &fd, tolerance::FINITE_DIFFERENCE_F64);
    // Rows 4 and 5 are never looked up.
    for row in [4, 5] {
        assert!(
            got[row * hidden..(row + 1) * hidden]
                .iter()
                .all(|g| *g == 0.0),
            "row {row} has a gradient though no token uses it"
        );
    }
}

/// `gather_rows` (the MoE dispatcher's gathers): 9 rows of a 6-row table, one row three
/// times, one never (its gradient exactly zero), against central differences; the values are
/// Burn's `select`'s.
#[test]
fn the_row_gather_gradient_matches_finite_differences() {
    let (n, hidden) = (6, 4);
    let rows = Tensor::<B, 1, Int>::from_data(
        TensorData::new(vec![5i64, 0, 2, 5, 1, 3, 5, 0, 2], [9]),
        &device(),
    );
    let table = normal([n, hidden], 3);
    let w = normal([9, hidden], 4);
    assert_close(
        "gather_rows against select",
        &values(gather_rows(table.clone(), rows.clone())),
        &values(table.clone().select(0, rows.clone())),
        0.0,
    );
    let loss = |table: Tensor<AD, 2>| {
        let y = gather_rows(table, Tensor::<AD, 1, Int>::from_inner(rows.clone()));
        (y * Tensor::from_inner(w.clone())).sum()
    };
    let (got, fd) = table_gradient(&table, loss);
    assert_close(
        "gather_rows d(table)",
        &got,
        &fd,
        tolerance::FINITE_DIFFERENCE_F64,
    );
    // Row 4 is never gathered.
    assert!(got[4 * hidden..5 * hidden].iter().all(|g| *g == 0.0));
}

/// The lookup where ids of `vocab` or more (7, 9 here) give zero rows and no gradient: the
/// table's gradient against central differences, first and last rows included.
#[test]
fn the_embedding_or_zero_gradient_matches_finite_differences() {
    let (vocab, hidden) = (7, 5);
    let ids = Tensor::<B, 2, Int>::from_data(
        TensorData::new(vec![3i64, 7, 0, 6, 9, 0, 3, 7, 6, 1], [2, 5]),
        &device(),
    );
    let table = normal([vocab, hidden], 6);
    let w = normal([2, 5, hidden], 7);
    let loss = |table: Tensor<AD, 2>| {
        let y = embedding_or_zero(table, Tensor::<AD, 2, Int>::from_inner(ids.clone()));
        (y * Tensor::from_inner(w.clone())).sum()
    };
    let (got, fd) = table_gradient(&table, loss);
    assert_close(
        "embedding_or_zero dW",
        &got,
        &fd,
        tolerance::FINITE_DIFFERENCE_F64,
    );
}

/// The MoE dispatcher's gather with padding: indices of `n` or more (6, 9 here) give zero
/// rows (the rest equal `select`'s) and no gradient; the table's gradient against central
/// differences.
#[test]
fn the_row_gather_or_zero_gradient_matches_finite_differences() {
    let (n, hidden) = (6, 4);
    let list = vec![5i64, 6, 2, 5, 9, 3, 6, 0];
    let rows = Tensor::<B, 1, Int>::from_data(TensorData::new(list.clone(), [8]), &device());
    let table = normal([n, hidden], 8);
    let w = normal([8, hidden], 9);
    let got = values(gather_rows_or_zero(table.clone(), rows.clone()));
    let rows_of_table = values(table.clone());
    let want: Vec<f64> = list
        .iter()
        .flat_map(|&r| (0..hidden).map(move |c| (r as usize, c)))
        .map(|(r, c)| {
            if r < n {
                rows_of_table[r * hidden + c]
            } else {
                0.0
            }
        })
        .collect();
    assert_close("gather_rows_or_zero against select", &got, &want, 0.0);
    let loss = |table: Tensor<AD, 2>| {
        let y = gather_rows_or_zero(table, Tensor::<AD, 1, Int>::from_inner(rows.clone()));
        (y * Tensor::from_inner(w.clone())).sum()
    };
    let (got, fd) = table_gradient(&table, loss);
    assert_close(
        "gather_rows_or_zero d(table)",
        &got,
        &fd,
        tolerance::FINITE_DIFFERENCE_F64,
    );
    // Rows 1 and 4 are never gathered.
    for r in [1, 4] {
        assert!(got[r * hidden..(r + 1) * hidden].iter().all(|g| *g == 0.0));
    }
}

#[test]
fn the_bias_add_gradients_match_finite_differences() {
    let x = normal([3, 4, 6], 3);
    let bias = normal([6], 4);
    let w = normal([3, 4, 6], 5);
    let loss =
        |x: Tensor<AD, 3>, b: Tensor<AD, 1>| (bias_add(x, b) * Tensor::from_inner(w.clone())).sum();
    let (tx, tb) = (
        Tensor::<AD, 3>::from_inner(x.clone()).require_grad(),
        Tensor::<AD, 1>::from_inner(bias.clone()).require_grad(),
    );
    let grads = loss(tx.clone(), tb.clone()).backward();
    let scalar = |t: Tensor<AD, 1>| values(t.inner())[0];
    let fd_x = finite_differences(&x, |x| {
        scalar(loss(
            Tensor::from_inner(x),
            Tensor::from_inner(bias.clone()),
        ))
    });
    let fd_b = finite_differences(&bias, |b| {
        scalar(loss(Tensor::from_inner(x.clone()), Tensor::from_inner(b)))
    });
    assert_close(
        "bias_add dx",
        &values(tx.grad(&grads).expect("x has a gradient")),
        &fd_x,
        tolerance::FINITE_DIFFERENCE_F64,
    );
    assert_close(
        "bias_add dbias",
        &values(tb.grad(&grads).expect("the bias has a gradient")),
        &fd_b,
        tolerance::FINITE_DIFFERENCE_F64,
    );
}

/// The output layer's product with its weight as stored (`[d_out, d_in]`,
/// `linear_output_major`, a backward written out): the gradients of the input, the weight and
/// the bias.
#[test]
fn the_output_major_linear_gradients_match_finite_differences() {
    let x = normal([2, 3, 4], 6);
    let w_t = normal([5, 4], 7);
    let bias = normal([5], 8);
    let upstream = normal([2, 3, 5], 9);
    let loss = |x: Tensor<AD, 3>, w_t: Tensor<AD, 2>, b: Tensor<AD, 1>| {
        (linear_output_major(x, w_t, Some(b)) * Tensor::from_inner(upstream.clone())).sum()
    };
    let (tx, tw, tb) = (
        Tensor::<AD, 3>::from_inner(x.clone()).require_grad(),
        Tensor::<AD, 2>::from_inner(w_t.clone()).require_grad(),
        Tensor::<AD, 1>::from_inner(bias.clone()).require_grad(),
    );
    let grads = loss(tx.clone(), tw.clone(), tb.clone()).backward();
    let scalar = |t: Tensor<AD, 1>| values(t.inner())[0];
    let at = |x: &Tensor<B, 3>, w: &Tensor<B, 2>, b: &Tensor<B, 1>| {
        scalar(loss(
            Tensor::from_inner(x.clone()),
            Tensor::from_inner(w.clone()),
            Tensor::from_inner(b.clone()),
        ))
    };
    let fd_x = finite_differences(&x, |x| at(&x, &w_t, &bias));
    let fd_w = finite_differences(&w_t, |w| at(&x, &w, &bias));
    let fd_b = finite_differences(&bias, |b| at(&x, &w_t, &b));
    for (name, got, fd) in [
        (
            "dx",
            values(tx.grad(&grads).expect("x has a gradient")),
            fd_x,
        ),
        (
            "dw_t",
            values(tw.grad(&grads).expect("w_t has a gradient")),
            fd_w,
        ),
        (
            "dbias",
            values(tb.grad(&grads).expect("the bias has a gradient")),
            fd_b,
        ),
    ] {
        assert_close(
            &format!("output-major linear {name}"),
            &got,
            &fd,
            tolerance::FINITE_DIFFERENCE_F64,
        );
    }
}
