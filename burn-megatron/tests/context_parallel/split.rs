//! The load-balanced split: which chunks and positions a rank holds, the split of a tensor
//! and its restoration, and the error on a sequence that does not cut into `2 · cp` chunks.

use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::InputError;
use burn_megatron::context_parallel::LoadBalancedSplit;

use crate::B;

/// `[2, seq, 3]` with element `(b, s, h)` = `100 b + 10 s + h`: each token's values name it.
fn numbered(seq: usize) -> Tensor<B, 3> {
    let data: Vec<f32> = (0..2)
        .flat_map(|b| {
            (0..seq).flat_map(move |s| (0..3).map(move |h| (100 * b + 10 * s + h) as f32))
        })
        .collect();
    Tensor::from_data(TensorData::new(data, [2, seq, 3]), &Default::default())
}

#[test]
fn rank_i_holds_chunks_i_and_2cp_minus_1_minus_i() {
    let chunks: Vec<[usize; 2]> = (0..4)
        .map(|r| LoadBalancedSplit::new(4, r).chunks())
        .collect();
    assert_eq!(chunks, [[0, 7], [1, 6], [2, 5], [3, 4]]);
    assert_eq!(
        LoadBalancedSplit::new(2, 0).positions(8).unwrap(),
        [0, 1, 6, 7]
    );
    assert_eq!(
        LoadBalancedSplit::new(2, 1).positions(8).unwrap(),
        [2, 3, 4, 5]
    );
    assert_eq!(
        LoadBalancedSplit::new(1, 0).positions(4).unwrap(),
        [0, 1, 2, 3]
    );
}

/// Every rank's positions together cover the sequence once; the split of a tensor holds the
/// tokens its positions name (in that order); restoring the parts gives the tensor back.
#[test]
fn split_positions_and_restore_round_trip() {
    for cp in [1, 2, 4] {
        for seq in [2 * cp, 4 * cp, 12 * cp] {
            let x = numbered(seq);
            let mut seen = Vec::new();
            let mut parts = Vec::new();
            for rank in 0..cp {
                let split = LoadBalancedSplit::new(cp, rank);
                let positions = split.positions(seq).unwrap();
                assert_eq!(positions.len(), seq / cp);
                let ids = split.position_ids::<B>(seq, &Default::default()).unwrap();
                let want_ids: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
                assert_eq!(
                    ids.into_data().convert::<i64>().to_vec::<i64>().unwrap(),
                    want_ids
                );
                let part = split.split(x.clone(), 1).unwrap();
                let index = Tensor::<B, 1, Int>::from_data(
                    TensorData::new(want_ids, [positions.len()]),
                    &Default::default(),
                );
                let gathered = x.clone().select(1, index);
                assert_eq!(
                    part.to_data().to_vec::<f32>().unwrap(),
                    gathered.into_data().to_vec::<f32>().unwrap(),
                    "CP {cp} rank {rank} seq {seq}: the split holds its positions' tokens"
                );
                seen.extend(positions);
                parts.push(part);
            }
            seen.sort_unstable();
            assert_eq!(seen, (0..seq).collect::<Vec<_>>(), "CP {cp} seq {seq}");
            let restored = LoadBalancedSplit::restore(parts, 1).unwrap();
            assert_eq!(
                restored.into_data().to_vec::<f32>().unwrap(),
                x.into_data().to_vec::<f32>().unwrap(),
                "CP {cp} seq {seq}: restore inverts split"
            );
        }
    }
}

#[test]
fn a_sequence_that_does_not_cut_into_2cp_chunks_is_refused() {
    let split = LoadBalancedSplit::new(4, 1);
    let err = split.positions(12).unwrap_err();
    assert_eq!(
        err,
        InputError::SequenceNotDivisibleByChunks { len: 12, chunks: 8 }
    );
    assert!(err.to_string().contains("use a multiple of 8"), "{err}");
    assert!(split.split(numbered(4), 1).is_err());
    assert!(split.chunk_len(0).is_err());
}
