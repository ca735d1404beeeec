//! Learning rates at chosen steps against Megatron's formulas: warm-up start and end, the
//! middle and end of the decay, and past the end, for every decay style.

use std::f64::consts::PI;

use burn::backend::NdArray;
use burn::optim::lr_scheduler::LrScheduler;
use burn_megatron::optimizer::{LrDecayStyle, LrScheduleConfig, WsdDecayStyle};

use crate::{assert_close, tolerance};

const MAX: f64 = 1e-3;
const MIN: f64 = 1e-4;

/// Warm-up over steps 0..=10, decay to step 110.
fn config(style: LrDecayStyle) -> LrScheduleConfig {
    LrScheduleConfig::new(MAX)
        .with_min_lr(MIN)
        .with_warmup_steps(10)
        .with_decay_steps(110)
        .with_decay_style(style)
}

/// `min + coefficient · (max - min)`.
fn between(coefficient: f64) -> f64 {
    MIN + coefficient * (MAX - MIN)
}

fn check(style: LrDecayStyle, expected: &[(usize, f64)]) {
    let schedule = config(style).init().expect("a valid schedule");
    for &(step, want) in expected {
        assert_close(
            &format!("{style:?} at step {step}"),
            &[schedule.lr(step)],
            &[want],
            tolerance::F64,
        );
    }
}

/// Steps every style shares: the warm-up from 0, linear in the step.
fn warmup() -> Vec<(usize, f64)> {
    vec![(0, 0.0), (1, MAX / 10.0), (5, MAX / 2.0), (10, MAX)]
}

#[test]
fn cosine_decay() {
    let mut steps = warmup();
    steps.extend([
        (35, between(0.5 * ((PI * 0.25).cos() + 1.0))),
        (60, between(0.5)),
        (110, MIN),
        (111, MIN),
        (10_000, MIN),
    ]);
    check(LrDecayStyle::Cosine, &steps);
}

#[test]
fn linear_decay() {
    let mut steps = warmup();
    steps.extend([
        (11, between(0.99)),
        (35, between(0.75)),
        (60, between(0.5)),
        (110, MIN),
        (500, MIN),
    ]);
    check(LrDecayStyle::Linear, &steps);
}

#[test]
fn constant_after_warmup() {
    let mut steps = warmup();
    steps.extend([(11, MAX), (110, MAX), (10_000, MAX)]);
    check(LrDecayStyle::Constant, &steps);
}

/// WSD with a 20-step anneal: the peak holds to step 90, then each anneal style; at its end
/// (step 110) every style reaches `min_lr`, and stays there.
#[test]
fn warmup_stable_decay() {
    let styles = [
        (WsdDecayStyle::Linear, 0.5),
        (WsdDecayStyle::Cosine, 0.5),
        (WsdDecayStyle::Exponential, 2.0 * 0.5f64.sqrt() - 1.0),
        (WsdDecayStyle::MinusSqrt, 1.0 - 0.5f64.sqrt()),
    ];
    for (style, halfway) in styles {
        let quarter = match style {
            WsdDecayStyle::Linear => 0.75,
            WsdDecayStyle::Cosine => 0.5 * ((PI * 0.25).cos() + 1.0),
            WsdDecayStyle::Exponential => 2.0 * 0.5f64.powf(0.25) - 1.0,
            WsdDecayStyle::MinusSqrt => 0.5,
        };
        let mut steps = warmup();
        steps.extend([
            (11, MAX),
            (60, MAX),
            (90, MAX),
            (95, between(quarter)),
            (100, between(halfway)),
            (110, MIN),
            (111, MIN),
        ]);
        check(
            LrDecayStyle::Wsd {
                decay_steps: 20,
                style,
            },
            &steps,
        );
    }
}

/// A warm-up that starts above zero, and no warm-up at all (step 0 is then the peak).
#[test]
fn warmup_init_and_no_warmup() {
    let schedule = config(LrDecayStyle::Linear)
        .with_warmup_init_lr(2e-4)
        .init()
        .unwrap();
    assert_close("init", &[schedule.lr(0)], &[2e-4], tolerance::F64);
    assert_close("half", &[schedule.lr(5)], &[6e-4], tolerance::F64);
    let schedule = LrScheduleConfig::new(MAX)
        .with_min_lr(MIN)
        .with_decay_steps(100)
        .with_decay_style(LrDecayStyle::Linear)
        .init()
        .unwrap();
    assert_close("step 0", &[schedule.lr(0)], &[MAX], tolerance::F64);
    assert_close(
        "step 50",
        &[schedule.lr(50)],
        &[between(0.5)],
        tolerance::F64,
    );
}

/// As Burn's `LrScheduler`: one call per global step, step 0 first; its record resumes it.
#[test]
fn burn_scheduler_steps_once_per_global_step() {
    let mut schedule = config(LrDecayStyle::Cosine).init().unwrap();
    let reference = schedule.clone();
    let first: Vec<f64> = (0..30).map(|_| LrScheduler::step(&mut schedule)).collect();
    let want: Vec<f64> = (0..30).map(|s| reference.lr(s)).collect();
    assert_close("steps 0..30", &first, &want, tolerance::F64);
    let record = LrScheduler::to_record::<NdArray>(&schedule);
    assert_eq!(record, 30);
    let mut resumed = config(LrDecayStyle::Cosine)
        .init()
        .unwrap()
        .load_record::<NdArray>(record);
    assert_close(
        "resumed",
        &[LrScheduler::step(&mut resumed)],
        &[reference.lr(30)],
        tolerance::F64,
    );
}

#[test]
fn inconsistent_schedules_are_errors() {
    let message = |c: LrScheduleConfig| c.init().unwrap_err().to_string();
    let short = config(LrDecayStyle::Cosine).with_decay_steps(5);
    assert!(
        message(short)
            .contains("decay_steps (5) counts from step 0 and must exceed warmup_steps (10)")
    );
    // Megatron's default of no decay steps is no schedule: an error, not a NaN at step 0.
    assert!(message(LrScheduleConfig::new(MAX)).contains("decay_steps (0)"));
    let long_anneal = config(LrDecayStyle::Wsd {
        decay_steps: 200,
        style: WsdDecayStyle::Linear,
    });
    assert!(message(long_anneal).contains("must be in 1..=110"));
    let inverted = config(LrDecayStyle::Linear).with_min_lr(1.0);
    assert!(message(inverted).contains("min_lr (1) must not exceed max_lr"));
}
