//! The f64 reference backward against central finite differences of the f64 forward: the
//! check that the reference itself, and so every comparison made with it, is right.

use flash_core::Shape;
use flash_core::inputs::{random_normal, random_qkv};
use flash_core::reference::attention_f64;
use ndarray::Array4;
use proptest::prelude::*;
use step04_backward::reference::backward_f64;

/// The step of the central difference. Its error is `h²/6·f'''` from truncation (≈ 1e-11
/// here) plus `ε·Σ|dO ∘ O| / h` from rounding the loss (≈ 1e-13·n / h ≤ 1e-8 for n ≤ 400
/// values).
const H: f64 = 1e-5;
/// Allowed `|finite difference − reference|`, relative to `1 + |reference|`: two orders of
/// magnitude above both errors, and far below any mistake in a formula (which is of the
/// order of the gradient itself).
const TOL: f64 = 1e-6;

fn small_shapes() -> impl Strategy<Value = (Shape, u64)> {
    (1usize..3, 1usize..3, 1usize..13, 1usize..9, any::<u64>())
        .prop_map(|(b, h, t, d, seed)| (Shape::new(b, h, t, d), seed))
}

/// The loss whose gradient with respect to the output is `dout`: `L = Σ dO ∘ O`.
fn loss(qkv: &[Array4<f64>; 3], dout: &Array4<f64>) -> f64 {
    let [q, k, v] = qkv;
    let out = attention_f64(q.view(), k.view(), v.view()).unwrap().out;
    (&out * dout).sum()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    // ANCHOR: finite_differences
    #[test]
    fn the_reference_matches_central_differences((shape, seed) in small_shapes()) {
        let qkv = random_qkv(shape, seed).map(|x| x.mapv(f64::from));
        let dout = random_normal(shape, seed ^ 0xd0).mapv(f64::from);
        let [q, k, v] = &qkv;
        let grads = backward_f64(q.view(), k.view(), v.view(), dout.view()).unwrap();
        let named = [("dq", &grads.dq), ("dk", &grads.dk), ("dv", &grads.dv)];
        for (which, (name, grad)) in named.into_iter().enumerate()
        {
            for (index, &want) in grad.indexed_iter() {
                let mut moved = qkv.clone();
                moved[which][index] += H;
                let up = loss(&moved, &dout);
                moved[which][index] -= 2.0 * H;
                let down = loss(&moved, &dout);
                let fd = (up - down) / (2.0 * H);
                prop_assert!(
                    (fd - want).abs() <= TOL * (1.0 + want.abs()),
                    "{} on {}: {}{:?} is {} by the reference, {} by finite differences",
                    name, shape, name, index, want, fd
                );
            }
        }
    }
    // ANCHOR_END: finite_differences
}
