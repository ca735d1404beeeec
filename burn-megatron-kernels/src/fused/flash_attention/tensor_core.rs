//! Flash attention on tensor cores: f16/bf16 inputs, head dim 64 or 128, f32 accumulation,
//! on runtimes with warp-level `mma.sync.m16n8k16` (CUDA from Ampere on).
//!
//! The FlashAttention-2 scheme with CubeCL's manual MMA, so that scores stay in registers:
//! - **Forward**: a cube of 4 warps takes 64 queries (16 per warp) and walks the keys in
//!   blocks of 64 staged in shared memory. Each warp computes its `16 × 64` scores with
//!   tensor cores, keeps a running row maximum and sum (online softmax), rescales its output
//!   accumulator and adds `P · V`, the probabilities going from accumulator registers straight
//!   into the next MMA's operand registers (the two layouts line up). It writes the output and
//!   the log-sum-exp of each row.
//! - **Backward**, deterministic and without atomics, in three kernels: `delta = rowsum(dO ∘ O)`
//!   (the portable kernel's);
//!   `dK, dV` with one cube per 64 keys walking the queries of every query head of the group;
//!   `dQ` with one cube per 64 queries walking the keys. Each recomputes `P` from the stored
//!   log-sum-exp, so the `[seq, seq]` matrix never exists.
//!
//! Register layouts of `m16n8k16` (PTX ISA, "mma.m16n8k16"), lane `l`, `g = l / 4`, `t = l % 4`:
//! - A (16 × 16): pairs at rows `g`, `g + 8` and columns `2t`, `2t + 8` (+0, +1);
//! - B (16 × 8): pairs at rows `2t`, `2t + 8` (+0, +1), column `g`;
//! - C (16 × 8): pairs at rows `g`, `g + 8`, columns `2t` (+0, +1).
//!
//! Two adjacent C tiles (16 × 16) hold their elements where an A operand wants them, which is
//! how `P` and `dS` feed the next product without shared memory.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cmma::MmaDefinition;
use cubecl::ir::features::MmaConfig;
use cubecl::ir::{ElemType, FloatKind, StorageType};
use cubecl::prelude::*;

/// Two elements per register: the operand vectors of a 16-bit MMA and of its f32 accumulator.
type Pair = Const<2>;

/// Queries per cube, and keys per step.
const BLOCK: usize = 64;
/// Warps per cube; each owns 16 rows of the block.
const WARPS: u32 = 4;
/// Elements added to each shared-memory row so that the lanes of an operand load hit
/// different banks.
const PAD: usize = 8;
/// Stands for a masked score (finite, so that `max - masked` never makes a NaN).
const MASKED: f32 = -1.0e30;

/// `acc[tile] += a · b` for one `m16n8k16` tile; `acc` holds 4 f32 per tile.
#[cube]
fn mma<F: Float>(
    a: &Array<Vector<F, Pair>>,
    b: &Array<Vector<F, Pair>>,
    acc: &mut Array<f32>,
    tile: usize,
) {
    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let mut c = Array::<Vector<f32, Pair>>::new(2usize);
    #[unroll]
    for v in 0..2usize {
        let mut pair = Vector::empty();
        pair[0usize] = acc[tile * 4 + v * 2];
        pair[1usize] = acc[tile * 4 + v * 2 + 1];
        c[v] = pair;
    }
    let d = def.execute(a, b, &c);
    #[unroll]
    for v in 0..2usize {
        let pair = d[v];
        acc[tile * 4 + v * 2] = pair[0usize];
        acc[tile * 4 + v * 2 + 1] = pair[1usize];
    }
}

/// The A operand of rows `row0..row0 + 16` and columns `16 kk..16 kk + 16` of a shared tile.
#[cube]
fn a_operand<F: Float>(
    tile: &SharedMemory<Vector<F, Pair>>,
    row0: usize,
    kk: usize,
    #[comptime] stride: usize,
) -> Array<Vector<F, Pair>> {
    let lane = UNIT_POS_X as usize;
    let (g, t) = (lane / 4, lane % 4);
    let mut a = Array::<Vector<F, Pair>>::new(4usize);
    #[unroll]
    for v in 0..4usize {
        let at = (row0 + g + 8 * (v % 2)) * stride + kk * 16 + 2 * t + 8 * (v / 2);
        a[v] = tile[at / 2];
    }
    a
}

/// Copies the A operands of a warp's 16 rows over all `head_dim / 16` column steps into
/// `regs` (4 vectors a step), for operands that stay in registers through a kernel.
#[cube]
fn a_operands_to_registers<F: Float>(
    tile: &SharedMemory<Vector<F, Pair>>,
    row0: usize,
    regs: &mut Array<Vector<F, Pair>>,
    #[comptime] head_dim: usize,
    #[comptime] stride: usize,
) {
    #[unroll]
    for kk in 0..head_dim / 16 {
        let a = a_operand::<F>(tile, row0, kk, stride);
        #[unroll]
        for v in 0..4usize {
            regs[kk * 4 + v] = a[v];
        }
    }
}

/// The A operand of column step `kk` from registers filled by [`a_operands_to_registers`].
#[cube]
fn a_from_registers<F: Float>(regs: &Array<Vector<F, Pair>>, kk: usize) -> Array<Vector<F, Pair>> {
    let mut a = Array::<Vector<F, Pair>>::new(4usize);
    #[unroll]
    for v in 0..4usize {
        a[v] = regs[kk * 4 + v];
    }
    a
}

/// The A operand of columns `16 kk..16 kk + 16` of an accumulator (`acc` tiles `2 kk` and
/// `2 kk + 1`), rounded to `F`: C tile pairs line up with the A layout.
#[cube]
fn a_from_accumulator<F: Float>(acc: &Array<f32>, kk: usize) -> Array<Vector<F, Pair>> {
    let mut a = Array::<Vector<F, Pair>>::new(4usize);
    #[unroll]
    for v in 0..4usize {
        let at = (2 * kk + v / 2) * 4 + 2 * (v % 2);
        let mut pair = Vector::empty();
        pair[0usize] = F::cast_from(acc[at]);
        pair[1usize] = F::cast_from(acc[at + 1]);
        a[v] = pair;
    }
    a
}

/// The B operand `Tᵀ` for rows `n0..n0 + 8` of a shared tile `T` (the B columns) and its
/// columns `16 kk..16 kk + 16` (the reduction): `Q · Kᵀ` reads `K` this way.
#[cube]
fn b_transposed<F: Float>(
    tile: &SharedMemory<Vector<F, Pair>>,
    n0: usize,
    kk: usize,
    #[comptime] stride: usize,
) -> Array<Vector<F, Pair>> {
    let lane = UNIT_POS_X as usize;
    let (g, t) = (lane / 4, lane % 4);
    let mut b = Array::<Vector<F, Pair>>::new(2usize);
    #[unroll]
    for v in 0..2usize {
        let at = (n0 + g) * stride + kk * 16 + 2 * t + 8 * v;
        b[v] = tile[at / 2];
    }
    b
}

/// The B operand `T` for rows `16 kk..16 kk + 16` of a shared tile (the reduction) and its
/// columns `n0..n0 + 8`: `P · V` reads `V` this way.
#[cube]
fn b_direct<F: Float>(
    tile: &SharedMemory<Vector<F, Pair>>,
    kk: usize,
    n0: usize,
    #[comptime] stride: usize,
) -> Array<Vector<F, Pair>> {
    let lane = UNIT_POS_X as usize;
    let (g, t) = (lane / 4, lane % 4);
    let mut b = Array::<Vector<F, Pair>>::new(2usize);
    #[unroll]
    for v in 0..2usize {
        let row = kk * 16 + 2 * t + 8 * v;
        // Column `n0 + g` is the first or the second element of its pair (`stride` is even).
        let (upper, lower) = (
            tile[(row * stride + n0 + g) / 2],
            tile[((row + 1) * stride + n0 + g) / 2],
        );
        let mut pair = Vector::empty();
        if g % 2 == 0 {
            pair[0usize] = upper[0usize];
            pair[1usize] = lower[0usize];
        } else {
            pair[0usize] = upper[1usize];
            pair[1usize] = lower[1usize];
        }
        b[v] = pair;
    }
    b
}

/// Copies rows `row0..row0 + 64` of one head's `[seq, head_dim]` matrix (at `base`, with the
/// given strides) into a shared tile of element pairs, zeros past `rows`; all 128 threads
/// take part.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_tile<F: Float>(
    src: &Tensor<F>,
    base: usize,
    row_stride: usize,
    col_stride: usize,
    row0: usize,
    rows: usize,
    tile: &mut SharedMemory<Vector<F, Pair>>,
    #[comptime] head_dim: usize,
) {
    let tid = (UNIT_POS_Y * 32 + UNIT_POS_X) as usize;
    let half = comptime!(head_dim / 2);
    #[unroll]
    for step in 0..BLOCK * half / 128 {
        let i = step * 128 + tid;
        let (r, c) = (i / half, 2 * (i % half));
        let mut pair = Vector::empty();
        pair[0usize] = F::new(0.0);
        pair[1usize] = F::new(0.0);
        if row0 + r < rows {
            let at = base + (row0 + r) * row_stride + c * col_stride;
            pair[0usize] = src[at];
            pair[1usize] = src[at + col_stride];
        }
        tile[(r * (head_dim + PAD) + c) / 2] = pair;
    }
}

/// `max` over the four lanes of a quad (the lanes holding one accumulator row).
#[cube]
fn quad_max(x: f32) -> f32 {
    let x = f32::max(x, plane_shuffle_xor(x, 1));
    f32::max(x, plane_shuffle_xor(x, 2))
}

/// Sum over the four lanes of a quad.
#[cube]
fn quad_sum(x: f32) -> f32 {
    let x = x + plane_shuffle_xor(x, 1);
    x + plane_shuffle_xor(x, 2)
}

/// Where head `bh` (`batch · heads + head`) of a `[batch, heads, seq, d]` tensor starts.
#[cube]
fn head_base<F: Float>(t: &Tensor<F>, bh: usize, heads: usize) -> usize {
    (bh / heads) * t.stride(0) + (bh % heads) * t.stride(1)
}

#[cube(launch)]
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn forward_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    scale: f32,
    seq_q: u32,
    seq_k: u32,
    heads: u32,
    group: u32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let stride = comptime!(head_dim + PAD);
    let lane = UNIT_POS_X as usize;
    let warp = UNIT_POS_Y as usize;
    let (g, t) = (lane / 4, lane % 4);
    let (seq_q, seq_k) = (seq_q as usize, seq_k as usize);
    let heads = heads as usize;
    let bh = CUBE_POS_Y as usize;
    let kv_bh = (bh / heads) * (heads / group as usize) + (bh % heads) / group as usize;
    let kv_heads = heads / group as usize;
    let q0 = CUBE_POS_X as usize * BLOCK;
    let row0 = q0 + warp * 16;

    let mut k_tile = SharedMemory::<Vector<F, Pair>>::new(BLOCK * stride / 2);
    let mut v_tile = SharedMemory::<Vector<F, Pair>>::new(BLOCK * stride / 2);

    // Q stays in registers: staged through the K tile once.
    load_tile::<F>(
        q,
        head_base::<F>(q, bh, heads),
        q.stride(2),
        q.stride(3),
        q0,
        seq_q,
        &mut k_tile,
        head_dim,
    );
    sync_cube();
    let mut q_regs = Array::<Vector<F, Pair>>::new(head_dim / 4);
    a_operands_to_registers::<F>(&k_tile, warp * 16, &mut q_regs, head_dim, stride);

    let mut o = Array::<f32>::new(head_dim / 2);
    #[unroll]
    for i in 0..head_dim / 2 {
        o[i] = 0.0;
    }
    let mut row_max = Array::<f32>::new(2usize);
    let mut row_sum = Array::<f32>::new(2usize);
    #[unroll]
    for r in 0..2usize {
        row_max[r] = MASKED;
        row_sum[r] = 0.0;
    }

    let key_blocks = seq_k.div_ceil(BLOCK);
    let mut blocks = key_blocks;
    if causal {
        if CUBE_POS_X as usize + 1 < key_blocks {
            blocks = CUBE_POS_X as usize + 1;
        }
    }
    let (k_base, v_base) = (
        head_base::<F>(k, kv_bh, kv_heads),
        head_base::<F>(v, kv_bh, kv_heads),
    );
    for kb in 0..blocks {
        let k0 = kb * BLOCK;
        sync_cube();
        load_tile::<F>(
            k,
            k_base,
            k.stride(2),
            k.stride(3),
            k0,
            seq_k,
            &mut k_tile,
            head_dim,
        );
        load_tile::<F>(
            v,
            v_base,
            v.stride(2),
            v.stride(3),
            k0,
            seq_k,
            &mut v_tile,
            head_dim,
        );
        sync_cube();

        let mut s = Array::<f32>::new(32usize);
        #[unroll]
        for i in 0..32usize {
            s[i] = 0.0;
        }
        // Step-major: consecutive MMAs go to different tiles, so none waits on the last.
        #[unroll]
        for kk in 0..head_dim / 16 {
            let a = a_from_registers::<F>(&q_regs, kk);
            #[unroll]
            for j in 0..8usize {
                let b = b_transposed::<F>(&k_tile, j * 8, kk, stride);
                mma::<F>(&a, &b, &mut s, j);
            }
        }

        #[unroll]
        for r in 0..2usize {
            let row = row0 + g + 8 * r;
            let mut top = row_max[r];
            #[unroll]
            for j in 0..8usize {
                #[unroll]
                for e in 0..2usize {
                    let key = k0 + j * 8 + 2 * t + e;
                    let at = j * 4 + 2 * r + e;
                    let mut x = s[at] * scale;
                    if key >= seq_k || (causal && key > row) {
                        x = MASKED;
                    }
                    s[at] = x;
                    top = f32::max(top, x);
                }
            }
            top = quad_max(top);
            let alpha = f32::exp(row_max[r] - top);
            row_max[r] = top;
            let mut sum = f32::new(0.0);
            #[unroll]
            for j in 0..8usize {
                #[unroll]
                for e in 0..2usize {
                    let at = j * 4 + 2 * r + e;
                    let p = f32::exp(s[at] - top);
                    s[at] = p;
                    sum += p;
                }
            }
            row_sum[r] = row_sum[r] * alpha + sum;
            #[unroll]
            for jd in 0..head_dim / 8 {
                #[unroll]
                for e in 0..2usize {
                    o[jd * 4 + 2 * r + e] *= alpha;
                }
            }
        }

        #[unroll]
        for kk in 0..4usize {
            let a = a_from_accumulator::<F>(&s, kk);
            #[unroll]
            for jd in 0..head_dim / 8 {
                let b = b_direct::<F>(&v_tile, kk, jd * 8, stride);
                mma::<F>(&a, &b, &mut o, jd);
            }
        }
    }

    let out_base = head_base::<F>(out, bh, heads);
    #[unroll]
    for r in 0..2usize {
        let row = row0 + g + 8 * r;
        let total = quad_sum(row_sum[r]);
        if row < seq_q {
            let inverse = 1.0f32 / total;
            #[unroll]
            for jd in 0..head_dim / 8 {
                #[unroll]
                for e in 0..2usize {
                    let col = jd * 8 + 2 * t + e;
                    out[out_base + row * out.stride(2) + col * out.stride(3)] =
                        F::cast_from(o[jd * 4 + 2 * r + e] * inverse);
                }
            }
            if t == 0 {
                lse[bh * seq_q + row] = row_max[r] + f32::ln(total);
            }
        }
    }
}

/// `dQ`: one cube per 64 queries walking the visible key blocks.
#[cube(launch)]
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn grad_query_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    grad: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    grad_q: &mut Tensor<F>,
    scale: f32,
    seq_q: u32,
    seq_k: u32,
    heads: u32,
    group: u32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let stride = comptime!(head_dim + PAD);
    let lane = UNIT_POS_X as usize;
    let warp = UNIT_POS_Y as usize;
    let (g, t) = (lane / 4, lane % 4);
    let (seq_q, seq_k) = (seq_q as usize, seq_k as usize);
    let heads = heads as usize;
    let bh = CUBE_POS_Y as usize;
    let kv_bh = (bh / heads) * (heads / group as usize) + (bh % heads) / group as usize;
    let kv_heads = heads / group as usize;
    let q0 = CUBE_POS_X as usize * BLOCK;
    let row0 = q0 + warp * 16;

    let mut k_tile = SharedMemory::<Vector<F, Pair>>::new(BLOCK * stride / 2);
    let mut v_tile = SharedMemory::<Vector<F, Pair>>::new(BLOCK * stride / 2);

    load_tile::<F>(
        q,
        head_base::<F>(q, bh, heads),
        q.stride(2),
        q.stride(3),
        q0,
        seq_q,
        &mut k_tile,
        head_dim,
    );
    load_tile::<F>(
        grad,
        head_base::<F>(grad, bh, heads),
        grad.stride(2),
        grad.stride(3),
        q0,
        seq_q,
        &mut v_tile,
        head_dim,
    );
    sync_cube();
    let mut q_regs = Array::<Vector<F, Pair>>::new(head_dim / 4);
    let mut do_regs = Array::<Vector<F, Pair>>::new(head_dim / 4);
    a_operands_to_registers::<F>(&k_tile, warp * 16, &mut q_regs, head_dim, stride);
    a_operands_to_registers::<F>(&v_tile, warp * 16, &mut do_regs, head_dim, stride);

    // Each lane's two rows: their log-sum-exp and delta.
    let mut row_lse = Array::<f32>::new(2usize);
    let mut row_delta = Array::<f32>::new(2usize);
    #[unroll]
    for r in 0..2usize {
        let row = row0 + g + 8 * r;
        row_lse[r] = 0.0;
        row_delta[r] = 0.0;
        if row < seq_q {
            row_lse[r] = lse[bh * seq_q + row];
            row_delta[r] = delta[bh * seq_q + row];
        }
    }

    let mut dq = Array::<f32>::new(head_dim / 2);
    #[unroll]
    for i in 0..head_dim / 2 {
        dq[i] = 0.0;
    }

    let key_blocks = seq_k.div_ceil(BLOCK);
    let mut blocks = key_blocks;
    if causal {
        if CUBE_POS_X as usize + 1 < key_blocks {
            blocks = CUBE_POS_X as usize + 1;
        }
    }
    let (k_base, v_base) = (
        head_base::<F>(k, kv_bh, kv_heads),
        head_base::<F>(v, kv_bh, kv_heads),
    );
    for kb in 0..blocks {
        let k0 = kb * BLOCK;
        sync_cube();
        load_tile::<F>(
            k,
            k_base,
            k.stride(2),
            k.stride(3),
            k0,
            seq_k,
            &mut k_tile,
            head_dim,
        );
        load_tile::<F>(
            v,
            v_base,
            v.stride(2),
            v.stride(3),
            k0,
            seq_k,
            &mut v_tile,
            head_dim,
        );
        sync_cube();

        let mut s = Array::<f32>::new(32usize);
        let mut dp = Array::<f32>::new(32usize);
        #[unroll]
        for i in 0..32usize {
            s[i] = 0.0;
            dp[i] = 0.0;
        }
        #[unroll]
        for kk in 0..head_dim / 16 {
            let a_q = a_from_registers::<F>(&q_regs, kk);
            let a_do = a_from_registers::<F>(&do_regs, kk);
            #[unroll]
            for j in 0..8usize {
                let b = b_transposed::<F>(&k_tile, j * 8, kk, stride);
                mma::<F>(&a_q, &b, &mut s, j);
                let b = b_transposed::<F>(&v_tile, j * 8, kk, stride);
                mma::<F>(&a_do, &b, &mut dp, j);
            }
        }
        // dS = P ∘ (dP - delta), kept in `s`.
        #[unroll]
        for j in 0..8usize {
            #[unroll]
            for i in 0..4usize {
                let r = i / 2;
                let row = row0 + g + 8 * r;
                let key = k0 + j * 8 + 2 * t + i % 2;
                let at = j * 4 + i;
                let mut p = f32::exp(s[at] * scale - row_lse[r]);
                if key >= seq_k || row >= seq_q || (causal && key > row) {
                    p = 0.0;
                }
                s[at] = p * (dp[at] - row_delta[r]);
            }
        }
        #[unroll]
        for kk in 0..4usize {
            let a = a_from_accumulator::<F>(&s, kk);
            #[unroll]
            for jd in 0..head_dim / 8 {
                let b = b_direct::<F>(&k_tile, kk, jd * 8, stride);
                mma::<F>(&a, &b, &mut dq, jd);
            }
        }
    }

    let base = head_base::<F>(grad_q, bh, heads);
    #[unroll]
    for r in 0..2usize {
        let row = row0 + g + 8 * r;
        if row < seq_q {
            #[unroll]
            for jd in 0..head_dim / 8 {
                #[unroll]
                for e in 0..2usize {
                    let col = jd * 8 + 2 * t + e;
                    grad_q[base + row * grad_q.stride(2) + col * grad_q.stride(3)] =
                        F::cast_from(dq[jd * 4 + 2 * r + e] * scale);
                }
            }
        }
    }
}

/// `dK` and `dV`: one cube per 64 keys of a K/V head, walking the queries of every query head
/// of its group that can see them. Queries go in steps of `q_step` (64, or 32 at head dim 128
/// to stay within registers).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn grad_key_value_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    grad: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    grad_k: &mut Tensor<F>,
    grad_v: &mut Tensor<F>,
    scale: f32,
    seq_q: u32,
    seq_k: u32,
    kv_heads: u32,
    group: u32,
    #[comptime] head_dim: usize,
    #[comptime] q_step: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let stride = comptime!(head_dim + PAD);
    let lane = UNIT_POS_X as usize;
    let warp = UNIT_POS_Y as usize;
    let (g, t) = (lane / 4, lane % 4);
    let (seq_q, seq_k) = (seq_q as usize, seq_k as usize);
    let (kv_heads, group) = (kv_heads as usize, group as usize);
    let heads = kv_heads * group;
    let kv_bh = CUBE_POS_Y as usize;
    let k0 = CUBE_POS_X as usize * BLOCK;
    let key0 = k0 + warp * 16;

    let mut q_tile = SharedMemory::<Vector<F, Pair>>::new(BLOCK * stride / 2);
    let mut do_tile = SharedMemory::<Vector<F, Pair>>::new(BLOCK * stride / 2);
    let mut lse_tile = SharedMemory::<f32>::new(BLOCK);
    let mut delta_tile = SharedMemory::<f32>::new(BLOCK);

    load_tile::<F>(
        k,
        head_base::<F>(k, kv_bh, kv_heads),
        k.stride(2),
        k.stride(3),
        k0,
        seq_k,
        &mut q_tile,
        head_dim,
    );
    load_tile::<F>(
        v,
        head_base::<F>(v, kv_bh, kv_heads),
        v.stride(2),
        v.stride(3),
        k0,
        seq_k,
        &mut do_tile,
        head_dim,
    );
    sync_cube();
    let mut k_regs = Array::<Vector<F, Pair>>::new(head_dim / 4);
    let mut v_regs = Array::<Vector<F, Pair>>::new(head_dim / 4);
    a_operands_to_registers::<F>(&q_tile, warp * 16, &mut k_regs, head_dim, stride);
    a_operands_to_registers::<F>(&do_tile, warp * 16, &mut v_regs, head_dim, stride);

    let mut dk = Array::<f32>::new(head_dim / 2);
    let mut dv = Array::<f32>::new(head_dim / 2);
    #[unroll]
    for i in 0..head_dim / 2 {
        dk[i] = 0.0;
        dv[i] = 0.0;
    }

    let tid = (UNIT_POS_Y * 32 + UNIT_POS_X) as usize;
    let mut first = 0usize;
    if causal {
        first = k0 / q_step;
    }
    let steps = seq_q.div_ceil(q_step);
    let batch = kv_bh / kv_heads;
    for member in 0..group {
        let bh = batch * heads + (kv_bh % kv_heads) * group + member;
        let (q_base, do_base) = (
            head_base::<F>(q, bh, heads),
            head_base::<F>(grad, bh, heads),
        );
        for qs in first..steps {
            let q0 = qs * q_step;
            sync_cube();
            load_tile::<F>(
                q,
                q_base,
                q.stride(2),
                q.stride(3),
                q0,
                seq_q,
                &mut q_tile,
                head_dim,
            );
            load_tile::<F>(
                grad,
                do_base,
                grad.stride(2),
                grad.stride(3),
                q0,
                seq_q,
                &mut do_tile,
                head_dim,
            );
            if tid < q_step {
                let query = q0 + tid;
                let mut l = f32::new(-MASKED);
                let mut d = f32::new(0.0);
                if query < seq_q {
                    l = lse[bh * seq_q + query];
                    d = delta[bh * seq_q + query];
                }
                lse_tile[tid] = l;
                delta_tile[tid] = d;
            }
            sync_cube();

            // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ: rows are the warp's 16 keys, columns `q_step` queries.
            let mut s = Array::<f32>::new(q_step / 2);
            let mut dp = Array::<f32>::new(q_step / 2);
            #[unroll]
            for i in 0..q_step / 2 {
                s[i] = 0.0;
                dp[i] = 0.0;
            }
            #[unroll]
            for kk in 0..head_dim / 16 {
                let a_k = a_from_registers::<F>(&k_regs, kk);
                let a_v = a_from_registers::<F>(&v_regs, kk);
                #[unroll]
                for j in 0..q_step / 8 {
                    let b = b_transposed::<F>(&q_tile, j * 8, kk, stride);
                    mma::<F>(&a_k, &b, &mut s, j);
                    let b = b_transposed::<F>(&do_tile, j * 8, kk, stride);
                    mma::<F>(&a_v, &b, &mut dp, j);
                }
            }
            // Pᵀ in `s`, dSᵀ = Pᵀ ∘ (dPᵀ - delta) in `dp`.
            #[unroll]
            for j in 0..q_step / 8 {
                #[unroll]
                for i in 0..4usize {
                    let key = key0 + g + 8 * (i / 2);
                    let column = j * 8 + 2 * t + i % 2;
                    let query = q0 + column;
                    let at = j * 4 + i;
                    let mut p = f32::exp(s[at] * scale - lse_tile[column]);
                    if key >= seq_k || (causal && key > query) {
                        p = 0.0;
                    }
                    s[at] = p;
                    dp[at] = p * (dp[at] - delta_tile[column]);
                }
            }
            // dV += Pᵀ dO, dK += dSᵀ Q.
            #[unroll]
            for kk in 0..q_step / 16 {
                let a_p = a_from_accumulator::<F>(&s, kk);
                let a_ds = a_from_accumulator::<F>(&dp, kk);
                #[unroll]
                for jd in 0..head_dim / 8 {
                    let b = b_direct::<F>(&do_tile, kk, jd * 8, stride);
                    mma::<F>(&a_p, &b, &mut dv, jd);
                    let b = b_direct::<F>(&q_tile, kk, jd * 8, stride);
                    mma::<F>(&a_ds, &b, &mut dk, jd);
                }
            }
        }
    }

    let (k_out, v_out) = (
        head_base::<F>(grad_k, kv_bh, kv_heads),
        head_base::<F>(grad_v, kv_bh, kv_heads),
    );
    #[unroll]
    for r in 0..2usize {
        let key = key0 + g + 8 * r;
        if key < seq_k {
            #[unroll]
            for jd in 0..head_dim / 8 {
                #[unroll]
                for e in 0..2usize {
                    let col = jd * 8 + 2 * t + e;
                    let at = jd * 4 + 2 * r + e;
                    grad_k[k_out + key * grad_k.stride(2) + col * grad_k.stride(3)] =
                        F::cast_from(dk[at] * scale);
                    grad_v[v_out + key * grad_v.stride(2) + col * grad_v.stride(3)] =
                        F::cast_from(dv[at]);
                }
            }
        }
    }
}

/// `[batch, heads, seq, head_dim]` of a 4D tensor.
fn dims4(shape: &Shape) -> [usize; 4] {
    let d = shape.as_slice();
    assert_eq!(
        d.len(),
        4,
        "attention takes [batch, heads, seq, head_dim] tensors"
    );
    [d[0], d[1], d[2], d[3]]
}

/// Whether this path runs `q` (and its `k`, `v`): f16 or bf16, head dim 64 or 128, and a
/// runtime with `m16n8k16` MMA for that type.
pub fn supports<R: CubeRuntime>(q: &CubeTensor<R>) -> bool {
    let [batch, heads, _, head_dim] = dims4(q.meta.shape());
    let elem = match q.dtype {
        DType::F16 => ElemType::Float(FloatKind::F16),
        DType::BF16 => ElemType::Float(FloatKind::BF16),
        _ => return false,
    };
    let config = MmaConfig {
        a_type: StorageType::Scalar(elem),
        b_type: StorageType::Scalar(elem),
        cd_type: StorageType::Scalar(ElemType::Float(FloatKind::F32)),
        m: 16,
        n: 8,
        k: 16,
    };
    matches!(head_dim, 64 | 128)
        && batch * heads <= 65_535
        && q.client.features().matmul.mma.contains(&config)
}

fn cube_dim() -> CubeDim {
    CubeDim::new_2d(32, WARPS)
}

/// The output (`q`'s shape and dtype) and the log-sum-exp (`[batch, heads, seq_q]`, f32) of
/// `softmax(scale · q kᵀ (+ causal mask)) v`. Callers check [`supports`] first.
pub fn forward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    scale: f32,
    causal: bool,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let [batch, heads, seq_q, _] = dims4(q.meta.shape());
    let client = q.client.clone();
    let out = empty_device_contiguous_dtype::<R>(
        client.clone(),
        q.device.clone(),
        q.meta.shape().clone(),
        q.dtype,
    );
    let lse = empty_device_contiguous_dtype::<R>(
        client,
        q.device.clone(),
        Shape::new([batch, heads, seq_q]),
        DType::F32,
    );
    forward_into(q, k, v, out.clone(), lse.clone(), scale, causal);
    (out, lse)
}

/// [`forward`] writing the output into `out` (q's shape, any strides, e.g. a `[batch, seq,
/// heads, head_dim]` buffer seen as `[batch, heads, seq, head_dim]`) and the log-sum-exp into
/// `lse` (`[batch, heads, seq_q]`, f32, contiguous).
#[allow(clippy::too_many_arguments)]
pub fn forward_into<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    scale: f32,
    causal: bool,
) {
    let [batch, heads, seq_q, head_dim] = dims4(q.meta.shape());
    let [_, kv_heads, seq_k, _] = dims4(k.meta.shape());
    if batch * heads * seq_q == 0 {
        return;
    }
    let client = q.client.clone();
    let dtype = q.dtype.into();
    forward_kernel::launch::<R>(
        &client,
        CubeCount::Static(seq_q.div_ceil(BLOCK) as u32, (batch * heads) as u32, 1),
        cube_dim(),
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        out.into_tensor_arg(),
        lse.into_tensor_arg(),
        scale,
        seq_q as u32,
        seq_k as u32,
        heads as u32,
        (heads / kv_heads) as u32,
        head_dim,
        causal,
        dtype,
    );
}

/// `[dq, dk, dv]` of [`forward`] given its output, log-sum-exp and the output's gradient;
/// `dk`, `dv` in `k`'s shape, summed over the query heads sharing each K/V head.
#[allow(clippy::too_many_arguments)]
pub fn backward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    grad: CubeTensor<R>,
    scale: f32,
    causal: bool,
) -> [CubeTensor<R>; 3] {
    let client = q.client.clone();
    let empty = |shape: &Shape, dtype| {
        empty_device_contiguous_dtype::<R>(client.clone(), q.device.clone(), shape.clone(), dtype)
    };
    let grads = [
        empty(q.meta.shape(), q.dtype),
        empty(k.meta.shape(), k.dtype),
        empty(v.meta.shape(), v.dtype),
    ];
    backward_into(q, k, v, out, lse, grad, grads.clone(), scale, causal);
    grads
}

/// [`backward`] writing `[dq, dk, dv]` into `grads` (q's, k's and v's shapes, any strides).
/// Nothing is written when there is no query row or no key.
#[allow(clippy::too_many_arguments)]
pub fn backward_into<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    grad: CubeTensor<R>,
    grads: [CubeTensor<R>; 3],
    scale: f32,
    causal: bool,
) {
    let [batch, heads, seq_q, head_dim] = dims4(q.meta.shape());
    let [_, kv_heads, seq_k, _] = dims4(k.meta.shape());
    if batch * heads * seq_q == 0 || seq_k == 0 {
        return;
    }
    let [grad_q, grad_k, grad_v] = grads;
    let client = q.client.clone();
    let dims = super::Dims {
        batch,
        heads,
        kv_heads,
        seq_q,
        seq_k,
        head_dim,
    };
    let delta = super::portable::delta(out, grad.clone(), dims);
    let dtype: StorageType = q.dtype.into();
    let group = (heads / kv_heads) as u32;
    grad_query_kernel::launch::<R>(
        &client,
        CubeCount::Static(seq_q.div_ceil(BLOCK) as u32, (batch * heads) as u32, 1),
        cube_dim(),
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        grad.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        grad_q.into_tensor_arg(),
        scale,
        seq_q as u32,
        seq_k as u32,
        heads as u32,
        group,
        head_dim,
        causal,
        dtype,
    );
    let q_step = if head_dim > 64 { 32 } else { 64 };
    grad_key_value_kernel::launch::<R>(
        &client,
        CubeCount::Static(seq_k.div_ceil(BLOCK) as u32, (batch * kv_heads) as u32, 1),
        cube_dim(),
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        grad.into_tensor_arg(),
        lse.into_tensor_arg(),
        delta.into_tensor_arg(),
        grad_k.into_tensor_arg(),
        grad_v.into_tensor_arg(),
        scale,
        seq_q as u32,
        seq_k as u32,
        kv_heads as u32,
        group,
        head_dim,
        q_step,
        causal,
        dtype,
    );
}
