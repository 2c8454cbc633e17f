//! The baseline of the GPU tests' rule, checked where it runs (on the CPU): the backward by
//! hand in bf16 and f16 rounds (its error against f64 is not zero) but stays at the dtype's
//! scale, and on the large scores of `gpu.rs` it stays finite, so that the rule still
//! bounds the GPU's error there.

use flash_core::Shape;
use flash_core::inputs::{random_normal, random_qkv};
use flash_core::reference::error;
use step03_cuda_forward::gpu::Dtype;
use step03_cuda_forward::host::round_array;
use step04_backward::cuda::backward_by_hand_low_precision;
use step04_backward::reference::backward_f64;

#[path = "common/cases.rs"]
mod cases;

#[test]
fn low_precision_backward_by_hand_is_close_to_the_f64_reference() {
    let shape = Shape::new(2, 3, 77, 64);
    let [q, k, v] = random_qkv(shape, 9);
    let dout = random_normal(shape, 10);
    for (dtype, bound) in [(Dtype::Bf16, 0.1), (Dtype::F16, 0.015)] {
        let [qr, kr, vr, dr] = [&q, &k, &v, &dout].map(|x| round_array(x.view(), dtype));
        let want = backward_f64(qr.view(), kr.view(), vr.view(), dr.view()).unwrap();
        let got = backward_by_hand_low_precision(
            q.view(),
            k.view(),
            v.view(),
            dout.view(),
            dtype,
        );
        for (name, g, w) in [
            ("dq", &got.dq, &want.dq),
            ("dk", &got.dk, &want.dk),
            ("dv", &got.dv, &want.dv),
        ] {
            let e = error(g, w);
            println!("{} {name}: {e}", dtype.name());
            assert!(
                e.max_abs > 0.0 && e.max_abs < bound,
                "{} {name}: {e}",
                dtype.name()
            );
        }
    }
}

#[test]
fn low_precision_backward_by_hand_is_finite_on_large_scores() {
    for head_dim in [64, 128] {
        let shape = Shape::new(1, 2, 300, head_dim);
        let [q, k, v] = random_qkv(shape, 7);
        let dout = random_normal(shape, 8);
        for (case, [q, k, v]) in cases::large_score_cases(&q, &k, &v) {
            for dtype in [Dtype::F16, Dtype::Bf16] {
                let [qr, kr, vr, dr] =
                    [&q, &k, &v, &dout].map(|x| round_array(x.view(), dtype));
                let want =
                    backward_f64(qr.view(), kr.view(), vr.view(), dr.view()).unwrap();
                let got = backward_by_hand_low_precision(
                    q.view(),
                    k.view(),
                    v.view(),
                    dout.view(),
                    dtype,
                );
                for (name, g, w) in [
                    ("dq", &got.dq, &want.dq),
                    ("dk", &got.dk, &want.dk),
                    ("dv", &got.dv, &want.dv),
                ] {
                    let e = error(g, w);
                    let size = w.iter().fold(1.0f64, |m, x| m.max(x.abs()));
                    println!(
                        "{case}, {shape} {} {name}: {e}, largest {size:.1}",
                        dtype.name()
                    );
                    assert!(
                        e.max_abs.is_finite() && e.max_abs > 0.0,
                        "{case}, {shape} {} {name}: {e}",
                        dtype.name()
                    );
                }
            }
        }
    }
}
