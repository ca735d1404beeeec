//! Flat tensors within 32-bit indices: the limit, the check, and the cut of a flat buffer's
//! parameters into groups below it.
//!
//! CubeCL's kernels index a tensor's elements with 32-bit integers: past `u32::MAX` elements
//! an index wraps (a silently wrong AdamW update) or a launch or reshape panics. A rank's
//! parameters can pass the limit together: Llama-3 8B's 8.03 billion dense parameters at DP 4
//! with the distributed optimizer (every rank holds the whole parameter and gradient buffers),
//! 16 of its layers on one GPU, or the routed experts of a rank (at EP 2 the DeepSeek-like
//! preset puts 32 of its 64 experts of 3 × 2048 × 1408 on a rank in each of 16 layers: 4.43
//! billion elements). So the distributed optimizer cuts each kind's buffer into parts
//! (`split_at_limit`, used by [`flat_parts`](super::flat_parts)): groups of whole parameters
//! in the buffer's order, each with its own flat buffers, range and AdamW state, each at most
//! the limit. Only a parameter whose own buffer passes the limit is refused, naming it and the
//! option that makes it smaller; the memory planner leaves such layouts out with the same check
//! (`check_indexable`), and [`FlatAdamW`](super::FlatAdamW), whose one buffer is not cut,
//! refuses a buffer past the limit. Megatron cuts its buffers by dtype and by expert-ness, not
//! by size: PyTorch indexes with 64 bits.

use burn::module::ParamId;

use crate::distributed::BufferLayout;
use crate::error::ConfigError;

/// The most elements a flat buffer may hold: CubeCL's kernels index a tensor's elements with
/// 32-bit integers, and past `u32::MAX` an index wraps (a wrong update) or a launch panics.
pub const MAX_FLAT_NUMEL: usize = u32::MAX as usize;

/// Refuses a flat tensor of `numel` elements above [`MAX_FLAT_NUMEL`], naming it (`what`)
/// and the options that make it smaller (`fix`). The memory planner leaves out the layouts
/// it refuses.
pub(crate) fn check_indexable(numel: usize, what: &str, fix: &str) -> Result<(), ConfigError> {
    check_numel(numel, MAX_FLAT_NUMEL, what, fix)
}

/// [`check_indexable`] against `limit` (lowered in tests only).
fn check_numel(numel: usize, limit: usize, what: &str, fix: &str) -> Result<(), ConfigError> {
    if numel > limit {
        return Err(ConfigError::Invalid(format!(
            "{what} would hold {numel} elements, more than the {limit} a GPU kernel \
             indexes (32-bit indices): spread the parameters over more ranks ({fix})"
        )));
    }
    Ok(())
}

/// The parameters of `layout` (one flat buffer of them all) cut into groups of whole,
/// consecutive parameters in the buffer's order, as few as fit: each group's own buffer, laid
/// out with `layout`'s settings (each parameter aligned, the total padded to whole shards),
/// holds at most `limit` elements. One group holding every parameter when `layout` itself
/// fits, so that its buffer is `layout` unchanged. A parameter whose buffer alone would pass
/// `limit` is refused, naming it and the options that make it smaller (`fix`).
pub(crate) fn split_at_limit(
    layout: &BufferLayout,
    limit: usize,
    fix: &str,
) -> Result<Vec<Vec<ParamId>>, ConfigError> {
    let config = layout.config();
    let align = config.param_alignment;
    let shard_unit = config.dp_size * align;
    // Elements of a buffer whose parameters take `used` aligned elements.
    let padded = |used: usize| used.div_ceil(shard_unit) * shard_unit;
    let mut groups = Vec::new();
    let mut group = Vec::new();
    let mut used = 0;
    for slot in layout.params() {
        let aligned = slot.numel.div_ceil(align) * align;
        check_numel(
            padded(aligned),
            limit,
            &format!(
                "the flat buffer of the parameter `{}` alone ({} elements before padding)",
                slot.path, slot.numel
            ),
            fix,
        )?;
        if !group.is_empty() && padded(used + aligned) > limit {
            groups.push(std::mem::take(&mut group));
            used = 0;
        }
        group.push(slot.id);
        used += aligned;
    }
    if !group.is_empty() {
        groups.push(group);
    }
    Ok(groups)
}

#[cfg(test)]
mod tests {
    use burn::module::ParamId;

    use super::{MAX_FLAT_NUMEL, check_indexable, split_at_limit};
    use crate::distributed::{BufferConfig, BufferLayout};
    use crate::tensor_parallel::{ParamInfo, ParamPlacement};

    /// A flat buffer one element past what 32-bit indices reach is refused, naming the buffer
    /// and the options; one at the limit is taken.
    #[test]
    fn flat_buffers_past_32_bit_indices_are_refused() {
        check_indexable(MAX_FLAT_NUMEL, "a buffer", "--x").unwrap();
        let error = check_indexable(MAX_FLAT_NUMEL + 1, "the dense shard", "--dense-x")
            .unwrap_err()
            .to_string();
        for part in ["the dense shard", "4294967296 elements", "--dense-x"] {
            assert!(error.contains(part), "{error}");
        }
    }

    /// Parameters of `numels` elements, `p0` first in visiting order.
    fn infos(numels: &[usize]) -> Vec<ParamInfo> {
        numels
            .iter()
            .enumerate()
            .map(|(i, &n)| ParamInfo {
                id: ParamId::new(),
                path: format!("p{i}"),
                placement: ParamPlacement::replicated(),
                shape: vec![n],
            })
            .collect()
    }

    /// The groups as paths.
    fn paths(layout: &BufferLayout, groups: &[Vec<ParamId>]) -> Vec<Vec<String>> {
        groups
            .iter()
            .map(|g| {
                g.iter()
                    .map(|id| layout.slot(*id).unwrap().path.clone())
                    .collect()
            })
            .collect()
    }

    /// Whole parameters in buffer order (the reverse of visiting order), as few groups as fit
    /// once aligned and padded to whole shards; everything in one group when the buffer fits;
    /// a parameter that alone passes the limit is refused, naming it. The presets past the
    /// limit take two parts.
    #[test]
    fn parameters_are_cut_into_groups_below_the_limit() {
        // Aligned to 4 elements, the buffers padded to 2 shards (multiples of 8): in buffer
        // order p3 takes 4, p2 8, p1 4, p0 8.
        let config = BufferConfig::new().with_param_alignment(4).with_dp_size(2);
        let layout = BufferLayout::new(&infos(&[5, 3, 8, 1]), config).unwrap();
        assert_eq!(layout.numel(), 24);
        let cut = |limit| paths(&layout, &split_at_limit(&layout, limit, "--x").unwrap());
        assert_eq!(cut(24), [["p3", "p2", "p1", "p0"]]);
        assert_eq!(cut(MAX_FLAT_NUMEL), [["p3", "p2", "p1", "p0"]]);
        // 4 + 8 + 4 = 16, then 8.
        assert_eq!(cut(16), [vec!["p3", "p2", "p1"], vec!["p0"]]);
        // 4 + 8 = 12 is padded to 16: each alone (p3 and p1 padded to 8).
        assert_eq!(cut(12), [["p3"], ["p2"], ["p1"], ["p0"]]);
        assert_eq!(cut(8), [["p3"], ["p2"], ["p1"], ["p0"]]);
        let error = split_at_limit(&layout, 7, "--expert-x")
            .unwrap_err()
            .to_string();
        for part in ["`p3` alone", "would hold 8 elements", "the 7", "--expert-x"] {
            assert!(error.contains(part), "{error}");
        }
        // The 16-layer presets, three stacked matrices a layer: the DeepSeek-like one at EP 2
        // (32 of its 64 experts of 2048 × 1408) and the Mixtral-like one at EP 1 (8 experts of
        // 2048 × 5632), 4.43 billion elements each at expert-DP 2: two parts.
        for matrix in [32 * 2048 * 1408, 8 * 2048 * 5632] {
            let config = BufferConfig::new().with_dp_size(2);
            let layout = BufferLayout::new(&infos(&[matrix; 48]), config).unwrap();
            assert!(layout.numel() > MAX_FLAT_NUMEL);
            let groups = split_at_limit(&layout, MAX_FLAT_NUMEL, "--x").unwrap();
            assert_eq!(groups.len(), 2, "{matrix}");
            assert_eq!(groups.concat().len(), 48);
        }
        // Llama-3 8B's dense parameters (the tables, and per layer the norms, QKV, the
        // attention output, and SwiGLU's three matrices): 8.03 billion at DP 4, and 4.55
        // billion in 16 of its layers at DP 1, two parts each.
        let (h, f, vocab) = (4096, 14_336, 128_256);
        for (layers, dp) in [(32, 4), (16, 1)] {
            let layer = [h, h * (h + 2 * 1024), h * h, h, h * f, h * f, f * h];
            let mut numels = vec![vocab * h];
            numels.extend((0..layers).flat_map(|_| layer));
            numels.extend([h, vocab * h]);
            let config = BufferConfig::new().with_dp_size(dp);
            let layout = BufferLayout::new(&infos(&numels), config).unwrap();
            assert!(layout.numel() > MAX_FLAT_NUMEL, "{layers} layers");
            let groups = split_at_limit(&layout, MAX_FLAT_NUMEL, "--x").unwrap();
            assert_eq!(groups.len(), 2, "{layers} layers at DP {dp}");
            assert_eq!(groups.concat().len(), numels.len());
        }
        let big = BufferLayout::new(&infos(&[MAX_FLAT_NUMEL + 1, 1]), BufferConfig::new()).unwrap();
        let error = split_at_limit(&big, MAX_FLAT_NUMEL, "--expert-model-parallel-size")
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("`p0` alone (4294967296 elements")
                && error.contains("--expert-model-parallel-size"),
            "{error}"
        );
    }
}
