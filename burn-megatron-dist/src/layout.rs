//! Megatron's rank layout: which global ranks form each parallel group.
//!
//! Ranks are numbered with tensor parallelism fastest, then context, then data, then
//! pipeline parallelism (Megatron-Core's default order `tp-cp-dp-pp`):
//!
//! `rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))`
//!
//! so a TP group is a block of neighbouring ranks (one node, fast links) and a pipeline group
//! strides across the whole world. Expert parallelism re-splits the `cp × dp` ranks of a
//! pipeline stage in the order `tp-ep-edp-pp`: `ep` ranks hold different experts, and
//! `edp = cp × dp / ep` replicas of each expert reduce their gradients together.

use std::fmt;

/// Sizes of the parallel dimensions; data parallelism takes what is left of the world.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelSizes {
    /// Tensor parallelism.
    pub tp: usize,
    /// Pipeline parallelism.
    pub pp: usize,
    /// Context parallelism.
    pub cp: usize,
    /// Expert parallelism.
    pub ep: usize,
}

impl Default for ParallelSizes {
    fn default() -> Self {
        Self {
            tp: 1,
            pp: 1,
            cp: 1,
            ep: 1,
        }
    }
}

impl ParallelSizes {
    /// Sets the tensor-parallel size.
    pub fn with_tp(mut self, tp: usize) -> Self {
        self.tp = tp;
        self
    }
    /// Sets the pipeline-parallel size.
    pub fn with_pp(mut self, pp: usize) -> Self {
        self.pp = pp;
        self
    }
    /// Sets the context-parallel size.
    pub fn with_cp(mut self, cp: usize) -> Self {
        self.cp = cp;
        self
    }
    /// Sets the expert-parallel size.
    pub fn with_ep(mut self, ep: usize) -> Self {
        self.ep = ep;
        self
    }
}

/// Why a layout is invalid, with the sizes that would be valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A size is zero.
    #[error("{name} size must be at least 1, got 0")]
    Zero {
        /// Which size.
        name: &'static str,
    },
    /// A size does not divide what is left of the world.
    #[error(
        "{name} size {size} does not divide {what} ({available}): valid {name} sizes are {}",
        list(valid)
    )]
    NotDividing {
        /// Which size.
        name: &'static str,
        /// Its value.
        size: usize,
        /// What it must divide, in words.
        what: String,
        /// The number it must divide.
        available: usize,
        /// Sizes that would divide it.
        valid: Vec<usize>,
    },
}

fn list(values: &[usize]) -> String {
    values
        .iter()
        .map(|v| v.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|&d| n.is_multiple_of(d)).collect()
}

/// A rank's coordinates in the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankCoords {
    /// Index in the TP group.
    pub tp: usize,
    /// Index in the CP group.
    pub cp: usize,
    /// Index in the DP group.
    pub dp: usize,
    /// Pipeline stage.
    pub pp: usize,
    /// Index in the EP group.
    pub ep: usize,
    /// Index in the expert-DP group.
    pub expert_dp: usize,
}

/// The parallel groups of a world: pure rank arithmetic, no communication.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelLayout {
    world_size: usize,
    sizes: ParallelSizes,
    dp: usize,
}

/// The kinds of group a layout defines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupKind {
    /// Tensor parallel.
    Tp,
    /// Pipeline parallel: one rank per stage.
    Pp,
    /// Data parallel (without context parallelism).
    Dp,
    /// Context parallel.
    Cp,
    /// Data and context parallel together: where dense gradients are reduced.
    DpCp,
    /// Tensor and context parallel together.
    TpCp,
    /// Tensor and pipeline parallel: one whole model replica.
    ModelParallel,
    /// Expert parallel.
    Ep,
    /// Expert data parallel: where expert gradients are reduced.
    ExpertDp,
    /// First and last pipeline stage of a pipeline group: where tied embeddings are reduced.
    Embedding,
}

impl GroupKind {
    /// The name groups of this kind carry in errors.
    pub fn name(self) -> &'static str {
        match self {
            GroupKind::Tp => "tp",
            GroupKind::Pp => "pp",
            GroupKind::Dp => "dp",
            GroupKind::Cp => "cp",
            GroupKind::DpCp => "dp_cp",
            GroupKind::TpCp => "tp_cp",
            GroupKind::ModelParallel => "mp",
            GroupKind::Ep => "ep",
            GroupKind::ExpertDp => "expert_dp",
            GroupKind::Embedding => "embedding",
        }
    }
}

impl fmt::Display for GroupKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl ParallelLayout {
    /// Validates `sizes` against `world_size`.
    pub fn new(world_size: usize, sizes: ParallelSizes) -> Result<Self, LayoutError> {
        for (name, size) in [
            ("world", world_size),
            ("tensor-parallel", sizes.tp),
            ("pipeline-parallel", sizes.pp),
            ("context-parallel", sizes.cp),
            ("expert-parallel", sizes.ep),
        ] {
            if size == 0 {
                return Err(LayoutError::Zero { name });
            }
        }
        let mut left = world_size;
        for (name, size, what) in [
            ("tensor-parallel", sizes.tp, "the world size".to_string()),
            (
                "pipeline-parallel",
                sizes.pp,
                format!("world size / TP = {world_size} / {}", sizes.tp),
            ),
            (
                "context-parallel",
                sizes.cp,
                format!(
                    "world size / (TP × PP) = {world_size} / {}",
                    sizes.tp * sizes.pp
                ),
            ),
        ] {
            if !left.is_multiple_of(size) {
                return Err(LayoutError::NotDividing {
                    name,
                    size,
                    what,
                    available: left,
                    valid: divisors(left),
                });
            }
            left /= size;
        }
        let dp = left;
        if !(dp * sizes.cp).is_multiple_of(sizes.ep) {
            return Err(LayoutError::NotDividing {
                name: "expert-parallel",
                size: sizes.ep,
                what: format!("DP × CP = {dp} × {}", sizes.cp),
                available: dp * sizes.cp,
                valid: divisors(dp * sizes.cp),
            });
        }
        Ok(Self {
            world_size,
            sizes,
            dp,
        })
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The sizes the layout was built from.
    pub fn sizes(&self) -> ParallelSizes {
        self.sizes
    }

    /// The data-parallel size: `world / (tp × pp × cp)`.
    pub fn dp(&self) -> usize {
        self.dp
    }

    /// The expert-data-parallel size: `dp × cp / ep`.
    pub fn expert_dp(&self) -> usize {
        self.dp * self.sizes.cp / self.sizes.ep
    }

    /// The size of groups of `kind`.
    pub fn group_size(&self, kind: GroupKind) -> usize {
        let s = self.sizes;
        match kind {
            GroupKind::Tp => s.tp,
            GroupKind::Pp => s.pp,
            GroupKind::Dp => self.dp,
            GroupKind::Cp => s.cp,
            GroupKind::DpCp => self.dp * s.cp,
            GroupKind::TpCp => s.tp * s.cp,
            GroupKind::ModelParallel => s.tp * s.pp,
            GroupKind::Ep => s.ep,
            GroupKind::ExpertDp => self.expert_dp(),
            GroupKind::Embedding => s.pp.min(2),
        }
    }

    /// Every group of `kind`, each as global ranks in group-rank order.
    pub fn groups(&self, kind: GroupKind) -> Vec<Vec<usize>> {
        let s = self.sizes;
        let dense = [s.tp, s.cp, self.dp, s.pp];
        let expert = [s.tp, s.ep, self.expert_dp(), s.pp];
        match kind {
            GroupKind::Tp => masked_groups(&dense, [true, false, false, false]),
            GroupKind::Cp => masked_groups(&dense, [false, true, false, false]),
            GroupKind::Dp => masked_groups(&dense, [false, false, true, false]),
            GroupKind::Pp => masked_groups(&dense, [false, false, false, true]),
            GroupKind::DpCp => masked_groups(&dense, [false, true, true, false]),
            GroupKind::TpCp => masked_groups(&dense, [true, true, false, false]),
            GroupKind::ModelParallel => masked_groups(&dense, [true, false, false, true]),
            GroupKind::Ep => masked_groups(&expert, [false, true, false, false]),
            GroupKind::ExpertDp => masked_groups(&expert, [false, false, true, false]),
            GroupKind::Embedding => self
                .groups(GroupKind::Pp)
                .into_iter()
                .map(|g| match g.len() {
                    1 => g,
                    _ => vec![g[0], g[g.len() - 1]],
                })
                .collect(),
        }
    }

    /// The group of `kind` that `rank` belongs to, or `None` (only embedding groups leave out
    /// ranks: the middle pipeline stages).
    pub fn group_of(&self, kind: GroupKind, rank: usize) -> Option<Vec<usize>> {
        self.groups(kind).into_iter().find(|g| g.contains(&rank))
    }

    /// The coordinates of `rank`.
    pub fn coords(&self, rank: usize) -> RankCoords {
        let s = self.sizes;
        let tp = rank % s.tp;
        let cp = rank / s.tp % s.cp;
        let dp = rank / (s.tp * s.cp) % self.dp;
        let pp = rank / (s.tp * s.cp * self.dp);
        let ep = rank / s.tp % s.ep;
        let expert_dp = rank / (s.tp * s.ep) % self.expert_dp();
        RankCoords {
            tp,
            cp,
            dp,
            pp,
            ep,
            expert_dp,
        }
    }
}

/// Groups of an orthogonal grid: ranks that differ only in the masked dimensions.
///
/// `sizes` lists the dimensions fastest first. Groups are ordered by the unmasked coordinates
/// and members by the masked ones, the first dimension fastest in both, as Megatron does.
fn masked_groups<const N: usize>(sizes: &[usize; N], mask: [bool; N]) -> Vec<Vec<usize>> {
    let strides: Vec<usize> = (0..N).map(|i| sizes[..i].iter().product()).collect();
    let pick = |inside: bool| -> Vec<usize> { (0..N).filter(|&i| mask[i] == inside).collect() };
    let (inner, outer) = (pick(true), pick(false));
    let offsets = |dims: &[usize]| -> Vec<usize> {
        let count: usize = dims.iter().map(|&d| sizes[d]).product();
        (0..count)
            .map(|mut index| {
                dims.iter()
                    .map(|&d| {
                        let coord = index % sizes[d];
                        index /= sizes[d];
                        coord * strides[d]
                    })
                    .sum()
            })
            .collect()
    };
    let members = offsets(&inner);
    offsets(&outer)
        .into_iter()
        .map(|base| members.iter().map(|m| base + m).collect())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(world: usize, tp: usize, pp: usize, cp: usize, ep: usize) -> ParallelLayout {
        ParallelLayout::new(world, ParallelSizes { tp, pp, cp, ep }).unwrap()
    }

    #[test]
    fn megatron_world8_tp4_pp2() {
        let l = layout(8, 4, 2, 1, 1);
        assert_eq!(l.dp(), 1);
        assert_eq!(
            l.groups(GroupKind::Tp),
            vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]
        );
        assert_eq!(
            l.groups(GroupKind::Pp),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        assert_eq!(
            l.groups(GroupKind::Dp),
            (0..8).map(|r| vec![r]).collect::<Vec<_>>()
        );
        assert_eq!(
            l.groups(GroupKind::ModelParallel),
            vec![(0..8).collect::<Vec<_>>()]
        );
        assert_eq!(l.groups(GroupKind::Embedding), l.groups(GroupKind::Pp));
    }

    /// Megatron's docstring example: 16 GPUs, TP=2, PP=4, DP=2.
    #[test]
    fn megatron_world16_tp2_pp4() {
        let l = layout(16, 2, 4, 1, 1);
        assert_eq!(
            l.groups(GroupKind::Tp),
            vec![
                [0, 1],
                [2, 3],
                [4, 5],
                [6, 7],
                [8, 9],
                [10, 11],
                [12, 13],
                [14, 15]
            ]
        );
        assert_eq!(
            l.groups(GroupKind::Dp),
            vec![
                [0, 2],
                [1, 3],
                [4, 6],
                [5, 7],
                [8, 10],
                [9, 11],
                [12, 14],
                [13, 15]
            ]
        );
        assert_eq!(
            l.groups(GroupKind::Pp),
            vec![[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
        );
        assert_eq!(l.groups(GroupKind::Embedding)[0], vec![0, 12]);
        assert_eq!(l.group_of(GroupKind::Embedding, 4), None);
    }

    #[test]
    fn context_and_expert_groups() {
        // 16 ranks: tp 2, cp 2, dp 4, pp 1; ep 4 re-splits cp × dp = 8 into ep 4 × edp 2.
        let l = layout(16, 2, 1, 2, 4);
        assert_eq!(l.groups(GroupKind::Cp)[0], vec![0, 2]);
        assert_eq!(l.groups(GroupKind::Dp)[0], vec![0, 4, 8, 12]);
        assert_eq!(
            l.groups(GroupKind::DpCp)[0],
            vec![0, 2, 4, 6, 8, 10, 12, 14]
        );
        assert_eq!(l.groups(GroupKind::TpCp)[0], vec![0, 1, 2, 3]);
        assert_eq!(l.groups(GroupKind::Ep)[0], vec![0, 2, 4, 6]);
        assert_eq!(l.groups(GroupKind::ExpertDp)[0], vec![0, 8]);
        let c = l.coords(13);
        assert_eq!(
            (c.tp, c.cp, c.dp, c.pp, c.ep, c.expert_dp),
            (1, 0, 3, 0, 2, 1)
        );
        for kind in [
            GroupKind::Tp,
            GroupKind::Cp,
            GroupKind::Dp,
            GroupKind::Ep,
            GroupKind::ExpertDp,
        ] {
            let groups = l.groups(kind);
            let mut all: Vec<usize> = groups.iter().flatten().copied().collect();
            all.sort_unstable();
            assert_eq!(
                all,
                (0..16).collect::<Vec<_>>(),
                "{kind} groups partition the world"
            );
            assert!(groups.iter().all(|g| g.len() == l.group_size(kind)));
        }
    }

    #[test]
    fn invalid_layouts_say_what_is_valid() {
        let err = |world, sizes| ParallelLayout::new(world, sizes).unwrap_err().to_string();
        let s = ParallelSizes::default();
        assert_eq!(
            err(8, s.with_tp(3)),
            "tensor-parallel size 3 does not divide the world size (8): valid tensor-parallel \
             sizes are 1, 2, 4, 8"
        );
        assert_eq!(
            err(8, s.with_tp(2).with_pp(3)),
            "pipeline-parallel size 3 does not divide world size / TP = 8 / 2 (4): valid \
             pipeline-parallel sizes are 1, 2, 4"
        );
        assert!(err(8, s.with_tp(2).with_cp(8)).starts_with("context-parallel size 8"));
        assert_eq!(
            err(8, s.with_tp(2).with_ep(3)),
            "expert-parallel size 3 does not divide DP × CP = 4 × 1 (4): valid expert-parallel \
             sizes are 1, 2, 4"
        );
        assert_eq!(
            err(8, s.with_pp(0)),
            "pipeline-parallel size must be at least 1, got 0"
        );
        assert_eq!(err(0, s), "world size must be at least 1, got 0");
    }
}
