//! `--moe-router-dtype`: on an f32 model, a router computing in f64 gives, bit for bit, the
//! weights, choices and losses of a router that is f64 throughout (its weights cast to f32 at
//! the end), and its weight's and the tokens' gradients are those of that router cast to f32.
//! The plain f32 router's weights differ, so a router that ignored the option would fail.

use burn::tensor::{DType, Tensor, TensorData};
use burn_megatron::transformer::moe::{
    LoadBalancingType, Router, RouterDtype, RouterScoreFunction, RouterSettings,
};

use crate::AD;

/// `n` values in `[-1, 1)` from a fixed sequence.
fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 37 + seed * 11) % 101) as f32 / 50.5) - 1.0)
        .collect()
}

fn bits(t: Tensor<AD, 2>) -> Vec<f32> {
    t.cast(DType::F32).into_data().to_vec::<f32>().expect("f32")
}

#[test]
fn router_in_fp64_equals_an_f64_router() {
    let device = Default::default();
    let settings = RouterSettings {
        score_function: RouterScoreFunction::Sigmoid,
        top_k: 2,
        load_balancing: LoadBalancingType::AuxLoss,
        aux_loss_coeff: 0.1,
        z_loss_coeff: 0.01,
        ..Default::default()
    };
    let (tokens, weight) = (values(6 * 4, 1), values(4 * 5, 2));
    let tensor = |v: &[f32], shape: [usize; 2], dtype: DType| {
        Tensor::<AD, 2>::from_data(TensorData::new(v.to_vec(), shape), &device)
            .cast(dtype)
            .detach()
            .require_grad()
    };
    let run = |dtype: DType, router_dtype: Option<RouterDtype>| {
        let x = tensor(&tokens, [6, 4], dtype);
        let settings = RouterSettings {
            dtype: router_dtype,
            ..settings.clone()
        };
        let router = Router::<AD>::new(tensor(&weight, [4, 5], dtype), settings);
        let r = router.route(x.clone());
        let loss = r.weights.clone().sum().cast(DType::F64)
            + r.load_balancing_loss.clone().cast(DType::F64)
            + r.z_loss.clone().cast(DType::F64);
        let grads = loss.backward();
        let weight_grad = router
            .weight
            .val()
            .grad(&grads)
            .expect("the weight's gradient");
        let token_grad = x.grad(&grads).expect("the tokens' gradient");
        let cast = |t: Tensor<_, 2>| t.cast(DType::F32).into_data().to_vec::<f32>().expect("f32");
        let experts = r.read_experts().expect("experts");
        (
            r.weights.dtype(),
            bits(r.weights),
            experts,
            [r.load_balancing_loss, r.z_loss]
                .map(|l| l.cast(DType::F64).into_data().to_vec::<f64>().expect("f64")),
            cast(weight_grad),
            cast(token_grad),
        )
    };
    let in_fp64 = run(DType::F32, Some(RouterDtype::Fp64));
    let reference = run(DType::F64, None);
    let plain = run(DType::F32, None);
    assert_eq!(
        in_fp64.0,
        DType::F32,
        "the weights return in the model's dtype"
    );
    assert_eq!(in_fp64.1, reference.1, "weights");
    assert_eq!(in_fp64.2, reference.2, "experts");
    assert_eq!(in_fp64.3, reference.3, "losses");
    assert_eq!(in_fp64.4, reference.4, "the router weight's gradient");
    assert_eq!(in_fp64.5, reference.5, "the tokens' gradient");
    assert_ne!(in_fp64.1, plain.1, "the f32 router's weights differ");
    assert!(in_fp64.1.iter().all(|v| v.is_finite()));
}

#[test]
fn router_dtype_names() {
    assert_eq!(RouterDtype::parse("fp32").unwrap(), RouterDtype::Fp32);
    assert_eq!(RouterDtype::parse("FP64").unwrap(), RouterDtype::Fp64);
    let error = RouterDtype::parse("bf16").unwrap_err().to_string();
    assert!(error.contains("--moe-router-dtype \"bf16\""), "{error}");
}
