//! Blockwise FP8 scaling (`--fp8-recipe blockwise`) against a host reference: each block's
//! scale from its own amax (f32, as the layer computes it), each element rounded by the
//! `float8` crate, the reciprocal scales in cuBLASLt's layout; the blockwise product against
//! f64 sums of the dequantized values; the layer's forward and gradients against an f64
//! emulation; a NaN kept in its block; shapes that are not whole blocks refused.

use burn::tensor::{DType, Tensor};
use burn_megatron::ops::fp8::{
    BLOCK, Fp8Blocks, Fp8Config, Fp8Dtype, Fp8Format, Fp8Linear, Fp8Recipe, Fp8Split, fp8_linear,
    gemm_blockwise_composition, quantize_blockwise_composition,
};

use crate::linear::scale;
use crate::{AD, B, assert_close, matrix, pseudo_random, reference_round, tolerance, values};

/// A blockwise cast by the reference, of a row-major `[rows, cols]` in its cast layout.
struct Reference {
    /// The grid values, `[rows, cols]`.
    q: Vec<f64>,
    /// The values the GEMM multiplies: `q` times the block's reciprocal scale.
    dequantized: Vec<f64>,
    /// The reciprocal scales in cuBLASLt's layout (see `ops::fp8::blockwise`).
    inv: Vec<f32>,
}

fn reference(
    v: &[f32],
    [rows, cols]: [usize; 2],
    blocks: Fp8Blocks,
    dtype: Fp8Dtype,
    margin: i32,
) -> Reference {
    let per_group = match blocks {
        Fp8Blocks::Row => 1,
        Fp8Blocks::Square => BLOCK,
    };
    let (groups, col_blocks) = (rows / per_group, cols / BLOCK);
    let block = |r: usize, c: usize| (r / per_group) * col_blocks + c / BLOCK;
    let mut amax = vec![0f32; groups * col_blocks];
    let mut nan = vec![false; groups * col_blocks];
    for r in 0..rows {
        for c in 0..cols {
            let x = v[r * cols + c];
            nan[block(r, c)] |= x.is_nan();
            amax[block(r, c)] = amax[block(r, c)].max(x.abs());
        }
    }
    let scales: Vec<f32> = (amax.iter().zip(&nan))
        .map(|(&a, &n)| match n {
            true => 1.0,
            // The largest power of two at most the tensorwise formula's scale: its exponent
            // bits alone.
            false => f32::from_bits(scale(a, dtype, margin).to_bits() & 0xFF80_0000),
        })
        .collect();
    let mut q = vec![0f64; rows * cols];
    let mut dequantized = vec![0f64; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            let s = scales[block(r, c)];
            q[r * cols + c] = reference_round((v[r * cols + c] * s) as f64, dtype);
            dequantized[r * cols + c] = q[r * cols + c] * (1.0 / s) as f64;
        }
    }
    let inv = match blocks {
        Fp8Blocks::Row => (0..col_blocks * rows)
            .map(|i| 1.0 / scales[(i % rows) * col_blocks + i / rows])
            .collect(),
        Fp8Blocks::Square => {
            let padded = col_blocks.next_multiple_of(4);
            (0..groups * padded)
                .map(|i| match i % padded < col_blocks {
                    true => 1.0 / scales[(i / padded) * col_blocks + i % padded],
                    false => 1.0,
                })
                .collect()
        }
    };
    Reference {
        q,
        dequantized,
        inv,
    }
}

fn transposed(v: &[f32], [rows, cols]: [usize; 2]) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| v[(i % rows) * cols + i / rows])
        .collect()
}

/// `[rows, cols]` values whose blocks differ in range: rows scaled by powers of two, one
/// outlier, one block of zeros (rows 128..256, columns 0..128).
fn uneven(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut v = pseudo_random(rows * cols, seed, 1.0);
    for r in 0..rows {
        for c in 0..cols {
            v[r * cols + c] *= 2f32.powi((r % 7) as i32 - 3 + (c / BLOCK) as i32);
            if r >= BLOCK && c < BLOCK {
                v[r * cols + c] = 0.0;
            }
        }
    }
    v[3 * cols + 200] = 300.0;
    v
}

fn cast(
    v: &[f32],
    dims: [usize; 2],
    blocks: Fp8Blocks,
    dtype: Fp8Dtype,
    margin: i32,
    transpose: bool,
) -> (Tensor<B, 2>, Tensor<B, 1>) {
    let x = matrix::<B>(v, dims[0], dims[1]);
    quantize_blockwise_composition(x, dtype, blocks, margin, transpose)
}

fn f32s(t: Tensor<B, 1>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().unwrap()
}

#[test]
fn blockwise_casts_equal_the_reference() {
    let dims = [256, 384];
    let v = uneven(dims[0], dims[1], 1);
    let v_t = transposed(&v, dims);
    for (blocks, dtype, margin) in [
        (Fp8Blocks::Row, Fp8Dtype::E4M3, 0),
        (Fp8Blocks::Row, Fp8Dtype::E5M2, 1),
        (Fp8Blocks::Square, Fp8Dtype::E4M3, 0),
    ] {
        for transpose in [false, true] {
            let what = format!("{blocks:?} {dtype:?} margin {margin} transposed {transpose}");
            let (q, inv) = cast(&v, dims, blocks, dtype, margin, transpose);
            let want = match transpose {
                false => reference(&v, dims, blocks, dtype, margin),
                true => reference(&v_t, [dims[1], dims[0]], blocks, dtype, margin),
            };
            assert_eq!(
                q.dims(),
                if transpose { [384, 256] } else { dims },
                "{what}"
            );
            assert!(values(q) == want.q, "{what}: the grid values differ");
            assert_eq!(f32s(inv), want.inv, "{what}: the reciprocal scales");
        }
    }
    // The outlier's block gets the scale 1 (448 / 300 rounded down to a power of two), its
    // neighbour 64 (values below 4 there: 448 / 3.9 rounds down to 64); the zero block 1.
    let want = reference(&v, dims, Fp8Blocks::Row, Fp8Dtype::E4M3, 0);
    assert_eq!(want.inv[256 + 3], 1.0, "row 3's second block");
    assert_eq!(want.inv[2 * 256 + 3], 1.0 / 64.0, "row 3's third block");
    assert_eq!(want.inv[200], 1.0, "row 200's first block is zeros");
}

#[test]
fn blockwise_product_equals_the_f64_sums() {
    let (m, n, k) = (256, 128, 384);
    let a = uneven(m, k, 2);
    let b = pseudo_random(n * k, 3, 0.05);
    for (a_blocks, b_blocks) in [
        (Fp8Blocks::Row, Fp8Blocks::Square),
        (Fp8Blocks::Row, Fp8Blocks::Row),
    ] {
        let dtype = Fp8Dtype::E4M3;
        let (qa, ia) = cast(&a, [m, k], a_blocks, dtype, 0, false);
        let (qb, ib) = cast(&b, [n, k], b_blocks, dtype, 0, false);
        let got = gemm_blockwise_composition(qa, ia, a_blocks, qb, ib, b_blocks, DType::F32);
        let (ra, rb) = (
            reference(&a, [m, k], a_blocks, dtype, 0).dequantized,
            reference(&b, [n, k], b_blocks, dtype, 0).dequantized,
        );
        let want: Vec<f64> = (0..m * n)
            .map(|i| (0..k).map(|l| ra[i / n * k + l] * rb[i % n * k + l]).sum())
            .collect();
        assert_close(
            &format!("{a_blocks:?} x {b_blocks:?}"),
            &values(got),
            &want,
            tolerance::F32,
        );
    }
}

const TOKENS: usize = 256;
const D_IN: usize = 256;
const D_OUT: usize = 128;

/// `[y, dx, dw, db]` of the blockwise layer on `x: [TOKENS, D_IN]`, `w: [D_IN, D_OUT]`, the
/// output gradient `g: [TOKENS, D_OUT]`.
fn layer(x: &[f32], w: &[f32], bias: &[f32], g: &[f32], fp8: &Fp8Linear) -> [Vec<f64>; 4] {
    let x = matrix::<AD>(x, TOKENS, D_IN).require_grad();
    let w = matrix::<AD>(w, D_IN, D_OUT).require_grad();
    let bias = Tensor::<AD, 1>::from_floats(bias, &Default::default()).require_grad();
    let y = fp8_linear(x.clone(), w.clone(), Some(bias.clone()), fp8).unwrap();
    let grads = (y.clone() * matrix::<AD>(g, TOKENS, D_OUT))
        .sum()
        .backward();
    [
        values(y.inner()),
        values(x.grad(&grads).unwrap()),
        values(w.grad(&grads).unwrap()),
        values(bias.grad(&grads).unwrap()),
    ]
}

/// `Σ_l a[i, l] · b[j, l]` of row-major `a: [m, k]`, `b: [n, k]`.
fn product(a: &[f64], b: &[f64], m: usize, n: usize, k: usize) -> Vec<f64> {
    (0..m * n)
        .map(|i| (0..k).map(|l| a[i / n * k + l] * b[i % n * k + l]).sum())
        .collect()
}

#[test]
fn blockwise_layer_equals_the_f64_emulation() {
    let x = uneven(TOKENS, D_IN, 4);
    let w = pseudo_random(D_IN * D_OUT, 5, 0.1);
    let bias = pseudo_random(D_OUT, 6, 0.1);
    let g = pseudo_random(TOKENS * D_OUT, 7, 1e-3);
    for (format, margin) in [(Fp8Format::Hybrid, 0), (Fp8Format::E4M3, 1)] {
        let config = Fp8Config::new()
            .with_format(format)
            .with_recipe(Fp8Recipe::Blockwise)
            .with_margin(margin);
        let fp8 = Fp8Linear::new(config, None, Fp8Split::NONE);
        let got = layer(&x, &w, &bias, &g, &fp8);
        let (fwd, grad) = (format.forward_dtype(), format.gradient_dtype());
        let deq = |v: &[f32], dims, blocks, dtype| reference(v, dims, blocks, dtype, margin);
        // The cast layouts: x row-major (blocks along d_in) and transposed (along the
        // tokens), w's squares transposed and row-major, g row-major and transposed.
        let x_row = deq(&x, [TOKENS, D_IN], Fp8Blocks::Row, fwd).dequantized;
        let x_t = deq(
            &transposed(&x, [TOKENS, D_IN]),
            [D_IN, TOKENS],
            Fp8Blocks::Row,
            fwd,
        );
        let w_t = deq(
            &transposed(&w, [D_IN, D_OUT]),
            [D_OUT, D_IN],
            Fp8Blocks::Square,
            fwd,
        );
        let w_row = deq(&w, [D_IN, D_OUT], Fp8Blocks::Square, fwd).dequantized;
        let g_row = deq(&g, [TOKENS, D_OUT], Fp8Blocks::Row, grad).dequantized;
        let g_t = deq(
            &transposed(&g, [TOKENS, D_OUT]),
            [D_OUT, TOKENS],
            Fp8Blocks::Row,
            grad,
        );
        let mut y = product(&x_row, &w_t.dequantized, TOKENS, D_OUT, D_IN);
        for (i, v) in y.iter_mut().enumerate() {
            *v += bias[i % D_OUT] as f64;
        }
        let dx = product(&g_row, &w_row, TOKENS, D_IN, D_OUT);
        let dw = product(&x_t.dequantized, &g_t.dequantized, D_IN, D_OUT, TOKENS);
        let db: Vec<f64> = (0..D_OUT)
            .map(|o| (0..TOKENS).map(|t| g[t * D_OUT + o] as f64).sum())
            .collect();
        for (name, (got, want)) in ["y", "dx", "dw", "db"]
            .iter()
            .zip(got.iter().zip([y, dx, dw, db]))
        {
            assert_close(
                &format!("{format:?} margin {margin}: {name}"),
                got,
                &want,
                tolerance::F32,
            );
        }
        assert!(
            fp8.delayed_states::<B>().is_none(),
            "blockwise keeps no state"
        );
    }
}

/// Blockwise scaling keeps each block's precision: with one outlier in the input, the
/// blockwise layer's output stays closer to the exact product than the tensorwise one's.
#[test]
fn blockwise_scaling_is_closer_than_tensorwise_with_an_outlier() {
    let mut x = pseudo_random(TOKENS * D_IN, 8, 1.0);
    x[17] = 2e5;
    let w = pseudo_random(D_IN * D_OUT, 9, 0.1);
    let (bias, g) = (vec![0.0; D_OUT], vec![0.0; TOKENS * D_OUT]);
    let exact = product(
        &x.iter().map(|&v| v as f64).collect::<Vec<_>>(),
        &transposed(&w, [D_IN, D_OUT])
            .iter()
            .map(|&v| v as f64)
            .collect::<Vec<_>>(),
        TOKENS,
        D_OUT,
        D_IN,
    );
    let error = |recipe| {
        let fp8 = Fp8Linear::new(Fp8Config::new().with_recipe(recipe), None, Fp8Split::NONE);
        let y = &layer(&x, &w, &bias, &g, &fp8)[0];
        // Rows other than the outlier's.
        let rest = |v: &[f64]| v[D_OUT..].to_vec();
        burn_megatron_testing::compare::relative_difference("y", &rest(y), &rest(&exact))
    };
    let (blockwise, tensorwise) = (error(Fp8Recipe::Blockwise), error(Fp8Recipe::Tensorwise));
    assert!(
        blockwise < 0.1 * tensorwise,
        "blockwise {blockwise:e} against tensorwise {tensorwise:e}"
    );
}

#[test]
fn blockwise_nan_stays_in_its_rows_and_partial_blocks_are_refused() {
    let mut x = pseudo_random(TOKENS * D_IN, 10, 1.0);
    x[5 * D_IN + 7] = f32::NAN;
    let w = pseudo_random(D_IN * D_OUT, 11, 0.1);
    let fp8 = Fp8Linear::new(
        Fp8Config::new().with_recipe(Fp8Recipe::Blockwise),
        None,
        Fp8Split::NONE,
    );
    let y = fp8_linear(
        matrix::<B>(&x, TOKENS, D_IN),
        matrix::<B>(&w, D_IN, D_OUT),
        None,
        &fp8,
    );
    let y = y.unwrap().into_data().to_vec::<f32>().unwrap();
    for (t, row) in y.chunks(D_OUT).enumerate() {
        match t {
            5 => assert!(row.iter().all(|v| v.is_nan()), "the NaN's row"),
            _ => assert!(row.iter().all(|v| v.is_finite()), "row {t}: {row:?}"),
        }
    }
    // 100 tokens are not whole blocks of 128.
    let x = matrix::<B>(&x[..100 * D_IN], 100, D_IN);
    let error = fp8_linear(x, matrix::<B>(&w, D_IN, D_OUT), None, &fp8).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("a [100, 256] operand needs both sides a positive multiple of 128"),
        "{error}"
    );
}
