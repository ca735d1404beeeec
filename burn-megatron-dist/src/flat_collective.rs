//! How an all-gather or reduce-scatter along one dimension becomes a flat NCCL call.
//!
//! NCCL gathers and scatters whole contiguous buffers: an all-gather concatenates the ranks'
//! buffers, and a reduce-scatter gives rank `r` the `r`-th of `n` equal pieces of the reduced
//! buffer. Along dimension 0, or when every dimension before `dim` has size 1 (a sequence
//! dimension of `[1, tokens, hidden]`), that is already the tensor's own memory order and no
//! element moves. Along an inner dimension (the sequence of `[batch, seq, hidden]`) the
//! rank-major order differs from the tensor's, and one copy reorders it: after the gather,
//! or before the scatter. (Swapping `dim` to the front and back costs two copies: one into
//! NCCL, one after it.)

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// The elements before `dim` (`outer`) and from `dim` on (`inner`), for `dims`.
fn split_at(dims: &[usize], dim: usize) -> (usize, usize) {
    (dims[..dim].iter().product(), dims[dim..].iter().product())
}

/// The all-gather along `dim` of `n` parts of shape `part`, from NCCL's flat output (the
/// ranks' parts one after the other, `[n · numel(part)]`).
pub(crate) fn gathered_along<B: Backend, const D: usize>(
    flat: Tensor<B, 1>,
    part: [usize; D],
    n: usize,
    dim: usize,
) -> Tensor<B, D> {
    let (outer, inner) = split_at(&part, dim);
    let mut shape = part;
    shape[dim] *= n;
    if outer == 1 {
        return flat.reshape(shape);
    }
    // `[rank, outer, inner]` → `[outer, rank, inner]`: one copy.
    flat.reshape([n, outer, inner])
        .swap_dims(0, 1)
        .reshape(shape)
}

/// `x` in the flat order a reduce-scatter along `dim` over `n` ranks needs: rank `r`'s shard
/// (`[r · len / n, (r + 1) · len / n)` along `dim`) as the `r`-th of `n` equal pieces.
/// `x.dims()[dim]` must be a multiple of `n`.
pub(crate) fn rank_major<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    n: usize,
    dim: usize,
) -> Tensor<B, 1> {
    let dims = x.dims();
    debug_assert!(
        dims[dim].is_multiple_of(n),
        "the scattered dimension splits evenly"
    );
    let (outer, inner) = split_at(&dims, dim);
    if outer == 1 {
        return x.reshape([outer * inner]);
    }
    // `[outer, rank, inner / rank]` → `[rank, outer, inner / rank]`: one copy.
    x.reshape([outer, n, inner / n])
        .swap_dims(0, 1)
        .reshape([outer * inner])
}

/// The shape of one rank's shard of a reduce-scatter of `dims` along `dim` over `n` ranks
/// (an even split).
pub(crate) fn scattered_shape<const D: usize>(
    dims: [usize; D],
    n: usize,
    dim: usize,
) -> [usize; D] {
    let mut shape = dims;
    shape[dim] /= n;
    shape
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::{Distribution, Tensor};

    type B = NdArray<f32>;

    fn random<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<B, D> {
        B::seed(&Default::default(), seed);
        Tensor::random(shape, Distribution::Uniform(-1.0, 1.0), &Default::default())
    }

    /// What NCCL's all-gather gives: the ranks' buffers in their memory order, concatenated.
    fn nccl_all_gather<const D: usize>(parts: &[Tensor<B, D>]) -> Tensor<B, 1> {
        let flats = parts
            .iter()
            .map(|p| {
                let numel = p.shape().num_elements();
                p.clone().reshape([numel])
            })
            .collect();
        Tensor::cat(flats, 0)
    }

    fn assert_same<const D: usize>(got: Tensor<B, D>, want: Tensor<B, D>) {
        assert_eq!(got.dims(), want.dims());
        let (got, want) = (got.into_data(), want.into_data());
        assert_eq!(
            got.as_slice::<f32>().unwrap(),
            want.as_slice::<f32>().unwrap()
        );
    }

    const CASES: [([usize; 3], usize); 6] = [
        ([6, 5, 4], 0),
        ([3, 5, 4], 1),
        ([3, 5, 4], 2),
        ([1, 7, 4], 1),
        ([1, 1, 9], 2),
        ([2, 1, 3], 1),
    ];

    #[test]
    fn gathering_flat_buffers_equals_concatenating_along_the_dimension() {
        for (part, dim) in CASES {
            for n in [1, 2, 3] {
                let parts: Vec<_> = (0..n).map(|r| random(part, 10 + r as u64)).collect();
                let got = gathered_along(nccl_all_gather(&parts), part, n, dim);
                assert_same(got, Tensor::cat(parts, dim));
            }
        }
    }

    #[test]
    fn the_rank_major_pieces_are_the_shards_along_the_dimension() {
        for (shape, dim) in CASES {
            let n = shape[dim];
            let x = random(shape, 7);
            let flat = rank_major(x.clone(), n, dim);
            let piece = shape.iter().product::<usize>() / n;
            let want_shape = scattered_shape(shape, n, dim);
            for r in 0..n {
                let got = flat.clone().narrow(0, r * piece, piece).reshape(want_shape);
                let len = shape[dim] / n;
                assert_same(got, x.clone().narrow(dim, r * len, len));
            }
        }
    }

    #[test]
    fn reducing_the_pieces_of_every_rank_gives_each_its_reduced_shard() {
        let (shape, dim, n) = ([3, 6, 4], 1, 3);
        let xs: Vec<_> = (0..n).map(|r| random(shape, 20 + r as u64)).collect();
        let piece = 3 * 6 * 4 / n;
        let sum = xs.iter().cloned().reduce(|a, b| a + b).unwrap();
        let flats: Vec<_> = xs.into_iter().map(|x| rank_major(x, n, dim)).collect();
        for r in 0..n {
            // NCCL's reduce-scatter: the `r`-th piece of every rank's buffer, summed.
            let reduced = flats
                .iter()
                .map(|f| f.clone().narrow(0, r * piece, piece))
                .reduce(|a, b| a + b)
                .unwrap();
            let got = reduced.reshape(scattered_shape(shape, n, dim));
            assert_same(got, sum.clone().narrow(dim, r * 2, 2));
        }
    }
}
