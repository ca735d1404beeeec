//! Q, K and V as zero-copy views of one packed projection output.
//!
//! Megatron's fused QKV projection gives `[batch, seq, groups, heads_per_group + 2, head_dim]`:
//! per query group, its query heads, then its key head, then its value head. The attention
//! wants `q: [batch, heads, seq, head_dim]` and `k, v: [batch, groups, seq, head_dim]`. Each of
//! them is the packed buffer read with other strides from another first element, so a view
//! (the packed handle, a byte offset, four strides) replaces a copy, and the gradients can be
//! written the same way into one `[batch, seq, groups, heads_per_group + 2, head_dim]` buffer.
//!
//! - `k` and `v` always have such a view: group `g` of `k` is slot `heads_per_group` of group
//!   `g`, so the head stride is the group stride.
//! - `q` has one only when one stride walks its heads: one head per group (multi-head
//!   attention: the head stride is the group stride) or one group (multi-query attention: the
//!   head stride is the slot stride). With several groups of several heads, head `h` sits at
//!   group `h / heads_per_group`, slot `h % heads_per_group`: two strides, no 4D view, and
//!   [`views`] returns `None`.
//!
//! Who may read the views: the flash-attention kernels of this module read and write every
//! operand element by element through its strides (no vector loads), and cuDNN checks every
//! pointer and stride for 16-byte alignment before it takes one. Burn's kernels must not get
//! them: they pick a vector width from the shape and strides alone
//! (`cubecl::tensor_vector_size_parallel`), never from the handle's offset. That is still
//! safe when the last dimension is contiguous and the offset is a whole number of
//! `head_dim` rows (the width divides `head_dim`), but not for arbitrary strides, so the views
//! stay inside the attention operations.
//!
//! Where a view may start depends on the runtime ([`ViewOffsets`]): CUDA kernels get a device
//! pointer, so any element will do; WebGPU binds a buffer at an offset, which must be a
//! multiple of the device's `min_storage_buffer_offset_alignment` (the runtime's memory
//! alignment), which is why Burn's `slice` makes views only at such offsets.

use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;

/// Where a view into a buffer may start, on a runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ViewOffsets {
    /// At any element: kernels get the address of the first element (CUDA).
    AnyElement,
    /// At multiples of the runtime's memory alignment: a view is a buffer binding at an
    /// offset, and WebGPU rejects unaligned ones.
    MemoryAlignment,
}

impl ViewOffsets {
    fn allows<R: CubeRuntime>(self, tensor: &CubeTensor<R>, bytes: u64) -> bool {
        match self {
            Self::AnyElement => true,
            Self::MemoryAlignment => {
                let alignment = tensor.client.properties().memory.alignment;
                let start = tensor.handle.offset_start.unwrap_or(0) + bytes;
                start.is_multiple_of(alignment)
            }
        }
    }
}

/// `[q, k, v]` (`[batch, heads, seq, head_dim]`, `[batch, groups, seq, head_dim]` twice) as
/// views of `packed` (`[batch, seq, groups, heads_per_group + 2, head_dim]`, any strides), or
/// `None` when `q` has no single head stride (several groups of several heads) or a view would
/// start where `offsets` forbids. The views share `packed`'s memory: write through them only
/// into a buffer nobody else reads.
pub fn views<R: CubeRuntime>(
    packed: &CubeTensor<R>,
    offsets: ViewOffsets,
) -> Option<[CubeTensor<R>; 3]> {
    let shape = &packed.meta.shape()[..];
    let strides = &packed.meta.strides()[..];
    let &[batch, seq, groups, slots, head_dim] = shape else {
        panic!(
            "packed attention takes [batch, seq, groups, heads_per_group + 2, head_dim] \
             (got {shape:?})"
        );
    };
    assert!(
        slots >= 3,
        "packed attention: each group needs at least one query head besides its key and value \
         heads (got {slots} slots)"
    );
    let heads_per_group = slots - 2;
    let head_stride = if heads_per_group == 1 {
        strides[2]
    } else if groups == 1 {
        strides[3]
    } else {
        return None;
    };
    let element = packed.dtype.size() as u64;
    let view = |slot: usize, heads: usize, head_stride: usize| -> Option<CubeTensor<R>> {
        let bytes = (slot * strides[3]) as u64 * element;
        if !offsets.allows(packed, bytes) {
            return None;
        }
        let mut view = packed.clone();
        if bytes > 0 {
            view.handle = packed.handle.clone().offset_start(bytes);
        }
        *view.meta.shape_mut() = [batch, heads, seq, head_dim].into();
        *view.meta.strides_mut() = [strides[0], head_stride, strides[1], strides[4]].into();
        Some(view)
    };
    Some([
        view(0, groups * heads_per_group, head_stride)?,
        view(heads_per_group, groups, strides[2])?,
        view(heads_per_group + 1, groups, strides[2])?,
    ])
}
