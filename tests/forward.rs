//! Every method the registry lists, on every case of the table, against the f64 reference.

use cross_step_tests::{F32_MAX_ABS, Tally, cases};
use flash_attention::methods::{self, Device, Dtype};
use flash_core::inputs::random_qkv;
use flash_core::reference::{attention_f64, error};

#[test]
fn every_cpu_method_matches_the_f64_reference() {
    let methods: Vec<_> = methods::all()
        .into_iter()
        .filter(|m| m.device() == Device::Cpu)
        .collect();
    assert!(!methods.is_empty());
    // f32 is what this test holds to F32_MAX_ABS: a CPU method that claims another dtype
    // fails the tally until a rule for it is written here
    let mut tally = Tally::default();
    for m in &methods {
        m.dtypes().iter().for_each(|&d| tally.claim(m.name(), d));
    }
    for case in cases() {
        let [q, k, v] = random_qkv(case.shape, case.seed);
        let reference = attention_f64(q.view(), k.view(), v.view()).unwrap();
        for m in &methods {
            let got = m
                .forward(q.view(), k.view(), v.view(), Dtype::F32)
                .unwrap_or_else(|e| panic!("{} failed on {}: {e}", m.name(), case.shape));
            let out = error(&got.out, &reference.out);
            let lse = error(&got.lse, &reference.lse);
            println!("{:>16} {}: out {out}; lse {lse}", m.name(), case.shape);
            assert!(
                out.max_abs < F32_MAX_ABS && lse.max_abs < F32_MAX_ABS,
                "{} on {}: out {out}, lse {lse}; allowed max abs {F32_MAX_ABS:e}",
                m.name(),
                case.shape
            );
            tally.checked(m.name(), Dtype::F32);
        }
    }
    tally.assert_each_claim_checked();
}

#[test]
fn every_method_rejects_mismatched_shapes_and_zero_head_dim() {
    use ndarray::Array4;
    let a = Array4::<f32>::zeros((1, 2, 8, 16));
    let b = Array4::<f32>::zeros((1, 2, 9, 16));
    let z = Array4::<f32>::zeros((1, 2, 8, 0));
    for m in methods::all() {
        let dtype = m.dtypes()[0];
        let err = m
            .forward(a.view(), b.view(), a.view(), dtype)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("shape mismatch") && err.contains("[1, 2, 9, 16]"),
            "{}: {err}",
            m.name()
        );
        let err = m
            .forward(z.view(), z.view(), z.view(), dtype)
            .unwrap_err()
            .to_string();
        assert!(err.contains("head_dim is 0"), "{}: {err}", m.name());
    }
}

/// Every method, CPU and GPU alike (a GPU method checks its input before it opens the
/// device), refuses a NaN or an infinity with the tensor and the first position; a
/// non-finite value is never computed with, so no answer depends on a method's block size.
#[test]
fn every_method_refuses_non_finite_input_naming_the_tensor_and_position() {
    use flash_core::AttnError;
    let shape = flash_core::Shape::new(2, 3, 17, 8);
    for (tensor, at, value, says) in [
        (0, [0, 1, 5, 2], f32::NAN, "q[0, 1, 5, 2] is NaN"),
        (2, [1, 2, 10, 7], f32::INFINITY, "v[1, 2, 10, 7] is inf"),
        (1, [1, 0, 0, 0], f32::NAN, "k[1, 0, 0, 0] is NaN"),
    ] {
        let mut qkv = random_qkv(shape, 8);
        qkv[tensor][at] = value;
        // a second bad value further on: the first is the one named
        qkv[tensor][[1, 2, 16, 7]] = f32::NEG_INFINITY;
        let [q, k, v] = &qkv;
        for m in methods::all() {
            match m.forward(q.view(), k.view(), v.view(), m.dtypes()[0]) {
                Err(e @ AttnError::NonFinite { .. }) => {
                    let e = e.to_string();
                    assert!(
                        e.contains(says) && e.contains("non-finite"),
                        "{}: {e}",
                        m.name()
                    );
                }
                other => panic!("{}: {says}: expected NonFinite, got {other:?}", m.name()),
            }
        }
    }
    // [step 04]
    // every backward refuses a NaN in the output's gradient the same way
    let [q, k, v] = random_qkv(shape, 9);
    let fwd = step01_naive::attention(q.view(), k.view(), v.view()).unwrap();
    let mut dout = random_qkv(shape, 10)[0].clone();
    dout[[0, 2, 9, 3]] = f32::NAN;
    for m in methods::all().into_iter().filter(|m| m.has_backward()) {
        match m.backward(
            q.view(),
            k.view(),
            v.view(),
            &fwd,
            dout.view(),
            m.dtypes()[0],
        ) {
            Err(AttnError::NonFinite { what }) => {
                assert!(
                    what.contains("dout[0, 2, 9, 3] is NaN"),
                    "{}: {what}",
                    m.name()
                )
            }
            other => panic!("{} backward: expected NonFinite, got {other:?}", m.name()),
        }
    }
    // [/step 04]
}

#[test]
fn every_cpu_method_returns_an_empty_output_for_empty_input() {
    use ndarray::Array4;
    for dims in [(1, 2, 0, 16), (0, 2, 5, 16), (1, 0, 5, 16)] {
        let x = Array4::<f32>::zeros(dims);
        for m in methods::all()
            .into_iter()
            .filter(|m| m.device() == Device::Cpu)
        {
            let got = m.forward(x.view(), x.view(), x.view(), Dtype::F32).unwrap();
            assert_eq!(got.out.dim(), dims, "{}", m.name());
            assert_eq!(got.lse.dim(), (dims.0, dims.1, dims.2), "{}", m.name());
        }
    }
}

// [step 03]
/// The CUDA methods of the registry on every case, in each dtype they claim, with
/// FlashAttention's rule: max error against f64 at most twice that of attention by hand in
/// that dtype, plus a tiny margin. Each method must be checked on at least one case of each
/// dtype it claims: a head dim it refuses is skipped, and counted.
#[test]
#[ignore = "needs a CUDA GPU"]
fn every_cuda_method_is_within_twice_by_hand_error_in_each_dtype() {
    use flash_core::AttnError;
    use step03_cuda_forward::host::{by_hand_low_precision, round_array};
    let methods: Vec<_> = methods::all()
        .into_iter()
        .filter(|m| m.device() == Device::Cuda)
        .collect();
    assert!(!methods.is_empty());
    // every dtype a method claims is checked, each against attention by hand in it
    let mut tally = Tally::default();
    for m in &methods {
        m.dtypes().iter().for_each(|&d| tally.claim(m.name(), d));
    }
    let dtypes = [Dtype::Bf16, Dtype::F16];
    for case in cases() {
        let [q, k, v] = random_qkv(case.shape, case.seed);
        for dtype in dtypes {
            let rounded = [&q, &k, &v].map(|x| round_array(x.view(), dtype));
            let reference =
                attention_f64(rounded[0].view(), rounded[1].view(), rounded[2].view())
                    .unwrap();
            let by_hand = error(
                &by_hand_low_precision(q.view(), k.view(), v.view(), dtype),
                &reference.out,
            );
            for m in methods.iter().filter(|m| m.dtypes().contains(&dtype)) {
                let got = match m.forward(q.view(), k.view(), v.view(), dtype) {
                    Ok(got) => got,
                    // the first rungs of the ladder keep a row in registers: not every
                    // head dim
                    Err(e @ AttnError::UnsupportedHeadDim { .. }) => {
                        println!("{:>16} {} {dtype}: {e}", m.name(), case.shape);
                        tally.refused(m.name(), dtype);
                        continue;
                    }
                    Err(e) => {
                        panic!("{} failed on {} in {dtype}: {e}", m.name(), case.shape)
                    }
                };
                let out = error(&got.out, &reference.out);
                println!(
                    "{:>16} {} {dtype}: out {out}; by hand {by_hand}",
                    m.name(),
                    case.shape
                );
                assert!(
                    out.max_abs <= 2.0 * by_hand.max_abs + 1e-5,
                    "{} on {} in {dtype}: out {out}; by hand {by_hand}",
                    m.name(),
                    case.shape
                );
                tally.checked(m.name(), dtype);
            }
        }
    }
    // a method that claims a dtype outside `dtypes` fails here, unchecked
    tally.assert_each_claim_checked();
}
// [/step 03]
