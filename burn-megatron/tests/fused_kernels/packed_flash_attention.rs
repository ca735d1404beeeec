//! Flash attention on a packed QKV, through views of the buffer.

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{DType, Tensor, TensorData};
use burn_megatron::ops::PackedFlashAttentionOps;
use burn_megatron_testing::{assert_close, tolerance, values};

use crate::helpers::{W, poisoned, random, random_4d, raw, raw4};

/// Flash attention on a packed `[batch, seq, groups, heads_per_group + 2, head_dim]` QKV on
/// wgpu: q, k and v read as views of the buffer (where q has one head stride and WebGPU's
/// binding-offset alignment allows the offsets), else split by Burn. Against Burn's split and
/// the flash-attention composition on the same device: the output (`[batch, seq, heads,
/// head_dim]`), `lse` and `dqkv`, through `ModelBackend`, under `Autodiff<W>` (one node), and
/// through the kernels into NaN-poisoned buffers (output, one `dqkv`), so an element nobody
/// writes fails. MHA and MQA with 256-byte rows (views), GQA (no single head stride), and MHA
/// with 32- and 20-byte rows (views only where the device allows such binding offsets:
/// lavapipe's alignment is 32 bytes, so 20-byte rows take Burn's split), causal and not.
#[test]
fn packed_flash_attention_through_views_equals_the_composition() {
    use burn::backend::Autodiff;
    use burn_megatron::ops::flash_attention::{backward_composition, forward_composition};
    use burn_megatron::ops::packed_flash_attention::{assemble, attention, split};
    use burn_megatron_kernels::fused::flash_attention::{self as flash, packed};
    let device = WgpuDevice::default();
    let offsets = packed::ViewOffsets::MemoryAlignment;
    let mut viewed = 0;
    for (batch, seq, groups, per_group, head_dim, causal) in [
        (2, 37, 3, 1, 64, true),
        (1, 20, 1, 3, 64, false),
        (1, 9, 2, 2, 64, true),
        (1, 9, 2, 1, 8, false),
        (1, 9, 2, 1, 5, true),
    ] {
        let shape = [batch, seq, groups, per_group + 2, head_dim];
        let out_shape = [batch, seq, groups * per_group, head_dim];
        let scale = 1.0 / (head_dim as f64).sqrt();
        let label = |what: &str| format!("{shape:?} causal {causal}: {what}");
        let qkv = Tensor::<W, 5>::from_data(
            TensorData::new(random(shape.iter().product(), 11, 2.0), shape),
            &device,
        );
        let grad = random_4d(out_shape, 12, 1.0, DType::F32, &device);

        let [q, k, v] = split(qkv.clone());
        let (want_out, want_lse) =
            forward_composition(q.clone(), k.clone(), v.clone(), scale, causal);
        let [dq, dk, dv] = backward_composition(
            q,
            k,
            v,
            want_out.clone(),
            want_lse.clone(),
            grad.clone().swap_dims(1, 2),
            scale,
            causal,
        );
        let want_dqkv = values(assemble(dq, dk, dv));
        let (want_out, want_lse) = (values(want_out.swap_dims(1, 2)), values(want_lse));

        let alignment = raw(qkv.clone()).client.properties().memory.alignment as usize;
        let row = head_dim * 4;
        let views = (per_group == 1 || groups == 1)
            && (per_group * row).is_multiple_of(alignment)
            && ((per_group + 1) * row).is_multiple_of(alignment);
        assert_eq!(
            packed::views(&raw(qkv.clone()), offsets).is_some(),
            views,
            "{}",
            label(&format!("views (memory alignment {alignment})"))
        );
        viewed += usize::from(views);
        println!(
            "{}",
            label(&format!("views {views} (memory alignment {alignment})"))
        );

        let (out, lse) = W::packed_flash_attention(qkv.clone(), scale, causal);
        assert_eq!(out.dims(), out_shape);
        assert_close(
            &label("output"),
            &values(out.clone()),
            &want_out,
            tolerance::F32,
        );
        assert_close(
            &label("lse"),
            &values(lse.clone()),
            &want_lse,
            tolerance::F32,
        );
        let dqkv =
            W::packed_flash_attention_backward(qkv.clone(), out, lse, grad.clone(), scale, causal);
        assert_eq!(dqkv.dims(), shape);
        assert_close(&label("dqkv"), &values(dqkv), &want_dqkv, tolerance::F32);

        let tracked = Tensor::<Autodiff<W>, 5>::from_inner(qkv.clone()).require_grad();
        let y = attention(tracked.clone(), scale, causal);
        let grads = (y * Tensor::from_inner(grad.clone())).sum().backward();
        assert_close(
            &label("dqkv under autodiff"),
            &values(tracked.grad(&grads).expect("qkv has a gradient")),
            &want_dqkv,
            tolerance::F32,
        );

        if views {
            let options = flash::AttentionOptions {
                scale: scale as f32,
                causal,
            };
            let [q, k, v] = packed::views(&raw(qkv.clone()), offsets).expect("views");
            let out = poisoned(out_shape, DType::F32, &device);
            let heads_major = |t: &Tensor<W, 4>| raw4(t.clone().swap_dims(1, 2));
            let lse =
                flash::forward_into(q.clone(), k.clone(), v.clone(), heads_major(&out), options);
            assert_close(
                &label("output into a poisoned buffer"),
                &values(out.clone()),
                &want_out,
                tolerance::F32,
            );
            let dqkv = Tensor::<W, 5>::full(shape, f32::NAN, &device);
            let grads = packed::views(&raw(dqkv.clone()), offsets).expect("views of dqkv");
            flash::backward_into(
                q,
                k,
                v,
                heads_major(&out),
                lse,
                heads_major(&grad),
                grads,
                options,
            );
            assert_close(
                &label("dqkv into a poisoned buffer"),
                &values(dqkv),
                &want_dqkv,
                tolerance::F32,
            );
        }
    }
    assert!(viewed >= 2, "only {viewed} cases ran through views");
}
