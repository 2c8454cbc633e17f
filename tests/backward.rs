//! Backward passes on every case of the table against the f64 reference backward of step
//! 04: the backward each CPU method of the registry comes with, and step 04's blockwise
//! backward after each CPU method's forward (it takes the output and log-sum-exp of any
//! forward).
//!
//! On a GPU (ignored elsewhere), the backward each CUDA method of the registry comes with,
//! after its own forward, in each dtype it claims.
//!
//! Every case of the table runs: the f64 reference backward goes through one `T × T` table
//! per head with matrix products, a fraction of a second at the table's longest length
//! (1000).

use cross_step_tests::{Tally, cases};
use flash_attention::methods::{self, Device, Dtype};
use flash_core::inputs::{random_normal, random_qkv};
use flash_core::reference::error;
use ndarray::Array4;
use step04_backward::reference::{ReferenceGrads, backward_f64};
use step04_backward::{Grads, backward, backward_by_hand};

/// The largest max-abs error of an f32 gradient against the f64 reference, relative to the
/// largest value of that gradient (at least 1); why this size: steps/04-backward/tests/
/// against_reference.rs, where it is measured.
const GRAD_MAX_REL: f64 = 1e-5;
/// FlashAttention's rule on top: at most twice the error of the backward by hand in the
/// same precision, plus this margin (relative to the gradient's largest value, at least 1)
/// for the errors that are exactly 0 by hand: with one token, by hand's dv is exactly dout,
/// while a forward that rounds its dot products differently moves p by an ulp.
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
        .filter(|m| m.device() == Device::Cpu)
        .collect();
    assert!(!methods.is_empty());
    // f32 is what this test holds to GRAD_MAX_REL: a CPU method that claims another dtype
    // fails the tally until a rule for it is written here
    let blockwise = |d: Dtype| format!("{d}, step 04's backward after its forward");
    let own = |d: Dtype| format!("{d}, its own backward");
    let mut tally = Tally::default();
    for m in &methods {
        for &d in m.dtypes() {
            tally.claim(m.name(), blockwise(d));
            if m.has_backward() {
                tally.claim(m.name(), own(d));
            }
        }
    }
    for case in cases() {
        let shape = case.shape;
        let [q, k, v] = random_qkv(shape, case.seed);
        let dout = random_normal(shape, case.seed + 7919);
        let want = backward_f64(q.view(), k.view(), v.view(), dout.view()).unwrap();
        let bounds = allowed(&want);
        // the baseline of the 2× rule: the backward by hand after attention by hand
        let fwd = step01_naive::attention(q.view(), k.view(), v.view()).unwrap();
        let base =
            backward_by_hand(q.view(), k.view(), v.view(), &fwd, dout.view()).unwrap();
        let base = errors(&base, &want);
        for m in &methods {
            let fwd = m
                .forward(q.view(), k.view(), v.view(), Dtype::F32)
                .unwrap_or_else(|e| panic!("{} failed on {shape}: {e}", m.name()));
            let mut runs = vec![(
                format!("{} forward, blockwise backward", m.name()),
                blockwise(Dtype::F32),
                backward(q.view(), k.view(), v.view(), &fwd, dout.view()),
            )];
            if m.has_backward() {
                let got =
                    m.backward(q.view(), k.view(), v.view(), &fwd, dout.view(), Dtype::F32);
                runs.push((
                    format!("{} forward and backward", m.name()),
                    own(Dtype::F32),
                    got,
                ));
            }
            for (name, kind, got) in runs {
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
                tally.checked(m.name(), kind);
            }
        }
    }
    tally.assert_each_claim_checked();
}

/// The CUDA methods of the registry that have a backward, on every case, in each dtype they
/// claim: each one's forward then its own backward, against the f64 reference under
/// FlashAttention's rule: each gradient's max-abs error at most twice that of the backward
/// by hand in that dtype (PyTorch's autograd rounding, on the CPU), plus 10⁻⁵ of the
/// gradient's largest value. Each method must be checked on at least one case of each
/// dtype it claims: a head dim it refuses is skipped, and counted.
#[test]
#[ignore = "needs a CUDA GPU"]
fn every_cuda_backward_is_within_twice_by_hand_error_in_each_dtype() {
    use flash_core::AttnError;
    use step03_cuda_forward::host::round_array;
    use step04_backward::cuda::backward_by_hand_low_precision;
    let methods: Vec<_> = methods::all()
        .into_iter()
        .filter(|m| m.device() == Device::Cuda && m.has_backward())
        .collect();
    assert!(!methods.is_empty());
    let mut tally = Tally::default();
    for m in &methods {
        m.dtypes().iter().for_each(|&d| tally.claim(m.name(), d));
    }
    for case in cases() {
        let shape = case.shape;
        let [q, k, v] = random_qkv(shape, case.seed);
        let dout = random_normal(shape, case.seed + 7919);
        for dtype in [Dtype::Bf16, Dtype::F16] {
            let [qr, kr, vr, dr] =
                [&q, &k, &v, &dout].map(|x| round_array(x.view(), dtype));
            let want = backward_f64(qr.view(), kr.view(), vr.view(), dr.view()).unwrap();
            let hand = backward_by_hand_low_precision(
                q.view(),
                k.view(),
                v.view(),
                dout.view(),
                dtype,
            );
            let base = errors(&hand, &want);
            let size = |r: &Array4<f64>| r.iter().fold(1.0f64, |m, x| m.max(x.abs()));
            let sizes = [size(&want.dq), size(&want.dk), size(&want.dv)];
            for m in methods.iter().filter(|m| m.dtypes().contains(&dtype)) {
                let got = m
                    .forward(q.view(), k.view(), v.view(), dtype)
                    .and_then(|fwd| {
                        m.backward(q.view(), k.view(), v.view(), &fwd, dout.view(), dtype)
                    });
                let got = match got {
                    Ok(got) => got,
                    // a head dim a method's kernels are not compiled for
                    Err(e @ AttnError::UnsupportedHeadDim { .. }) => {
                        println!("{:>16} {shape} {dtype}: {e}", m.name());
                        tally.refused(m.name(), dtype);
                        continue;
                    }
                    Err(e) => panic!("{} failed on {shape} in {dtype}: {e}", m.name()),
                };
                let errs = errors(&got, &want);
                println!(
                    "{:>16} {shape} {dtype}: dq {:.2e}, dk {:.2e}, dv {:.2e}; by hand {:.2e}, {:.2e}, {:.2e}",
                    m.name(),
                    errs[0],
                    errs[1],
                    errs[2],
                    base[0],
                    base[1],
                    base[2]
                );
                for (i, grad) in ["dq", "dk", "dv"].into_iter().enumerate() {
                    let margin = 1e-5 * sizes[i];
                    assert!(
                        errs[i] <= 2.0 * base[i] + margin,
                        "{} on {shape} in {dtype}: {grad} max abs {:.3e}; by hand {:.3e} (+{margin:.1e})",
                        m.name(),
                        errs[i],
                        base[i]
                    );
                }
                tally.checked(m.name(), dtype);
            }
        }
    }
    // a method that claims a dtype other than bf16 and f16 fails here, unchecked
    tally.assert_each_claim_checked();
}

/// A method says it has a backward exactly when its backward does more than refuse: with
/// shapes that do not match, one that has a backward names the mismatch (before any work,
/// on the CPU or the GPU), one that has none says so.
#[test]
fn every_method_has_a_backward_exactly_when_it_says_so() {
    use flash_core::AttnError;
    let [q, k, v] = random_qkv(flash_core::Shape::new(1, 2, 8, 16), 1);
    let fwd = step01_naive::attention(q.view(), k.view(), v.view()).unwrap();
    let dout = Array4::<f32>::zeros((1, 2, 9, 16));
    for m in methods::all() {
        let got = m.backward(
            q.view(),
            k.view(),
            v.view(),
            &fwd,
            dout.view(),
            m.dtypes()[0],
        );
        match (m.has_backward(), got) {
            (true, Err(AttnError::ShapeMismatch { .. })) => {}
            (false, Err(e @ AttnError::NoBackward { .. })) => {
                assert!(e.to_string().contains(m.name()), "{e}")
            }
            (has, other) => panic!(
                "{}: says it has a backward: {has}; its backward gave {other:?}",
                m.name()
            ),
        }
    }
}
