//! The baseline of the GPU tests' rule, checked where it runs (on the CPU): the backward by hand
//! in bf16 and f16 rounds (its error against f64 is not zero) but stays at the dtype's scale.

use flash_core::Shape;
use flash_core::inputs::{random_normal, random_qkv};
use flash_core::reference::error;
use step03_cuda_forward::Dtype;
use step03_cuda_forward::host::round_array;
use step04_backward::cuda::backward_by_hand_low_precision;
use step04_backward::reference::backward_f64;

#[test]
fn low_precision_backward_by_hand_is_close_to_the_f64_reference() {
    let shape = Shape::new(2, 3, 77, 64);
    let [q, k, v] = random_qkv(shape, 9);
    let dout = random_normal(shape, 10);
    for (dtype, bound) in [(Dtype::Bf16, 0.1), (Dtype::F16, 0.015)] {
        let [qr, kr, vr, dr] = [&q, &k, &v, &dout].map(|x| round_array(x.view(), dtype));
        let want = backward_f64(qr.view(), kr.view(), vr.view(), dr.view()).unwrap();
        let got = backward_by_hand_low_precision(q.view(), k.view(), v.view(), dout.view(), dtype);
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
