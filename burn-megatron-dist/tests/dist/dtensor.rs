use burn_megatron_dist::{DistTensor, Placement, ReduceOp};

use crate::{B, iota, run, values};

fn full() -> burn::tensor::Tensor<B, 2> {
    // 7 rows: sharding over 4 ranks leaves an uneven last shard (2, 2, 2, 1).
    iota([7, 6], 1.0, 0.0)
}

#[test]
fn every_redistribution_keeps_the_global_tensor() {
    let placements = [
        Placement::Replicate,
        Placement::Shard(0),
        Placement::Shard(1),
        Placement::Partial,
    ];
    for n in [1, 2, 3] {
        let results = run(n, |ctx| {
            let g = ctx.world();
            let mut seen = vec![];
            for from in placements {
                for to in placements {
                    let t = DistTensor::distribute(full(), g, from)?;
                    let moved = t.redistribute(to)?;
                    assert_eq!(moved.placement(), to);
                    assert_eq!(moved.global_shape(), [7, 6]);
                    seen.push((from, to, values(moved.full_tensor()?)));
                }
            }
            Ok(seen)
        });
        let expect = values(full());
        for rank in results {
            for (from, to, got) in rank {
                assert_eq!(got, expect, "{from} -> {to} over {n} ranks");
            }
        }
    }
}

#[test]
fn local_slices_and_shapes() {
    let results = run(4, |ctx| {
        let t = DistTensor::distribute(full(), ctx.world(), Placement::Shard(0))?;
        Ok((
            t.local_range().unwrap(),
            t.local().dims(),
            values(t.into_local()),
        ))
    });
    let ranges: Vec<_> = results.iter().map(|r| r.0.clone()).collect();
    assert_eq!(ranges, vec![0..2, 2..4, 4..6, 6..7]);
    assert_eq!(results[3].1, [1, 6]);
    assert_eq!(results[3].2, (36..42).map(|i| i as f32).collect::<Vec<_>>());
}

#[test]
fn partial_to_shard_is_a_reduce_scatter_of_the_pending_sum() {
    let results = run(2, |ctx| {
        // Each rank holds a term; the global tensor is their sum.
        let term = iota::<B, 2>([4, 2], 1.0, ctx.rank() as f32);
        let t = DistTensor::from_local(term.clone(), ctx.world(), Placement::Partial, [4, 2])?;
        let sharded = t.redistribute(Placement::Shard(0))?;
        let direct = ctx.world().reduce_scatter(term, 0, ReduceOp::Sum)?;
        Ok((values(sharded.into_local()), values(direct)))
    });
    assert_eq!(results[0].0, vec![1.0, 3.0, 5.0, 7.0]);
    for (a, b) in results {
        assert_eq!(a, b);
    }
}

#[test]
fn combining_mismatched_tensors_is_an_error() {
    let errors = run(2, |ctx| {
        let g = ctx.world();
        let sub = ctx.new_group("solo", &[ctx.rank()])?;
        let sharded = DistTensor::distribute(full(), g, Placement::Shard(1))?;
        let replicated = DistTensor::distribute(full(), g, Placement::Replicate)?;
        let elsewhere = DistTensor::distribute(full(), &sub, Placement::Shard(1))?;
        let added = sharded.clone().try_add(sharded.clone())?;
        Ok([
            sharded.clone().try_add(replicated).unwrap_err().to_string(),
            sharded.try_add(elsewhere).unwrap_err().to_string(),
            DistTensor::from_local(
                iota::<B, 2>([7, 6], 1.0, 0.0),
                g,
                Placement::Shard(1),
                [7, 6],
            )
            .unwrap_err()
            .to_string(),
            format!("{:?}", values(added.full_tensor()?)[..3].to_vec()),
        ])
    });
    let [placement, group, shape, sum] = &errors[0];
    assert_eq!(
        placement,
        "placement mismatch: cannot add a sharded along dim 1 tensor and a replicated tensor on group 'world': redistribute one first"
    );
    assert!(
        group.contains("different groups: 'world' [0, 1] and 'solo' [0]"),
        "{group}"
    );
    assert!(
        shape.contains("has local shape [7, 3] here, got [7, 6]"),
        "{shape}"
    );
    assert_eq!(sum, "[0.0, 2.0, 4.0]");
}
