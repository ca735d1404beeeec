//! Copying a box-shaped region between two row-major tensors held as raw bytes: how a rank
//! cuts its slice out of its local tensor on save, and assembles its local tensor from the
//! saved slices that overlap it on load.

use std::ops::Range;

/// A box in a tensor: one range per dimension.
pub(crate) type Region = Vec<Range<usize>>;

/// The intersection of two boxes, `None` when empty.
pub(crate) fn intersect(a: &[Range<usize>], b: &[Range<usize>]) -> Option<Region> {
    let out: Region = a
        .iter()
        .zip(b)
        .map(|(x, y)| x.start.max(y.start)..x.end.min(y.end))
        .collect();
    out.iter().all(|r| r.start < r.end).then_some(out)
}

/// Elements in a box.
pub(crate) fn volume(region: &[Range<usize>]) -> usize {
    region.iter().map(|r| r.len()).product()
}

/// Copies the box `region` (in global coordinates) from `src`, a tensor of shape `src_shape`
/// whose element `[0, ..]` is global `src_origin`, into `dst` (shape `dst_shape`, origin
/// `dst_origin`). Elements are `elem` bytes. The region must lie inside both.
pub(crate) fn copy_region(
    region: &[Range<usize>],
    elem: usize,
    (src, src_shape, src_origin): (&[u8], &[usize], &[usize]),
    (dst, dst_shape, dst_origin): (&mut [u8], &[usize], &[usize]),
) {
    let rank = region.len();
    if rank == 0 {
        dst[..elem].copy_from_slice(&src[..elem]);
        return;
    }
    let strides = |shape: &[usize]| -> Vec<usize> {
        let mut s = vec![1; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            s[d] = s[d + 1] * shape[d + 1];
        }
        s
    };
    let (ss, ds) = (strides(src_shape), strides(dst_shape));
    // The innermost dimension is copied as one contiguous run per index of the others.
    let run = region[rank - 1].len() * elem;
    let mut index: Vec<usize> = region.iter().map(|r| r.start).collect();
    loop {
        let offset = |strides: &[usize], origin: &[usize]| -> usize {
            index
                .iter()
                .zip(origin)
                .zip(strides)
                .map(|((i, o), s)| (i - o) * s)
                .sum::<usize>()
                * elem
        };
        let (so, d_o) = (offset(&ss, src_origin), offset(&ds, dst_origin));
        dst[d_o..d_o + run].copy_from_slice(&src[so..so + run]);
        // Advance the outer dimensions like an odometer.
        let mut d = rank - 1;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < region[d].end {
                break;
            }
            index[d] = region[d].start;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_a_box_between_offset_tensors() {
        // A 4 × 6 global tensor of u8 values 10·i + j; src holds rows 1..4, cols 2..6.
        let global = |i: usize, j: usize| (10 * i + j) as u8;
        let src: Vec<u8> = (1..4)
            .flat_map(|i| (2..6).map(move |j| global(i, j)))
            .collect();
        // dst holds rows 2..4, cols 0..4; the region is rows 2..4, cols 2..4.
        let mut dst = vec![0u8; 2 * 4];
        copy_region(
            &[2..4, 2..4],
            1,
            (&src, &[3, 4], &[1, 2]),
            (&mut dst, &[2, 4], &[2, 0]),
        );
        assert_eq!(dst, vec![0, 0, 22, 23, 0, 0, 32, 33]);
        assert_eq!(
            intersect(&[0..4, 2..6], &[2..5, 0..3]),
            Some(vec![2..4, 2..3])
        );
        assert_eq!(intersect(&[0..2, 0..1], &[2..3, 0..1]), None);
    }
}
