//! One rank's parallel groups: Megatron's `parallel_state`, as a value instead of globals.

use crate::error::DistResult;
use crate::layout::{GroupKind, ParallelLayout, ParallelSizes, RankCoords};
use crate::process_group::ProcessGroup;

/// The groups this rank belongs to in a [`ParallelLayout`], and the questions schedules and
/// models ask about its place in them.
#[derive(Debug, Clone)]
pub struct ParallelState {
    layout: ParallelLayout,
    coords: RankCoords,
    world: ProcessGroup,
    tp: ProcessGroup,
    pp: ProcessGroup,
    dp: ProcessGroup,
    cp: ProcessGroup,
    dp_cp: ProcessGroup,
    tp_cp: ProcessGroup,
    model_parallel: ProcessGroup,
    ep: ProcessGroup,
    expert_dp: ProcessGroup,
    embedding: Option<ProcessGroup>,
    virtual_pipeline_size: usize,
}

impl ParallelState {
    /// Builds this rank's groups for `sizes` over the ranks of `world`.
    pub fn new(world: &ProcessGroup, sizes: ParallelSizes) -> DistResult<Self> {
        let layout = ParallelLayout::new(world.size(), sizes)?;
        let rank = world.rank();
        let group = |kind: GroupKind| -> DistResult<Option<ProcessGroup>> {
            let Some(local) = layout.group_of(kind, rank) else {
                return Ok(None);
            };
            let global: Vec<usize> = local.iter().map(|&r| world.ranks()[r]).collect();
            world.new_group(kind.name(), &global).map(Some)
        };
        let member = |kind| -> DistResult<ProcessGroup> {
            Ok(group(kind)?.expect("every rank is in a group of this kind"))
        };
        Ok(Self {
            layout,
            coords: layout.coords(rank),
            world: world.clone(),
            tp: member(GroupKind::Tp)?,
            pp: member(GroupKind::Pp)?,
            dp: member(GroupKind::Dp)?,
            cp: member(GroupKind::Cp)?,
            dp_cp: member(GroupKind::DpCp)?,
            tp_cp: member(GroupKind::TpCp)?,
            model_parallel: member(GroupKind::ModelParallel)?,
            ep: member(GroupKind::Ep)?,
            expert_dp: member(GroupKind::ExpertDp)?,
            embedding: group(GroupKind::Embedding)?,
            virtual_pipeline_size: 1,
        })
    }

    /// The same state with `v` virtual pipeline stages (model chunks) per rank, for the
    /// interleaved schedule: Megatron's `virtual_pipeline_model_parallel_size`. Chunk `c` of
    /// pipeline rank `r` is virtual stage `c · pp + r` of `v · pp`.
    pub fn with_virtual_pipeline_size(mut self, v: usize) -> DistResult<Self> {
        if v == 0 {
            return Err(crate::error::DistError::InvalidArgument(
                "the virtual pipeline size must be at least 1".into(),
            ));
        }
        self.virtual_pipeline_size = v;
        Ok(self)
    }

    /// The layout.
    pub fn layout(&self) -> &ParallelLayout {
        &self.layout
    }

    /// This rank's coordinates in the layout.
    pub fn coords(&self) -> RankCoords {
        self.coords
    }

    /// The group of all ranks.
    pub fn world(&self) -> &ProcessGroup {
        &self.world
    }

    /// This rank's group of `kind`; `None` only for the embedding group of a middle stage.
    pub fn group(&self, kind: GroupKind) -> Option<&ProcessGroup> {
        Some(match kind {
            GroupKind::Tp => &self.tp,
            GroupKind::Pp => &self.pp,
            GroupKind::Dp => &self.dp,
            GroupKind::Cp => &self.cp,
            GroupKind::DpCp => &self.dp_cp,
            GroupKind::TpCp => &self.tp_cp,
            GroupKind::ModelParallel => &self.model_parallel,
            GroupKind::Ep => &self.ep,
            GroupKind::ExpertDp => &self.expert_dp,
            GroupKind::Embedding => return self.embedding.as_ref(),
        })
    }

    /// The first error that has ended a collective of any of this rank's groups
    /// ([`ProcessGroup::failure`]), without waiting.
    pub fn failure(&self) -> DistResult<()> {
        let groups = [
            &self.world,
            &self.tp,
            &self.pp,
            &self.dp,
            &self.cp,
            &self.dp_cp,
            &self.tp_cp,
            &self.model_parallel,
            &self.ep,
            &self.expert_dp,
        ];
        for group in groups.into_iter().chain(self.embedding.as_ref()) {
            group.failure()?;
        }
        Ok(())
    }

    /// Tensor-parallel group.
    pub fn tp(&self) -> &ProcessGroup {
        &self.tp
    }
    /// Pipeline-parallel group (one rank per stage, in stage order).
    pub fn pp(&self) -> &ProcessGroup {
        &self.pp
    }
    /// Data-parallel group.
    pub fn dp(&self) -> &ProcessGroup {
        &self.dp
    }
    /// Context-parallel group.
    pub fn cp(&self) -> &ProcessGroup {
        &self.cp
    }
    /// Data- and context-parallel group: where dense gradients are reduced.
    pub fn dp_cp(&self) -> &ProcessGroup {
        &self.dp_cp
    }
    /// Expert-parallel group.
    pub fn ep(&self) -> &ProcessGroup {
        &self.ep
    }
    /// Expert-data-parallel group: where expert gradients are reduced.
    pub fn expert_dp(&self) -> &ProcessGroup {
        &self.expert_dp
    }
    /// Tensor- and pipeline-parallel group: the ranks holding one model replica.
    pub fn model_parallel(&self) -> &ProcessGroup {
        &self.model_parallel
    }
    /// The first and last stage of this rank's pipeline, if this rank is one of them.
    pub fn embedding(&self) -> Option<&ProcessGroup> {
        self.embedding.as_ref()
    }

    /// This rank's pipeline stage.
    pub fn pp_rank(&self) -> usize {
        self.coords.pp
    }
    /// Whether this rank runs the first pipeline stage.
    pub fn is_first_pipeline_stage(&self) -> bool {
        self.coords.pp == 0
    }
    /// Whether this rank runs the last pipeline stage.
    pub fn is_last_pipeline_stage(&self) -> bool {
        self.coords.pp + 1 == self.layout.sizes().pp
    }
    /// Model chunks (virtual stages) per pipeline rank; 1 without interleaving.
    pub fn virtual_pipeline_size(&self) -> usize {
        self.virtual_pipeline_size
    }
    /// Virtual stages in the whole pipeline: `pp · v`.
    pub fn num_virtual_stages(&self) -> usize {
        self.layout.sizes().pp * self.virtual_pipeline_size
    }
    /// The virtual stage of this rank's model chunk `chunk`: `chunk · pp + pp_rank`.
    pub fn virtual_stage(&self, chunk: usize) -> usize {
        chunk * self.layout.sizes().pp + self.coords.pp
    }
    /// Whether this rank's chunk `chunk` is the pipeline's first virtual stage (it holds the
    /// embedding): Megatron's `is_pipeline_first_stage()` with the virtual rank set.
    pub fn is_first_virtual_stage(&self, chunk: usize) -> bool {
        self.virtual_stage(chunk) == 0
    }
    /// Whether this rank's chunk `chunk` is the pipeline's last virtual stage (it holds the
    /// output layer and the loss).
    pub fn is_last_virtual_stage(&self, chunk: usize) -> bool {
        self.virtual_stage(chunk) + 1 == self.num_virtual_stages()
    }
    /// The stage after this one (a rank of the PP group), if this is not the last stage.
    pub fn next_pipeline_rank(&self) -> Option<usize> {
        (!self.is_last_pipeline_stage()).then_some(self.coords.pp + 1)
    }
    /// The stage before this one (a rank of the PP group), if this is not the first stage.
    pub fn prev_pipeline_rank(&self) -> Option<usize> {
        self.coords.pp.checked_sub(1)
    }
}
