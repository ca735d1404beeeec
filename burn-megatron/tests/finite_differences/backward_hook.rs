//! The backward hook's identity node: the gradient through it against central differences,
//! and the hook run once, with its point, in the backward pass.

use std::sync::{Arc, Mutex};

use burn::tensor::{Tensor, TensorData};
use burn_autodiff::grads::Gradients;
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::ops::{BackwardHook, BackwardHookOps};
use burn_megatron_testing::{assert_close, tolerance, values};

use crate::{AD, B, STEP, device};

/// Records the points it is called with.
#[derive(Debug, Default)]
struct Record(Mutex<Vec<usize>>);

impl BackwardHook for Record {
    fn on_backward(&self, point: usize, _: &mut Gradients) {
        self.0.lock().unwrap().push(point);
    }
}

#[test]
fn the_gradient_through_a_backward_hook_matches_finite_differences() {
    let normal = |seed| {
        init_full::<B, 2>(
            [3, 4],
            InitDistribution::Normal { std: 1.0 },
            seed,
            &device(),
        )
    };
    let (x, w) = (normal(1), normal(2));
    let record = Arc::new(Record::default());
    let hook: Arc<dyn BackwardHook> = record.clone();
    let loss = |x: Tensor<AD, 2>| {
        let y = <AD as BackwardHookOps>::backward_hook(x, &hook, 7).tanh();
        (y * Tensor::from_inner(w.clone())).sum()
    };
    let tracked = Tensor::<AD, 2>::from_inner(x.clone()).require_grad();
    let grads = loss(tracked.clone()).backward();
    let got = values(tracked.grad(&grads).expect("x has a gradient"));
    assert_eq!(
        *record.0.lock().unwrap(),
        vec![7],
        "the hook runs once, with its point"
    );

    let base = values(x.clone());
    let fd: Vec<f64> = (0..base.len())
        .map(|i| {
            let shifted = |h: f64| {
                let mut v = base.clone();
                v[i] += h;
                let x = Tensor::<B, 2>::from_data(TensorData::new(v, [3, 4]), &device());
                values(loss(Tensor::from_inner(x)).inner())[0]
            };
            (shifted(STEP) - shifted(-STEP)) / (2.0 * STEP)
        })
        .collect();
    assert_close(
        "dx through the hook",
        &got,
        &fd,
        tolerance::FINITE_DIFFERENCE_F64,
    );
}
