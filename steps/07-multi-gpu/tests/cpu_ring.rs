//! The CPU ring against the `f64` references, forward and backward, on 1 to 4 ranks and
//! lengths that leave uneven and empty chunks; against itself on one rank; and its errors
//! for bad input.

use flash_core::inputs::{random_normal, random_qkv};
use flash_core::reference::{attention_f64, error};
use flash_core::{Attention, AttnError, Shape};
use ndarray::{Array3, Array4};
use proptest::prelude::*;
use step04_backward::reference::{ReferenceGrads, backward_f64};
use step04_backward::{Grads, backward_by_hand};
use step07_multi_gpu::{MAX_RANKS, ring_backward, ring_forward};

/// The largest max-abs error of an `f32` CPU forward against the `f64` reference: the
/// cross-step rule (`tests/lib.rs`).
const F32_MAX_ABS: f64 = 1e-5;
/// The largest max-abs error of an `f32` gradient, relative to the gradient's largest value
/// (at least 1): step 04's rule (`steps/04-backward/tests/against_reference.rs`).
const GRAD_MAX_REL: f64 = 1e-5;
/// FlashAttention's rule on top: at most twice the error of the backward by hand in `f32`,
/// plus this margin relative to the gradient's largest value (by hand's error is exactly 0
/// on one token): as `tests/backward.rs` holds every CPU backward.
const MARGIN_REL: f64 = 1e-6;
/// How far the ring on `N` ranks may be from the ring on one: the same products, merged in
/// another order. Measured at most 2.4·10⁻⁶ on outputs and gradients of order 1 to 4.
const RANKS_MAX_ABS: f64 = 5e-6;

const LENGTHS: [usize; 5] = [1, 7, 77, 128, 300];

fn grad_errors(got: &Grads, want: &ReferenceGrads) -> [f64; 3] {
    [
        error(&got.dq, &want.dq).max_abs,
        error(&got.dk, &want.dk).max_abs,
        error(&got.dv, &want.dv).max_abs,
    ]
}

fn max_diff(a: &Array4<f32>, b: &Array4<f32>) -> f64 {
    error(a, &b.mapv(f64::from)).max_abs
}

/// The ring's forward and backward on each number of ranks of `ranks_list` against the
/// references, and against the ring on one rank when `ranks_list` starts with 1. Prints the
/// errors.
fn check(shape: Shape, seed: u64, ranks_list: &[usize]) {
    let [q, k, v] = random_qkv(shape, seed);
    let dout = random_normal(shape, seed + 7919);
    let want = attention_f64(q.view(), k.view(), v.view()).unwrap();
    let want_grads = backward_f64(q.view(), k.view(), v.view(), dout.view()).unwrap();
    // the baseline of the 2× rule: the backward by hand after attention by hand
    let by_hand_fwd = step01_naive::attention(q.view(), k.view(), v.view()).unwrap();
    let by_hand = backward_by_hand(q.view(), k.view(), v.view(), &by_hand_fwd, dout.view());
    let by_hand = grad_errors(&by_hand.unwrap(), &want_grads);
    let top = |r: &Array4<f64>| r.iter().fold(1.0f64, |m, x| m.max(x.abs()));
    let tops = [
        top(&want_grads.dq),
        top(&want_grads.dk),
        top(&want_grads.dv),
    ];
    let mut one: Option<(Attention, Grads)> = None;
    for &ranks in ranks_list {
        let fwd = ring_forward(q.view(), k.view(), v.view(), ranks).unwrap();
        let out = error(&fwd.out, &want.out).max_abs;
        let lse = error(&fwd.lse, &want.lse).max_abs;
        assert!(
            out < F32_MAX_ABS && lse < F32_MAX_ABS,
            "{ranks} ranks, {shape}: out {out:e}, lse {lse:e}; allowed {F32_MAX_ABS:e}"
        );
        let grads =
            ring_backward(q.view(), k.view(), v.view(), &fwd, dout.view(), ranks).unwrap();
        let errs = grad_errors(&grads, &want_grads);
        for (i, name) in ["dq", "dk", "dv"].into_iter().enumerate() {
            let allowed = GRAD_MAX_REL * tops[i];
            let rule = 2.0 * by_hand[i] + MARGIN_REL * tops[i];
            assert!(
                errs[i] <= allowed && errs[i] <= rule,
                "{ranks} ranks, {shape}: {name} {:e}; by hand {:e}; allowed {allowed:e}",
                errs[i],
                by_hand[i]
            );
        }
        // the same products merged in another order: close to the ring of one rank
        let mut from_one = 0.0;
        if let Some((f1, g1)) = &one {
            from_one = [
                max_diff(&fwd.out, &f1.out),
                error(&fwd.lse, &f1.lse.mapv(f64::from)).max_abs,
                max_diff(&grads.dq, &g1.dq),
                max_diff(&grads.dk, &g1.dk),
                max_diff(&grads.dv, &g1.dv),
            ]
            .into_iter()
            .fold(0.0, f64::max);
            assert!(
                from_one <= RANKS_MAX_ABS,
                "{ranks} ranks, {shape}: {from_one:e} from one rank"
            );
        } else if ranks == 1 {
            one = Some((fwd, grads));
        }
        println!(
            "{ranks} ranks, {shape}: out {out:.1e}, lse {lse:.1e}; dq {:.1e}, dk {:.1e}, \
             dv {:.1e} (by hand {:.1e}, {:.1e}, {:.1e}); from one rank {from_one:.1e}",
            errs[0], errs[1], errs[2], by_hand[0], by_hand[1], by_hand[2]
        );
    }
}

// ANCHOR: ring_test
#[test]
fn the_ring_matches_the_f64_references_on_one_to_four_ranks() {
    for (i, tokens) in LENGTHS.into_iter().enumerate() {
        // T = 1 and 7 leave empty chunks on 2 ranks and more; 77 and 300 uneven ones
        check(Shape::new(2, 3, tokens, 32), 70 + i as u64, &[1, 2, 3, 4]);
    }
}
// ANCHOR_END: ring_test

#[test]
fn a_longer_sequence_on_four_ranks() {
    check(Shape::new(1, 2, 1024, 64), 77, &[1, 4]);
}

#[test]
fn the_backward_takes_the_forward_of_one_device() {
    let shape = Shape::new(1, 2, 100, 16);
    let [q, k, v] = random_qkv(shape, 8);
    let dout = random_normal(shape, 9);
    let fwd = step01_naive::attention(q.view(), k.view(), v.view()).unwrap();
    let want = backward_f64(q.view(), k.view(), v.view(), dout.view()).unwrap();
    let got = ring_backward(q.view(), k.view(), v.view(), &fwd, dout.view(), 3).unwrap();
    let errs = grad_errors(&got, &want);
    assert!(errs.iter().all(|&e| e < 1e-5), "{errs:?}");
}

#[test]
fn more_ranks_than_tokens_leave_ranks_idle() {
    for (tokens, ranks) in [(1, 7), (3, 5), (9, 8)] {
        let shape = Shape::new(1, 2, tokens, 8);
        let [q, k, v] = random_qkv(shape, tokens as u64);
        let dout = random_normal(shape, 3);
        let want = attention_f64(q.view(), k.view(), v.view()).unwrap();
        let fwd = ring_forward(q.view(), k.view(), v.view(), ranks).unwrap();
        assert!(error(&fwd.out, &want.out).max_abs < F32_MAX_ABS);
        assert!(error(&fwd.lse, &want.lse).max_abs < F32_MAX_ABS);
        let want = backward_f64(q.view(), k.view(), v.view(), dout.view()).unwrap();
        let got =
            ring_backward(q.view(), k.view(), v.view(), &fwd, dout.view(), ranks).unwrap();
        let errs = grad_errors(&got, &want);
        assert!(
            errs.iter().all(|&e| e < 1e-5),
            "{tokens} tokens, {ranks} ranks: {errs:?}"
        );
    }
}

#[test]
fn bad_input_is_an_error_that_says_what_was_wrong() {
    let shape = Shape::new(1, 2, 9, 8);
    let [q, k, v] = random_qkv(shape, 1);
    let dout = random_normal(shape, 2);
    let fwd = ring_forward(q.view(), k.view(), v.view(), 2).unwrap();
    for ranks in [0, MAX_RANKS + 1] {
        let err = ring_forward(q.view(), k.view(), v.view(), ranks).unwrap_err();
        assert!(matches!(err, AttnError::Unsupported { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("{ranks} ranks")) && msg.contains("from 1 to 256"),
            "{msg}"
        );
        let err = ring_backward(q.view(), k.view(), v.view(), &fwd, dout.view(), ranks);
        assert!(matches!(err, Err(AttnError::Unsupported { .. })));
    }
    let short = Array4::<f32>::zeros((1, 2, 8, 8));
    let err = ring_forward(q.view(), short.view(), v.view(), 2).unwrap_err();
    assert!(err.to_string().contains("k is [1, 2, 8, 8]"), "{err}");
    let err =
        ring_backward(q.view(), k.view(), v.view(), &fwd, short.view(), 2).unwrap_err();
    assert!(
        err.to_string()
            .contains("dout is [1, 2, 8, 8] but q, k and v are [1, 2, 9, 8]"),
        "{err}"
    );
    let mut bad_lse = fwd.clone();
    bad_lse.lse = Array3::zeros((1, 2, 8));
    let err =
        ring_backward(q.view(), k.view(), v.view(), &bad_lse, dout.view(), 2).unwrap_err();
    assert!(
        err.to_string().contains("the forward's lse is [1, 2, 8]"),
        "{err}"
    );
    let mut nan = q.clone();
    nan[[0, 1, 4, 2]] = f32::NAN;
    let err = ring_forward(nan.view(), k.view(), v.view(), 3).unwrap_err();
    assert!(err.to_string().contains("q[0, 1, 4, 2] is NaN"), "{err}");
    let z = Array4::<f32>::zeros((1, 2, 9, 0));
    let err = ring_forward(z.view(), z.view(), z.view(), 2).unwrap_err();
    assert_eq!(err, AttnError::ZeroHeadDim);
}

#[test]
fn empty_input_gives_empty_results() {
    for dims in [(1, 2, 0, 16), (0, 2, 5, 16), (1, 0, 5, 16)] {
        let x = Array4::<f32>::zeros(dims);
        let fwd = ring_forward(x.view(), x.view(), x.view(), 3).unwrap();
        assert_eq!(fwd.out.dim(), dims);
        let g = ring_backward(x.view(), x.view(), x.view(), &fwd, x.view(), 3).unwrap();
        assert_eq!((g.dq.dim(), g.dk.dim(), g.dv.dim()), (dims, dims, dims));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Any shape on any number of ranks: the ring's result is the reference's.
    #[test]
    fn any_shape_on_any_number_of_ranks(
        (batch, heads, tokens, head_dim) in (1usize..3, 1usize..3, 1usize..50, 1usize..17),
        ranks in 1usize..7,
        seed in any::<u64>(),
    ) {
        let shape = Shape::new(batch, heads, tokens, head_dim);
        let [q, k, v] = random_qkv(shape, seed);
        let dout = random_normal(shape, seed ^ 0xd0);
        let want = attention_f64(q.view(), k.view(), v.view()).unwrap();
        let fwd = ring_forward(q.view(), k.view(), v.view(), ranks).unwrap();
        let (out, lse) = (error(&fwd.out, &want.out), error(&fwd.lse, &want.lse));
        prop_assert!(out.max_abs < F32_MAX_ABS && lse.max_abs < F32_MAX_ABS,
            "{} on {} ranks: out {}, lse {}", shape, ranks, out, lse);
        let want = backward_f64(q.view(), k.view(), v.view(), dout.view()).unwrap();
        let got = ring_backward(q.view(), k.view(), v.view(), &fwd, dout.view(), ranks).unwrap();
        let errs = grad_errors(&got, &want);
        prop_assert!(errs.iter().all(|&e| e < 1e-5), "{} on {} ranks: {:?}", shape, ranks, errs);
    }
}
