//! The scaling recipes: tensorwise scales from the current amax, delayed scaling's amax
//! history (`max` and `most_recent`, roll-over), and non-finite amaxes skipped.

use burn::tensor::Tensor;
use burn_megatron::ops::fp8::{
    AmaxComputeAlgo, DelayedScaling, Fp8Config, Fp8Dtype, Fp8Format, Fp8Recipe, scale_from_amax,
    tensorwise_scale,
};
use burn_megatron_testing::values_f32;

use crate::B;

fn amax(value: f32) -> Tensor<B, 1> {
    Tensor::from_floats([value], &Default::default())
}

fn tensorwise(value: f32, dtype: Fp8Dtype, margin: i32) -> f32 {
    values_f32(tensorwise_scale(amax(value), dtype, margin))[0]
}

#[test]
fn tensorwise_scale_maps_the_amax_onto_the_format_max() {
    for dtype in [Fp8Dtype::E4M3, Fp8Dtype::E5M2] {
        let max = dtype.max();
        for a in [1.0f32, 0.37, 448.0, 3.0e4, 1e-20] {
            assert_eq!(
                tensorwise(a, dtype, 0),
                max / a,
                "{} amax {a}",
                dtype.name()
            );
            assert_eq!(tensorwise(a, dtype, 2), max / a / 4.0, "margin 2");
            assert_eq!(tensorwise(a, dtype, -1), max / a * 2.0, "margin -1");
        }
        // Zero, NaN and infinite amaxes give the scale 1; a scale beyond f32 is capped.
        for a in [0.0, f32::NAN, f32::INFINITY] {
            assert_eq!(tensorwise(a, dtype, 0), 1.0, "{} amax {a}", dtype.name());
        }
        assert_eq!(tensorwise(1e-44, dtype, 0), f32::MAX);
    }
}

#[test]
fn a_non_finite_or_zero_amax_keeps_the_fallback() {
    let fallback = Tensor::<B, 1>::from_floats([0.25], &Default::default());
    for a in [0.0, f32::NAN, f32::INFINITY] {
        let scale = scale_from_amax(amax(a), fallback.clone(), Fp8Dtype::E4M3, 0);
        assert_eq!(values_f32(scale), [0.25], "amax {a}");
    }
}

/// The history over more amaxes than it holds: newest first, the oldest rolling out, the
/// scale from the largest (`max`) or newest (`most_recent`) entry.
#[test]
fn delayed_history_rolls_over() {
    let device = Default::default();
    let dtype = Fp8Dtype::E4M3;
    let amaxes = [1.0f32, 5.0, 2.0, 3.0, 0.5, 0.25];
    let histories: [&[f32]; 6] = [
        &[1.0, 0.0, 0.0],
        &[5.0, 1.0, 0.0],
        &[2.0, 5.0, 1.0],
        &[3.0, 2.0, 5.0],
        &[0.5, 3.0, 2.0],
        &[0.25, 0.5, 3.0],
    ];
    let max_scales = [
        448.0 / 1.0,
        448.0 / 5.0,
        448.0 / 5.0,
        448.0 / 5.0,
        448.0 / 3.0,
        448.0 / 3.0,
    ];
    for algo in [AmaxComputeAlgo::Max, AmaxComputeAlgo::MostRecent] {
        let mut state = DelayedScaling::<B>::new(3, &device);
        assert_eq!(values_f32(state.scale()), [1.0], "the first cast's scale");
        assert_eq!(values_f32(state.history()), [0.0; 3]);
        for (i, &a) in amaxes.iter().enumerate() {
            state.record(amax(a), dtype, 0, algo);
            assert_eq!(
                values_f32(state.history()),
                histories[i],
                "{algo:?} step {i}"
            );
            let want = match algo {
                AmaxComputeAlgo::Max => max_scales[i],
                AmaxComputeAlgo::MostRecent => 448.0 / a,
            };
            assert_eq!(values_f32(state.scale()), [want], "{algo:?} step {i}");
        }
    }
}

#[test]
fn delayed_scaling_with_margin_and_a_history_of_one() {
    let mut state = DelayedScaling::<B>::new(1, &Default::default());
    for a in [2.0f32, 7.0, 0.125] {
        state.record(amax(a), Fp8Dtype::E5M2, 3, AmaxComputeAlgo::Max);
        assert_eq!(values_f32(state.history()), [a]);
        assert_eq!(values_f32(state.scale()), [57344.0 / a / 8.0]);
    }
}

/// A NaN or infinite amax (an overflowing step) is not recorded: history and scale stay. A
/// zero amax is recorded, but `most_recent` keeps the scale (there is nothing to scale).
#[test]
fn non_finite_amaxes_are_skipped() {
    for algo in [AmaxComputeAlgo::Max, AmaxComputeAlgo::MostRecent] {
        let mut state = DelayedScaling::<B>::new(4, &Default::default());
        state.record(amax(4.0), Fp8Dtype::E4M3, 0, algo);
        for bad in [f32::NAN, f32::INFINITY] {
            state.record(amax(bad), Fp8Dtype::E4M3, 0, algo);
            assert_eq!(
                values_f32(state.history()),
                [4.0, 0.0, 0.0, 0.0],
                "{algo:?} {bad}"
            );
            assert_eq!(values_f32(state.scale()), [112.0], "{algo:?} {bad}");
        }
        state.record(amax(0.0), Fp8Dtype::E4M3, 0, algo);
        assert_eq!(values_f32(state.history()), [0.0, 4.0, 0.0, 0.0]);
        assert_eq!(
            values_f32(state.scale()),
            [112.0],
            "{algo:?} after a zero amax"
        );
        state.record(amax(8.0), Fp8Dtype::E4M3, 0, algo);
        assert_eq!(values_f32(state.scale()), [56.0], "{algo:?} updates again");
    }
}

#[test]
fn megatron_names_and_settings() {
    assert_eq!(Fp8Format::parse("hybrid").unwrap(), Fp8Format::Hybrid);
    assert_eq!(Fp8Format::parse("E4M3").unwrap(), Fp8Format::E4M3);
    assert_eq!(Fp8Format::Hybrid.gradient_dtype(), Fp8Dtype::E5M2);
    assert_eq!(Fp8Format::E4M3.gradient_dtype(), Fp8Dtype::E4M3);
    assert_eq!(Fp8Format::Hybrid.forward_dtype(), Fp8Dtype::E4M3);
    assert_eq!(Fp8Recipe::parse("delayed").unwrap(), Fp8Recipe::Delayed);
    assert_eq!(
        AmaxComputeAlgo::parse("most_recent").unwrap(),
        AmaxComputeAlgo::MostRecent
    );
    for error in [
        Fp8Format::parse("e5m2").unwrap_err().to_string(),
        Fp8Recipe::parse("mxfp8").unwrap_err().to_string(),
        AmaxComputeAlgo::parse("mean").unwrap_err().to_string(),
        Fp8Config::new()
            .with_amax_history_len(0)
            .validate()
            .unwrap_err()
            .to_string(),
    ] {
        assert!(error.contains("--fp8-"), "{error}");
    }
    let config = Fp8Config::new();
    assert_eq!(
        (
            config.format,
            config.recipe,
            config.margin,
            config.amax_history_len
        ),
        (Fp8Format::Hybrid, Fp8Recipe::Tensorwise, 0, 1024)
    );
}
