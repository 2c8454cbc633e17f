//! Backward passes on every case of the table against the f64 reference backward of step 04:
//! the backward each CPU method of the registry comes with, and step 04's blockwise backward
//! after each CPU method's forward (it takes the output and log-sum-exp of any forward).
//!
//! Every case of the table runs: the f64 reference backward goes through one `T × T` table per
//! head with matrix products, a fraction of a second at the table's longest length (1000).

use cross_step_tests::cases;
use flash_attention::methods::{self, Device};
use flash_core::inputs::{random_normal, random_qkv};
use flash_core::reference::error;
use ndarray::Array4;
use step04_backward::reference::{ReferenceGrads, backward_f64};
use step04_backward::{Grads, backward, backward_by_hand};

/// The largest max-abs error of an f32 gradient against the f64 reference, relative to the
/// largest value of that gradient (at least 1); why this size: steps/04-backward/tests/
/// against_reference.rs, where it is measured.
const GRAD_MAX_REL: f64 = 1e-5;
/// FlashAttention's rule on top: at most twice the error of the backward by hand in the same
/// precision, plus this margin (relative to the gradient's largest value, at least 1) for the
/// errors that are exactly 0 by hand: with one token, by hand's dv is exactly dout, while a
/// forward that rounds its dot products differently moves p by an ulp.
const MARGIN_REL: f64 = 1e-6;

/// The max-abs errors of dq, dk and dv.
fn errors(got: &Grads, want: &ReferenceGrads) -> [f64; 3] {
    [
        error(&got.dq, &want.dq).max_abs,
        error(&got.dk, &want.dk).max_abs,
        error(&got.dv, &want.dv).max_abs,
    ]
}

fn allowed(want: &ReferenceGrads) -> [f64; 3] {
    let top = |r: &Array4<f64>| GRAD_MAX_REL * r.iter().fold(1.0f64, |m, x| m.max(x.abs()));
    [top(&want.dq), top(&want.dk), top(&want.dv)]
}

#[test]
fn every_cpu_backward_matches_the_f64_reference() {
    let methods: Vec<_> = methods::all()
        .into_iter()
        .filter(|m| m.device == Device::Cpu)
        .collect();
    assert!(!methods.is_empty());
    for case in cases() {
        let shape = case.shape;
        let [q, k, v] = random_qkv(shape, case.seed);
        let dout = random_normal(shape, case.seed + 7919);
        let want = backward_f64(q.view(), k.view(), v.view(), dout.view()).unwrap();
        let bounds = allowed(&want);
        // the baseline of the 2× rule: the backward by hand after attention by hand
        let fwd = step01_naive::attention(q.view(), k.view(), v.view()).unwrap();
        let base = backward_by_hand(q.view(), k.view(), v.view(), &fwd, dout.view()).unwrap();
        let base = errors(&base, &want);
        for m in &methods {
            let fwd = (m.forward)(q.view(), k.view(), v.view())
                .unwrap_or_else(|e| panic!("{} failed on {shape}: {e}", m.name));
            let mut runs = vec![(
                format!("{} forward, blockwise backward", m.name),
                backward(q.view(), k.view(), v.view(), &fwd, dout.view()),
            )];
            if let Some(own) = m.backward {
                let got = own(q.view(), k.view(), v.view(), &fwd, dout.view());
                runs.push((format!("{} forward and backward", m.name), got));
            }
            for (name, got) in runs {
                let got = got.unwrap_or_else(|e| panic!("{name} failed on {shape}: {e}"));
                let errs = errors(&got, &want);
                println!(
                    "{name:>40} {shape}: dq {:.2e}, dk {:.2e}, dv {:.2e}",
                    errs[0], errs[1], errs[2]
                );
                for (i, grad) in ["dq", "dk", "dv"].into_iter().enumerate() {
                    let margin = MARGIN_REL * bounds[i] / GRAD_MAX_REL;
                    assert!(
                        errs[i] <= bounds[i] && errs[i] <= 2.0 * base[i] + margin,
                        "{name} on {shape}: {grad} max abs {:.3e}; allowed {:.3e} and at most \
                         twice by hand's {:.3e} plus {margin:.1e}",
                        errs[i],
                        bounds[i],
                        base[i]
                    );
                }
            }
        }
    }
}
