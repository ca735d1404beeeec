//! AdamW's step scalars: f32 values of the f64 settings, with the logarithms and the decay
//! factor computed in f64 first.

use burn_megatron_kernels::adamw_scalars::AdamWScalars;

#[test]
fn scalars_are_the_settings_in_f32() {
    let s = AdamWScalars::new(3e-4, 0.9, 0.95, 1e-8, 0.1, 4096);
    assert_eq!(s.lr, 3e-4_f32);
    assert_eq!(s.beta_1, 0.9_f32);
    assert_eq!(s.beta_2, 0.95_f32);
    assert_eq!(s.epsilon, 1e-8_f32);
    assert_eq!(s.block, 4096);
}

#[test]
fn logarithms_are_computed_in_f64() {
    let s = AdamWScalars::new(1e-3, 0.9, 0.999, 1e-8, 0.0, 1);
    assert_eq!(s.ln_beta_1, 0.9_f64.ln() as f32);
    assert_eq!(s.ln_beta_2, 0.999_f64.ln() as f32);
    // The f32 logarithm of the f32 β₂ is a different number: the f64 path matters.
    assert_ne!(s.ln_beta_2, 0.999_f32.ln());
    assert!((s.ln_beta_2 - -0.001_000_500_3).abs() < 1e-10);
    // exp(ln β) gives β back.
    assert!((f64::from(s.ln_beta_1).exp() - 0.9).abs() < 1e-7);
}

#[test]
fn the_decay_factor_is_one_minus_lr_times_weight_decay() {
    let s = AdamWScalars::new(3e-4, 0.9, 0.95, 1e-8, 0.1, 1);
    assert_eq!(s.decay_factor, (1.0 - 3e-4 * 0.1_f64) as f32);
    assert!((s.decay_factor - 0.99997).abs() < 1e-7);
    assert_eq!(
        AdamWScalars::new(1.0, 0.9, 0.95, 1e-8, 0.0, 1).decay_factor,
        1.0
    );
    assert_eq!(
        AdamWScalars::new(0.5, 0.9, 0.95, 1e-8, 2.0, 1).decay_factor,
        0.0
    );
}
