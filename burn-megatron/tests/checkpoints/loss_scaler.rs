//! The dynamic loss scaler's state in the checkpoint's training state: resumed from it, the
//! scale follows the uninterrupted schedule exactly (growth and hysteresis counters included).

use burn::tensor::{Tensor, TensorData};
use burn_megatron::checkpointing::{Checkpoint, Checkpointer, TrainingState};
use burn_megatron::optimizer::{DynamicLossScaler, FoundInf, LossScalerConfig};

use crate::{B, build, run, scratch, tiny_gpt};

/// Overflow flags of 16 steps: the scale backs off (hysteresis 2) and grows (every 3 clean
/// steps) on both sides of the save.
const FLAGS: [f32; 16] = [
    0., 1., 0., 1., 1., 0., 0., 0., 0., 1., 0., 0., 0., 1., 1., 0.,
];
/// The step after which the state is saved: one clean step into a growth window, one
/// overflow of hysteresis used.
const SAVED_AFTER: usize = 11;

fn config() -> LossScalerConfig {
    LossScalerConfig::new()
        .with_initial_scale(65536.0)
        .with_growth_interval(3)
        .with_hysteresis(2)
}

/// Applies `flags` and returns the scale after each.
fn scales(scaler: &mut DynamicLossScaler<B>, flags: &[f32]) -> Vec<f32> {
    flags
        .iter()
        .map(|&f| {
            let flag =
                Tensor::<B, 1>::from_data(TensorData::new(vec![f], [1]), &Default::default());
            scaler.update(&FoundInf::new(flag));
            scaler.state().unwrap().scale
        })
        .collect()
}

#[test]
fn the_loss_scale_resumes_exactly_from_a_checkpoint() {
    let device = Default::default();
    let mut uninterrupted = config().init::<B>(&device).unwrap();
    let want = scales(&mut uninterrupted, &FLAGS);

    let mut first = config().init::<B>(&device).unwrap();
    let before = scales(&mut first, &FLAGS[..SAVED_AFTER]);
    assert_eq!(before, want[..SAVED_AFTER]);
    let saved = first.state().unwrap();
    assert_eq!(
        (
            saved.growth_tracker,
            saved.hysteresis_tracker,
            saved.skipped_steps
        ),
        (1.0, 1.0, 4.0),
        "every counter is mid-way at the save"
    );
    let root = scratch("loss-scaler");
    run(1, |ctx| {
        let (state, chunks) = build(&ctx, &tiny_gpt(), 1, 1)?;
        let training = TrainingState {
            iteration: SAVED_AFTER as u64,
            loss_scaler: Some(saved),
            ..Default::default()
        };
        Checkpointer::new(&root).save(&state, &tiny_gpt(), &chunks, None, &training)?;
        Ok(())
    });

    let checkpoint = Checkpoint::open_latest(&root).unwrap();
    let loaded = checkpoint.training_state().loss_scaler.unwrap();
    assert_eq!(loaded, saved, "the state survives metadata.json exactly");
    let mut resumed = config().init::<B>(&device).unwrap();
    resumed.load_state(&loaded).unwrap();
    let after = scales(&mut resumed, &FLAGS[SAVED_AFTER..]);
    assert_eq!(after, want[SAVED_AFTER..]);

    // A fresh scaler follows another schedule: the comparison is sharp.
    let mut fresh = config().init::<B>(&device).unwrap();
    assert_ne!(
        scales(&mut fresh, &FLAGS[SAVED_AFTER..]),
        want[SAVED_AFTER..]
    );

    // A corrupt scale is refused.
    let mut bad = loaded;
    bad.scale = f32::NAN;
    let err = resumed.load_state(&bad).unwrap_err().to_string();
    assert!(err.contains("loss scale") && err.contains("NaN"), "{err}");
    std::fs::remove_dir_all(root).unwrap();
}
