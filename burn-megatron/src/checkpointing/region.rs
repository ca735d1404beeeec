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
    for_each_run(
        region,
        elem,
        [(src_shape, src_origin), (dst_shape, dst_origin)],
        |[s, d], run| dst[d..d + run].copy_from_slice(&src[s..s + run]),
    );
}

/// The byte ranges of `src` (shape `src_shape`, origin `src_origin`) that a copy of `region`
/// reads, one contiguous run at a time: what a partial read must check and page in.
pub(crate) fn source_runs(
    region: &[Range<usize>],
    elem: usize,
    src_shape: &[usize],
    src_origin: &[usize],
    mut f: impl FnMut(Range<usize>),
) {
    for_each_run(region, elem, [(src_shape, src_origin)], |[s], run| {
        f(s..s + run)
    });
}

/// Calls `f` with the byte offset of each contiguous run of `region` in each of `N` tensors
/// (shape, origin of its element `[0, ..]` in global coordinates), and the run's length in
/// bytes. The innermost dimension is one run per index of the others.
fn for_each_run<const N: usize>(
    region: &[Range<usize>],
    elem: usize,
    tensors: [(&[usize], &[usize]); N],
    mut f: impl FnMut([usize; N], usize),
) {
    let rank = region.len();
    if rank == 0 {
        f([0; N], elem);
        return;
    }
    let strides = tensors.map(|(shape, _)| {
        let mut s = vec![1; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            s[d] = s[d + 1] * shape[d + 1];
        }
        s
    });
    let run = region[rank - 1].len() * elem;
    let mut index: Vec<usize> = region.iter().map(|r| r.start).collect();
    loop {
        let offsets = std::array::from_fn(|t| {
            let origin = tensors[t].1;
            index
                .iter()
                .zip(origin)
                .zip(&strides[t])
                .map(|((i, o), s)| (i - o) * s)
                .sum::<usize>()
                * elem
        });
        f(offsets, run);
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

/// The boxes of a row-major tensor of `shape` whose elements are, in order, exactly the flat
/// element range `range`. Each box is itself contiguous in row-major order. This is how a
/// distributed-optimizer shard, a flat range of a parameter, is stored as slices of it.
pub(crate) fn flat_range_boxes(shape: &[usize], range: Range<usize>) -> Vec<Region> {
    let mut out = Vec::new();
    flat_boxes(shape, range, &mut out);
    out
}

fn flat_boxes(shape: &[usize], range: Range<usize>, out: &mut Vec<Region>) {
    if range.is_empty() {
        return;
    }
    let Some((_, rest)) = shape.split_first() else {
        out.push(Vec::new());
        return;
    };
    let inner: usize = rest.iter().product();
    if inner == 0 {
        return;
    }
    let in_row = |row: usize, sub: Range<usize>, out: &mut Vec<Region>| {
        let mut boxes = Vec::new();
        flat_boxes(rest, sub, &mut boxes);
        out.extend(
            boxes
                .into_iter()
                .map(|b| std::iter::once(row..row + 1).chain(b).collect()),
        );
    };
    let (mut start, end) = (range.start, range.end);
    if start % inner != 0 {
        let row = start / inner;
        let stop = end.min((row + 1) * inner);
        in_row(row, start - row * inner..stop - row * inner, out);
        start = stop;
    }
    if start >= end {
        return;
    }
    let (first, last) = (start / inner, end / inner);
    if last > first {
        out.push(
            std::iter::once(first..last)
                .chain(rest.iter().map(|&n| 0..n))
                .collect(),
        );
    }
    if end % inner != 0 {
        in_row(last, 0..end % inner, out);
    }
}

/// The index of a box's first element in the row-major order of a tensor of `shape`.
pub(crate) fn flat_start(shape: &[usize], region: &[Range<usize>]) -> usize {
    shape
        .iter()
        .zip(region)
        .fold(0, |acc, (&n, r)| acc * n + r.start)
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

    /// Every flat range of a few shapes: the boxes are contiguous, in order, and cover the
    /// range exactly.
    #[test]
    fn flat_ranges_become_contiguous_boxes() {
        for shape in [vec![7], vec![3, 4], vec![2, 3, 5], vec![1, 4, 1, 3]] {
            let n: usize = shape.iter().product();
            for start in 0..=n {
                for end in start..=n {
                    let mut next = start;
                    let origin = vec![0; shape.len()];
                    for b in flat_range_boxes(&shape, start..end) {
                        assert_eq!(flat_start(&shape, &b), next, "{shape:?} {start}..{end}");
                        source_runs(&b, 1, &shape, &origin, |run| {
                            assert_eq!(run.start, next, "{shape:?} {start}..{end}: {b:?}");
                            next = run.end;
                        });
                    }
                    assert_eq!(next, end, "{shape:?} {start}..{end}");
                }
            }
        }
        assert_eq!(
            flat_range_boxes(&[3, 4], 2..11),
            vec![vec![0..1, 2..4], vec![1..2, 0..4], vec![2..3, 0..3]]
        );
    }
}
