use burn_megatron_dist::{GroupKind, ParallelLayout, ParallelSizes};

use crate::run;

#[test]
fn each_rank_gets_its_layout_groups() {
    let sizes = ParallelSizes::default()
        .with_tp(2)
        .with_pp(2)
        .with_cp(1)
        .with_ep(2);
    let layout = ParallelLayout::new(8, sizes).unwrap();
    let results = run(8, |ctx| {
        let state = ctx.parallel_state(sizes)?;
        let kinds = [
            GroupKind::Tp,
            GroupKind::Pp,
            GroupKind::Dp,
            GroupKind::Cp,
            GroupKind::DpCp,
            GroupKind::TpCp,
            GroupKind::ModelParallel,
            GroupKind::Ep,
            GroupKind::ExpertDp,
            GroupKind::Embedding,
        ];
        let groups: Vec<Option<Vec<usize>>> = kinds
            .iter()
            .map(|&k| state.group(k).map(|g| g.ranks().to_vec()))
            .collect();
        Ok((
            kinds,
            groups,
            state.is_first_pipeline_stage(),
            state.is_last_pipeline_stage(),
            state.prev_pipeline_rank(),
            state.next_pipeline_rank(),
            state.tp().rank(),
        ))
    });
    for (rank, (kinds, groups, first, last, prev, next, tp_rank)) in results.into_iter().enumerate()
    {
        for (kind, group) in kinds.iter().zip(groups) {
            assert_eq!(
                group,
                layout.group_of(*kind, rank),
                "{kind} group of rank {rank}"
            );
        }
        // Ranks 0-3 are stage 0, ranks 4-7 stage 1.
        assert_eq!((first, last), (rank < 4, rank >= 4));
        assert_eq!(
            (prev, next),
            if rank < 4 {
                (None, Some(1))
            } else {
                (Some(0), None)
            }
        );
        assert_eq!(tp_rank, rank % 2);
    }
}

#[test]
fn an_invalid_layout_is_an_error_on_every_rank() {
    let errors = run(4, |ctx| {
        Ok(ctx
            .parallel_state(ParallelSizes::default().with_tp(3))
            .unwrap_err()
            .to_string())
    });
    for e in errors {
        assert_eq!(
            e,
            "tensor-parallel size 3 does not divide the world size (4): valid tensor-parallel sizes are 1, 2, 4"
        );
    }
}

/// Context parallelism's groups at TP 2 × CP 2 × DP 2: each rank's CP, DP and DP × CP groups
/// are the layout's (rank = tp + 2 · (cp + 2 · dp)), and a sum over DP × CP (where dense
/// gradients are reduced) adds the 4 ranks of one TP index.
#[test]
fn context_parallel_and_dp_cp_groups() {
    let sizes = ParallelSizes::default().with_tp(2).with_cp(2);
    let layout = ParallelLayout::new(8, sizes).unwrap();
    assert_eq!(layout.dp(), 2);
    assert_eq!(layout.groups(GroupKind::Cp)[0], vec![0, 2]);
    assert_eq!(layout.groups(GroupKind::DpCp)[0], vec![0, 2, 4, 6]);
    let results = run(8, |ctx| {
        let state = ctx.parallel_state(sizes)?;
        let rank = ctx.rank() as f32;
        let summed = state.dp_cp().all_reduce(
            crate::tensor::<crate::B, 1>(vec![rank], [1]),
            burn_megatron_dist::ReduceOp::Sum,
        )?;
        Ok((
            state.cp().ranks().to_vec(),
            state.dp_cp().ranks().to_vec(),
            (state.coords().cp, state.cp().rank()),
            crate::values(summed)[0],
        ))
    });
    for (rank, (cp, dp_cp, (coord, cp_rank), sum)) in results.into_iter().enumerate() {
        assert_eq!(
            Some(cp),
            layout.group_of(GroupKind::Cp, rank),
            "rank {rank}"
        );
        assert_eq!(
            Some(dp_cp),
            layout.group_of(GroupKind::DpCp, rank),
            "rank {rank}"
        );
        assert_eq!(
            (coord, cp_rank),
            ((rank / 2) % 2, (rank / 2) % 2),
            "rank {rank}"
        );
        // The even ranks sum to 0 + 2 + 4 + 6, the odd ones to 1 + 3 + 5 + 7.
        assert_eq!(sum, if rank % 2 == 0 { 12.0 } else { 16.0 }, "rank {rank}");
    }
}

/// `connect` visits every group of more than one rank once, in one order on every rank
/// (collective checks would name a mismatch), and leaves each group ready for the next
/// collective: an all-reduce of the global ranks afterwards sums each group's members.
#[test]
fn connect_opens_every_group_and_leaves_them_in_step() {
    use burn_megatron_dist::ReduceOp;

    use crate::{B, tensor, values};

    let sizes = ParallelSizes::default().with_tp(2).with_pp(2).with_ep(2);
    let layout = ParallelLayout::new(8, sizes).unwrap();
    let kinds = [
        GroupKind::Tp,
        GroupKind::Pp,
        GroupKind::Dp,
        GroupKind::ModelParallel,
        GroupKind::Ep,
        GroupKind::ExpertDp,
        GroupKind::Embedding,
    ];
    let results = run(8, move |ctx| {
        let state = ctx.parallel_state(sizes)?;
        let device = Default::default();
        state.connect::<B>(&device, true)?;
        let mut sums = Vec::new();
        for kind in kinds {
            let Some(group) = state.group(kind) else {
                sums.push(None);
                continue;
            };
            let started = group.collectives_started();
            let x = tensor::<B, 1>(vec![group.global_rank() as f32], [1]);
            let sum = values(group.all_reduce(x, ReduceOp::Sum)?)[0];
            sums.push(Some((started, sum)));
        }
        Ok(sums)
    });
    for (rank, sums) in results.into_iter().enumerate() {
        for (kind, sum) in kinds.iter().zip(sums) {
            let members = layout.group_of(*kind, rank);
            let expected = members.map(|m| {
                // One all-reduce in `connect` on each group of more than one rank.
                let started = u64::from(m.len() > 1);
                (started, m.iter().sum::<usize>() as f32)
            });
            assert_eq!(sum, expected, "{kind} group of rank {rank}");
        }
    }
}
