//! `burn_megatron_dist::mapping::ring_exchange`: forward, each rank gets the previous rank's
//! tensor; backward, each rank's gradient goes to the previous rank's input.

use burn::tensor::{Tensor, TensorData};
use burn_megatron_dist::mapping::ring_exchange;

use crate::{AD, B, run, values};

#[test]
fn the_exchange_passes_forward_and_its_gradient_passes_back() {
    for cp in [1, 2, 4] {
        let results = run(cp, |ctx| {
            let rank = ctx.rank();
            let x = Tensor::<AD, 1>::from_inner(Tensor::<B, 1>::from_data(
                TensorData::new(vec![rank as f32, 10.0 + rank as f32], [2]),
                &Default::default(),
            ))
            .require_grad();
            let y = ring_exchange(x.clone(), ctx.world())?;
            // The gradient of rank r's output is (r + 1) everywhere.
            let grads = (y.clone() * (rank as f32 + 1.0)).sum().backward();
            Ok((values(y), values(x.grad(&grads).expect("x's gradient"))))
        });
        for (rank, (y, grad)) in results.into_iter().enumerate() {
            let previous = ((rank + cp - 1) % cp) as f64;
            assert_eq!(
                y,
                [previous, 10.0 + previous],
                "CP {cp} rank {rank} receives"
            );
            // x went to the next rank, whose output's gradient is (next + 1).
            let next = ((rank + 1) % cp) as f64;
            assert_eq!(grad, [next + 1.0; 2], "CP {cp} rank {rank} gradient");
        }
    }
}
