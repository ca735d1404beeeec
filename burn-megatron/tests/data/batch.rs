//! Micro-batches: inputs and shifted targets, vocabulary checks, the broadcast over TP.

use burn::backend::NdArray;
use burn::tensor::TensorData;
use burn_megatron::data::{GptBatch, broadcast_batch};
use burn_megatron::{Error, IdKind, InputError};
use burn_megatron_dist::ParallelSizes;

type B = NdArray<f32>;

fn batch() -> GptBatch {
    GptBatch::from_samples(&[vec![1, 2, 3, 4], vec![5, 6, 7, 8]]).unwrap()
}

#[test]
fn a_batch_gives_inputs_and_shifted_targets() {
    let batch = batch();
    assert_eq!((batch.micro_batch_size(), batch.sequence_length()), (2, 3));
    let (inputs, targets) = batch.inputs_and_targets();
    assert_eq!(inputs, [1, 2, 3, 5, 6, 7]);
    assert_eq!(targets, [2, 3, 4, 6, 7, 8]);
    let mb = batch.to_microbatch::<B>(9, &Default::default()).unwrap();
    assert_eq!(mb.tokens.dims(), [2, 3]);
    assert_eq!(
        mb.tokens.into_data().convert::<i64>(),
        TensorData::new(vec![1i64, 2, 3, 5, 6, 7], [2, 3])
    );
    assert_eq!(
        mb.targets.into_data().convert::<i64>(),
        TensorData::new(vec![2i64, 3, 4, 6, 7, 8], [2, 3])
    );
}

#[test]
fn ids_outside_the_vocabulary_are_errors() {
    let err = batch()
        .to_microbatch::<B>(8, &Default::default())
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Input(InputError::IdOutOfRange {
                kind: IdKind::Token,
                id: 8,
                vocab_size: 8
            })
        ),
        "{err}"
    );
    let negative = GptBatch::from_samples(&[vec![0, -1]]).unwrap();
    assert!(negative.check_vocab(10).is_err());
    assert!(GptBatch::from_samples(&[vec![1, 2], vec![3]]).is_err());
    assert!(GptBatch::from_samples(&[vec![1]]).is_err());
    assert!(GptBatch::from_samples(&[]).is_err());
}

#[test]
fn one_tensor_parallel_rank_reads_and_broadcasts() {
    let big = GptBatch::from_samples(&[vec![0, 16_777_217, (1 << 40) + 3, -100]]).unwrap();
    let got = burn_megatron_testing::run(4, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(2))?;
        let tp = state.tp();
        // Rank 0 of each TP group reads; the other passes nothing.
        let own = (tp.rank() == 0).then_some(&big);
        let received = broadcast_batch::<B>(tp, 0, own, 1, 3, &Default::default())?;
        Ok(received)
    });
    for received in got {
        assert_eq!(received, big);
    }
}

#[test]
fn a_bad_root_batch_fails_on_every_rank() {
    let errors = burn_megatron_testing::run(2, |ctx| {
        let group = ctx.world().clone();
        let wrong_shape = batch();
        let own = (group.rank() == 1).then_some(&wrong_shape);
        Ok(broadcast_batch::<B>(&group, 1, own, 1, 3, &Default::default()).is_err())
    });
    assert_eq!(errors, [true, true]);
}
