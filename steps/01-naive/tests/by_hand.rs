//! Attention by hand against the f64 reference, and its errors for bad input.

use flash_core::inputs::random_qkv;
use flash_core::reference::{attention_f64, error};
use flash_core::{AttnError, Shape};
use ndarray::Array4;
use step01_naive::attention;

// ANCHOR: against_reference
#[test]
fn matches_the_f64_reference() {
    for tokens in [1, 100, 256, 1000] {
        let shape = Shape::new(2, 3, tokens, 64);
        let [q, k, v] = random_qkv(shape, tokens as u64);
        let got = attention(q.view(), k.view(), v.view()).unwrap();
        let want = attention_f64(q.view(), k.view(), v.view()).unwrap();
        let (out, lse) = (error(&got.out, &want.out), error(&got.lse, &want.lse));
        println!("{shape}: out {out}; lse {lse}");
        assert!(
            out.max_abs < 1e-5 && lse.max_abs < 1e-5,
            "{shape}: out {out}; lse {lse}"
        );
    }
}
// ANCHOR_END: against_reference

#[test]
fn the_reference_is_the_textbook_formula_on_a_tiny_case() {
    // one head, two tokens, head dim 1: row 0 sees only itself; row 1 sees s = [q1·k0,
    // q1·k1]
    let q = Array4::from_shape_vec((1, 1, 2, 1), vec![1.0f32, 2.0]).unwrap();
    let k = Array4::from_shape_vec((1, 1, 2, 1), vec![0.5f32, -1.0]).unwrap();
    let v = Array4::from_shape_vec((1, 1, 2, 1), vec![3.0f32, 5.0]).unwrap();
    let r = attention_f64(q.view(), k.view(), v.view()).unwrap();
    let (s0, s1): (f64, f64) = (1.0, -2.0); // q1·k0 = 2·0.5 and q1·k1 = 2·(−1), scale 1/√1
    let (p0, p1) = (
        f64::exp(s0) / (f64::exp(s0) + f64::exp(s1)),
        f64::exp(s1) / (f64::exp(s0) + f64::exp(s1)),
    );
    assert_eq!(r.out[[0, 0, 0, 0]], 3.0);
    assert!((r.out[[0, 0, 1, 0]] - (p0 * 3.0 + p1 * 5.0)).abs() < 1e-15);
    assert!((r.lse[[0, 0, 1]] - (f64::exp(s0) + f64::exp(s1)).ln()).abs() < 1e-15);
    assert!((r.lse[[0, 0, 0]] - 0.5).abs() < 1e-15);
}

#[test]
fn mismatched_shapes_are_an_error_that_names_them() {
    let a = Array4::<f32>::zeros((2, 3, 10, 64));
    let b = Array4::<f32>::zeros((2, 3, 10, 32));
    let err = attention(a.view(), a.view(), b.view()).unwrap_err();
    assert!(matches!(err, AttnError::ShapeMismatch { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains("v is [2, 3, 10, 32]") && msg.contains("must all be"),
        "{msg}"
    );
}

#[test]
fn zero_head_dim_is_an_error() {
    let z = Array4::<f32>::zeros((1, 1, 4, 0));
    assert_eq!(
        attention(z.view(), z.view(), z.view()).unwrap_err(),
        AttnError::ZeroHeadDim
    );
}

#[test]
fn empty_sequences_give_an_empty_output() {
    let x = Array4::<f32>::zeros((2, 3, 0, 64));
    let got = attention(x.view(), x.view(), x.view()).unwrap();
    assert_eq!(got.out.dim(), (2, 3, 0, 64));
    assert_eq!(got.lse.dim(), (2, 3, 0));
}

#[test]
fn a_table_too_large_to_allocate_is_an_error_not_an_abort() {
    // 2^40 tokens would need a 2^80-entry table: the size overflows before any allocation.
    let err = flash_core::try_zeros::<f32>(
        "a table",
        1usize.checked_shl(63).and_then(|n| n.checked_mul(4)),
    )
    .unwrap_err();
    assert!(
        err.to_string().starts_with("out of memory: a table needs"),
        "{err}"
    );
    // and a real but impossible allocation is refused, not aborted
    let err = flash_core::try_zeros::<f32>("a table", Some(usize::MAX / 8)).unwrap_err();
    assert!(matches!(err, AttnError::OutOfMemory { .. }), "{err}");
}

#[test]
fn the_inputs_are_seeded_normal_values() {
    let shape = Shape::new(1, 2, 500, 64);
    let [a, ..] = random_qkv(shape, 7);
    let [b, ..] = random_qkv(shape, 7);
    assert_eq!(a, b, "the same seed gives the same inputs");
    let n = a.len() as f64;
    let mean = a.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    assert!(
        mean.abs() < 0.02 && (var - 1.0).abs() < 0.03,
        "mean {mean}, variance {var}"
    );
}
