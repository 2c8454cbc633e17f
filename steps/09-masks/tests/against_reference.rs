//! Every mask with every score function, forward and backward, with grouped heads and
//! fewer queries than keys, against the `f64` reference by FlashAttention's rule.

mod common;

use common::{
    assert_rule, error_with_infinities, inputs, mask_with_empty_rows, masks, score_mods,
};
use flash_core::reference::error;
use step09_masks::reference::{
    attention_by_hand, attention_f64, backward_by_hand, backward_f64,
};
use step09_masks::{Mask, ScoreMod, backward, forward};

/// 2 sequences, 4 query heads on 2 kv heads, 45 queries (the last ones) on 77 keys, head
/// dim 16: partial tiles of 64 at both ends, and an offset of 32 between rows and
/// positions.
const SHAPE: (usize, usize, usize, usize, usize, usize) = (2, 4, 2, 45, 77, 16);

// ANCHOR: rule
fn check(mask: &Mask, score: &ScoreMod, seed: u64) {
    let x = inputs(SHAPE, seed);
    let (q, k, v, dout) = (x.q.view(), x.k.view(), x.v.view(), x.dout.view());
    let what = format!("mask {}, score {}", mask.name(), score.name());
    let want = attention_f64(q, k, v, mask, score).unwrap();
    let base = attention_by_hand(q, k, v, mask, score).unwrap();
    let ours = forward(q, k, v, mask, score).unwrap();
    assert_rule(
        &format!("{what}: out"),
        error_with_infinities(&ours.out, &want.out),
        error_with_infinities(&base.out, &want.out),
    );
    assert_rule(
        &format!("{what}: lse"),
        error_with_infinities(&ours.lse, &want.lse),
        error_with_infinities(&base.lse, &want.lse),
    );
    let want = backward_f64(q, k, v, dout, mask, score).unwrap();
    let base = backward_by_hand(q, k, v, dout, mask, score).unwrap();
    let grads = backward(q, k, v, &ours, dout, mask, score).unwrap();
    for (name, got, by_hand, want) in [
        ("dq", &grads.dq, &base.dq, &want.dq),
        ("dk", &grads.dk, &base.dk, &want.dk),
        ("dv", &grads.dv, &base.dv, &want.dv),
    ] {
        let (ours, by_hand) = (error(got, want), error(by_hand, want));
        println!("{what}: {name} ours {ours}, by hand {by_hand}");
        assert_rule(&format!("{what}: {name}"), ours, by_hand);
    }
}
// ANCHOR_END: rule

#[test]
fn every_mask_and_score_function_matches_the_f64_reference() {
    let mut seed = 900;
    for mask in masks(SHAPE.4) {
        for score in score_mods(SHAPE.1) {
            check(&mask, &score, seed);
            seed += 4;
        }
    }
}

#[test]
fn queries_as_many_as_keys_and_no_grouping() {
    let x = inputs((1, 3, 3, 70, 70, 8), 77);
    let (q, k, v) = (x.q.view(), x.k.view(), x.v.view());
    for mask in [Mask::Causal, Mask::Sliding { window: 3 }, Mask::Full] {
        let want = attention_f64(q, k, v, &mask, &ScoreMod::None).unwrap();
        let base = attention_by_hand(q, k, v, &mask, &ScoreMod::None).unwrap();
        let ours = forward(q, k, v, &mask, &ScoreMod::None).unwrap();
        let what = format!("{} at 70 tokens", mask.name());
        assert_rule(
            &what,
            error(&ours.out, &want.out),
            error(&base.out, &want.out),
        );
    }
}

#[test]
fn the_causal_mask_is_step_01s_attention() {
    // with as many queries as keys and one kv head per head, the causal mask is the causal
    // attention every earlier step computes: the two references agree to the last digits
    let x = inputs((2, 2, 2, 37, 37, 16), 5);
    let (q, k, v) = (x.q.view(), x.k.view(), x.v.view());
    let ours = attention_f64(q, k, v, &Mask::Causal, &ScoreMod::None).unwrap();
    let step01 = flash_core::reference::attention_f64(q, k, v).unwrap();
    assert!(error(&ours.out, &step01.out).max_abs < 1e-12);
    assert!(error(&ours.lse, &step01.lse).max_abs < 1e-12);
}

#[test]
fn a_row_that_sees_no_key_gives_zero_and_minus_infinity_and_no_gradient() {
    let mask = mask_with_empty_rows();
    let x = inputs(SHAPE, 31);
    let (q, k, v, dout) = (x.q.view(), x.k.view(), x.v.view(), x.dout.view());
    let offset = SHAPE.4 - SHAPE.3;
    let empty = |i: usize| (i + offset) < 60 || (i + offset).is_multiple_of(5);
    for score in score_mods(SHAPE.1) {
        let want = attention_f64(q, k, v, &mask, &score).unwrap();
        let fwd = forward(q, k, v, &mask, &score).unwrap();
        let grads = backward(q, k, v, &fwd, dout, &mask, &score).unwrap();
        let want_grads = backward_f64(q, k, v, dout, &mask, &score).unwrap();
        for ((b, h, i), &lse) in fwd.lse.indexed_iter() {
            let row = fwd.out.slice(ndarray::s![b, h, i, ..]);
            let dq = grads.dq.slice(ndarray::s![b, h, i, ..]);
            if empty(i) {
                assert_eq!(lse, f32::NEG_INFINITY, "lse of row {i}");
                assert_eq!(want.lse[[b, h, i]], f64::NEG_INFINITY, "f64 lse of row {i}");
                assert!(row.iter().all(|&x| x == 0.0), "out of row {i}: {row}");
                assert!(dq.iter().all(|&x| x == 0.0), "dq of row {i}: {dq}");
            } else {
                assert!(lse.is_finite(), "lse of row {i} is {lse}");
            }
        }
        let e = error_with_infinities(&fwd.out, &want.out);
        assert!(e.max_abs < 1e-5, "{}: out {e}", score.name());
        for (name, got, want) in [
            ("dq", &grads.dq, &want_grads.dq),
            ("dk", &grads.dk, &want_grads.dk),
            ("dv", &grads.dv, &want_grads.dv),
        ] {
            let e = error(got, want);
            assert!(e.max_abs < 1e-4, "{}: {name} {e}", score.name());
        }
    }
}

#[test]
fn empty_shapes_give_empty_results() {
    for (b, h, kvh, tq, tk) in [
        (0, 2, 1, 3, 5),
        (1, 0, 0, 3, 5),
        (1, 2, 1, 0, 5),
        (1, 2, 1, 0, 0),
    ] {
        let x = inputs((b, h, kvh, tq, tk, 4), 1);
        let (q, k, v, dout) = (x.q.view(), x.k.view(), x.v.view(), x.dout.view());
        for mask in [Mask::Causal, Mask::Sliding { window: 2 }] {
            let fwd = forward(q, k, v, &mask, &ScoreMod::None).unwrap();
            assert_eq!(fwd.out.dim(), (b, h, tq, 4));
            let g = backward(q, k, v, &fwd, dout, &mask, &ScoreMod::None).unwrap();
            assert_eq!(g.dk.dim(), (b, kvh, tk, 4));
            assert!(g.dk.iter().all(|&x| x == 0.0));
            let want = backward_f64(q, k, v, dout, &mask, &ScoreMod::None).unwrap();
            assert_eq!(want.dq.dim(), (b, h, tq, 4));
        }
    }
}
