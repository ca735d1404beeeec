//! The fused kernels' launch layouts, which are plain host arithmetic: every thread a vector,
//! every dimension within the runtimes' limits.

use burn::tensor::Shape;
use burn_megatron_kernels::fused::column_sum::{ColumnSumLayout, ColumnWalk};
use burn_megatron_kernels::fused::vectors::{ElementwiseLayout, THREADS, launch_shape, rows_cols};
use cubecl::prelude::CubeCount;

fn dims(count: CubeCount) -> (u32, u32, u32) {
    match count {
        CubeCount::Static(x, y, z) => (x, y, z),
        CubeCount::Dynamic(_) => panic!("a launch layout is static"),
    }
}

#[test]
fn launch_shapes_cover_the_threads_within_the_limits() {
    assert_eq!(dims(launch_shape(0)), (1, 1, 1));
    assert_eq!(dims(launch_shape(1)), (1, 1, 1));
    assert_eq!(dims(launch_shape(THREADS as usize)), (1, 1, 1));
    assert_eq!(dims(launch_shape(THREADS as usize + 1)), (2, 1, 1));
    // Past 65 535 cubes along x, y takes the rest.
    let threads = 65_536 * THREADS as usize;
    assert_eq!(dims(launch_shape(threads)), (65_535, 2, 1));
    for threads in [1, 255, 256, 257, 1 << 20, 70_000 * 256 + 3, 1 << 31] {
        let (x, y, z) = dims(launch_shape(threads));
        assert!(
            x <= 65_535 && y <= 65_535 && z == 1,
            "{threads}: {x} {y} {z}"
        );
        let cubes = x as usize * y as usize;
        assert!(
            cubes * THREADS as usize >= threads,
            "{threads} threads uncovered"
        );
        // At most one row of cubes too many.
        assert!((cubes - x as usize) * (THREADS as usize) < threads.max(1));
    }
}

#[test]
fn elementwise_layouts_cover_rows_and_vectors() {
    assert_eq!(ElementwiseLayout::default(), ElementwiseLayout::Flat);
    assert_eq!(ElementwiseLayout::Flat.rows_per_thread(), 1);
    assert_eq!(ElementwiseLayout::Rows(4).rows_per_thread(), 4);
    assert_eq!(ElementwiseLayout::Rows(0).rows_per_thread(), 1);

    assert_eq!(
        dims(ElementwiseLayout::Flat.cube_count(100, 512)),
        dims(launch_shape(100 * 512))
    );
    // Rows(2): x over a row's 1 000 vectors, y over 50 blocks of two rows.
    assert_eq!(
        dims(ElementwiseLayout::Rows(2).cube_count(100, 1000)),
        (4, 50, 1)
    );
    // Past 65 535 blocks, z takes the rest.
    assert_eq!(
        dims(ElementwiseLayout::Rows(1).cube_count(200_000, 8)),
        (1, 65_535, 4)
    );
}

#[test]
fn rows_cols_reads_a_matrix_shape() {
    assert_eq!(rows_cols(&Shape::new([3, 5]), "op"), (3, 5));
}

#[test]
#[should_panic(expected = "gelu takes [tokens, features]")]
fn rows_cols_refuses_other_ranks() {
    rows_cols(&Shape::new([2, 3, 5]), "gelu");
}

#[test]
fn column_sum_blocks_cover_the_rows() {
    let layout = ColumnSumLayout::default();
    // At least `min_rows_per_block` rows a block, one block for few rows.
    assert_eq!(layout.blocks(0), (1, 64));
    assert_eq!(layout.blocks(10), (1, 64));
    assert_eq!(layout.blocks(64), (1, 64));
    assert_eq!(layout.blocks(65), (2, 64));
    // At most `max_blocks` blocks: the blocks grow instead.
    assert_eq!(layout.blocks(16_384), (256, 64));
    assert_eq!(layout.blocks(16_385), (253, 65));
    for rows in [1, 63, 1000, 16_384, 100_000, 1 << 22] {
        let (blocks, per_block) = layout.blocks(rows);
        assert!(blocks <= layout.max_blocks);
        assert!(blocks * per_block >= rows);
        assert!((blocks - 1) * per_block < rows.max(1));
    }
}

#[test]
fn column_walks_use_the_default_layout() {
    let walk = ColumnWalk::new(1000);
    let layout = ColumnSumLayout::default();
    assert_eq!(walk.layout, layout);
    assert_eq!((walk.blocks, walk.rows_per_block), layout.blocks(1000));
    // One thread a column vector, `column_vectors` a cube; y over the blocks.
    assert_eq!(
        dims(walk.cube_count(130)),
        (
            130_u32.div_ceil(layout.column_vectors),
            walk.blocks as u32,
            1
        )
    );
    let dim = walk.cube_dim();
    assert_eq!((dim.x, dim.y, dim.z), (layout.column_vectors, 1, 1));
}
