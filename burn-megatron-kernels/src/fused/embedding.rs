//! The token embedding's weight gradient, `dW[v] = Σ_{t: ids[t] = v} dY[t]`, in one
//! deterministic kernel.
//!
//! Burn's `embedding_backward` is a `select_add` whose kernel gives one thread to each hidden
//! column and loops over every token: 768 threads walking 16k tokens, 6.5 ms of a 64 ms GPT-2
//! step on an H100. Here the vocabulary is split into `buckets` by `id % buckets`, and one cube
//! owns a bucket and a block of hidden columns (one [`Vector`] a thread):
//!
//! 1. The cube walks all token ids in order, a chunk at a time. Each thread tests a run of
//!    ids; a scan of the per-thread counts in shared memory packs the chunk's tokens of this
//!    bucket into a list, still in token order.
//! 2. A row's first token `t` in the bucket claims row `t` of a `[tokens, hidden]` f32
//!    scratch (one thread records it in shared memory), so the scratch is as large as the
//!    batch, not the vocabulary, and needs no zeroing.
//! 3. For each listed token, every thread adds its columns of `dY[t]` to the row's f32 sum:
//!    one thread owns each (row, column), so there are no atomics, and each sum is taken in
//!    token order, the same bits as a sequential loop.
//! 4. Last, the cube writes its rows of `dW` in the gradient's dtype: the sum for a row some
//!    token hit, zero for the others. No zero-fill or cast pass over `[vocab, hidden]`.
//!
//! Every branch on the id is uniform over the cube, and nothing waits on the host. One cube
//! walks all of a bucket's tokens, so a very frequent id (`,` or ` the`, a few per cent of
//! real text) makes its bucket the longest chain.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::vectors::vector_width;

/// Threads per cube: the columns a cube owns are `THREADS` vectors wide.
const THREADS: u32 = 128;
/// Token ids each thread tests per chunk.
const IDS_PER_THREAD: usize = 8;
/// Token ids a cube takes from the batch at a time.
const CHUNK: usize = THREADS as usize * IDS_PER_THREAD;
/// The model's number of vocabulary buckets: enough cubes to fill a GPU, few enough that
/// every cube's walk over all ids stays short.
pub const BUCKETS: usize = 256;

/// Whether `id` is a row of this bucket (ids outside the vocabulary belong to none).
#[cube]
fn in_bucket(id: u32, vocab: u32, buckets: u32, bucket: u32) -> bool {
    id < vocab && id % buckets == bucket
}

#[cube(launch)]
fn accumulate_kernel<F: Float, I: Int, N: Size>(
    ids: &Tensor<I>,
    grad: &Tensor<Vector<F, N>>,
    sums: &mut Tensor<Vector<f32, N>>,
    output: &mut Tensor<Vector<F, N>>,
    vocab: u32,
    buckets: u32,
    #[comptime] rows_per_bucket: usize,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let bucket = CUBE_POS_Y;
    let tid = UNIT_POS_X as usize;
    let threads = CUBE_DIM_X as usize;
    let width = N::value();
    let vectors = output.shape(1) / width;
    let column = CUBE_POS_X as usize * threads + tid;
    let tokens = ids.shape(0);
    // Element offsets to vector offsets: the vectorised axis has stride 1 whenever `width`
    // is above 1, and every other stride is a multiple of `width`.
    let grad_column = column * width * grad.stride(1);
    let sums_column = column * width * sums.stride(1);
    let output_column = column * width * output.stride(1);

    // Per local row (`id / buckets`): 1 + the scratch row holding its sum, 0 while unseen.
    let mut slots = SharedMemory::<u32>::new(rows_per_bucket);
    let mut offsets = SharedMemory::<u32>::new(THREADS as usize);
    let mut listed_tokens = SharedMemory::<u32>::new(CHUNK);
    let mut listed_slots = SharedMemory::<u32>::new(CHUNK);
    let mut r = tid;
    while r < rows_per_bucket {
        slots[r] = 0;
        r += threads;
    }
    sync_cube();

    let mut start = 0usize;
    while start < tokens {
        // 1. Pack this chunk's tokens of the bucket, in order: thread `tid` tests a run of
        // ids, an inclusive scan of the counts gives each run its place in the list.
        let first = start + tid * IDS_PER_THREAD;
        let mut count = 0u32;
        #[unroll]
        for k in 0..IDS_PER_THREAD {
            let t = first + k;
            if t < tokens {
                let id = u32::cast_from(ids[t * ids.stride(0)]);
                if in_bucket(id, vocab, buckets, bucket) {
                    count += 1;
                }
            }
        }
        offsets[tid] = count;
        sync_cube();
        let mut step = 1usize;
        while step < threads {
            let mut total = offsets[tid];
            if tid >= step {
                total += offsets[tid - step];
            }
            sync_cube();
            offsets[tid] = total;
            sync_cube();
            step *= 2;
        }
        let mut at = (offsets[tid] - count) as usize;
        #[unroll]
        for k in 0..IDS_PER_THREAD {
            let t = first + k;
            if t < tokens {
                let id = u32::cast_from(ids[t * ids.stride(0)]);
                if in_bucket(id, vocab, buckets, bucket) {
                    listed_tokens[at] = t as u32;
                    listed_slots[at] = id / buckets;
                    at += 1;
                }
            }
        }
        sync_cube();
        let listed = offsets[threads - 1] as usize;

        // 2. Rows seen for the first time claim the scratch row of their token.
        if tid == 0 {
            for e in 0..listed {
                let row = listed_slots[e] as usize;
                if slots[row] == 0 {
                    slots[row] = listed_tokens[e] + 1;
                }
                listed_slots[e] = slots[row] - 1;
            }
        }
        sync_cube();

        // 3. Add each listed token's gradient to its row's sum, in token order.
        if column < vectors {
            for e in 0..listed {
                let t = listed_tokens[e] as usize;
                let slot = listed_slots[e] as usize;
                let g =
                    Vector::<f32, N>::cast_from(grad[(t * grad.stride(0) + grad_column) / width]);
                let at = (slot * sums.stride(0) + sums_column) / width;
                if slot == t {
                    sums[at] = g;
                } else {
                    sums[at] = sums[at] + g;
                }
            }
        }
        // The next chunk overwrites the list.
        sync_cube();
        start += CHUNK;
    }

    // 4. This cube's rows of the gradient.
    if column < vectors {
        for r in 0..rows_per_bucket {
            let v = r * buckets as usize + bucket as usize;
            if v < vocab as usize {
                let slot = slots[r] as usize;
                let mut value = Vector::<F, N>::new(F::new(0.0));
                if slot > 0 {
                    value = Vector::cast_from(
                        sums[((slot - 1) * sums.stride(0) + sums_column) / width],
                    );
                }
                output[(v * output.stride(0) + output_column) / width] = value;
            }
        }
    }
}

/// The gradient of an embedding table of `vocab` rows from the gradient of its output, `grad`
/// (`[tokens, hidden]`, any strides, f32/f16/bf16), and the looked-up `ids` (`[tokens]`, any
/// int dtype): `[vocab, hidden]` in `grad`'s dtype, row `v` the sum of `grad`'s rows whose id
/// is `v`, added in token order in f32. Ids outside `0..vocab` add nothing. `buckets` splits
/// the vocabulary over cubes ([`BUCKETS`] for the model; tests pick small ones to give a
/// bucket many rows).
pub fn embedding_backward<R: CubeRuntime>(
    grad: CubeTensor<R>,
    ids: CubeTensor<R>,
    vocab: usize,
    buckets: usize,
) -> CubeTensor<R> {
    let dims = grad.meta.shape().as_slice();
    assert_eq!(
        dims.len(),
        2,
        "the embedding gradient takes [tokens, hidden]"
    );
    let (tokens, hidden) = (dims[0], dims[1]);
    assert_eq!(
        ids.meta.shape().as_slice(),
        [tokens],
        "one id per gradient row"
    );
    assert!(buckets > 0, "at least one vocabulary bucket");
    let client = grad.client.clone();
    let output = empty_device_contiguous_dtype::<R>(
        client.clone(),
        grad.device.clone(),
        Shape::new([vocab, hidden]),
        grad.dtype,
    );
    if vocab * hidden == 0 {
        return output;
    }
    // The scratch of per-row f32 sums: one row per token, the first token of each id.
    let sums = empty_device_contiguous_dtype::<R>(
        client.clone(),
        grad.device.clone(),
        Shape::new([tokens.max(1), hidden]),
        DType::F32,
    );
    let width = vector_width(&[&grad, &output, &sums]);
    let blocks = (hidden / width).div_ceil(THREADS as usize);
    let buckets = buckets.min(vocab);
    let dtypes = [grad.dtype.into(), ids.dtype.into()];
    accumulate_kernel::launch::<R>(
        &client,
        CubeCount::Static(blocks as u32, buckets as u32, 1),
        CubeDim::new_1d(THREADS),
        width,
        ids.into_tensor_arg(),
        grad.into_tensor_arg(),
        sums.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        vocab as u32,
        buckets as u32,
        // A compile-time bound, rounded up so that tables whose row count changes every call
        // (the MoE dispatcher's gathers) share a few compiled kernels instead of compiling
        // one each; rows past the table are skipped.
        vocab.div_ceil(buckets).next_power_of_two(),
        dtypes,
    );
    output
}
