//! Every f32 backward against the f64 reference backward, and their errors for bad input.

use flash_core::Shape;
use flash_core::inputs::{random_normal, random_qkv};
use flash_core::reference::{Error, error};
use ndarray::{Array3, Array4};
use step04_backward::reference::{ReferenceGrads, backward_f64};
use step04_backward::{
    AttnError, BackwardFn, BlockSizes, Grads, backward, backward_by_hand,
    backward_two_pass, backward_with_blocks, forward,
};

/// The largest max-abs error of an f32 gradient against the f64 reference, relative to the
/// largest value of that gradient (at least 1).
///
/// The gradients are sums of up to T products of values of order 1, formed in f32 (unit
/// roundoff 6e-8) from probabilities that carry a relative error of about `|S|·6e-8`
/// themselves. Measured: at most 3e-6 of max abs on this file's cases and 4e-6 on the
/// cross-step table, with gradients of magnitude 1 to 4, for both methods at every length
/// up to 1000. The bound leaves a margin of 2.5 or more, while a mistake in a formula (a
/// wrong scale, a δ off by
/// 0.1%) is caught at once.
const GRAD_MAX_REL: f64 = 1e-5;

/// The block sizes that leave partial blocks at every length below, besides the default.
const ODD_BLOCKS: BlockSizes = BlockSizes {
    queries: 48,
    keys: 80,
};

const METHODS: [(&str, BackwardFn); 5] = [
    ("by hand", backward_by_hand),
    ("blockwise", backward),
    ("blockwise 48×80", |q, k, v, fwd, dout| {
        backward_with_blocks(q, k, v, fwd, dout, ODD_BLOCKS)
    }),
    ("two passes", |q, k, v, fwd, dout| {
        backward_two_pass(q, k, v, fwd, dout, BlockSizes::default())
    }),
    ("two passes 48×80", |q, k, v, fwd, dout| {
        backward_two_pass(q, k, v, fwd, dout, ODD_BLOCKS)
    }),
];

/// The errors of dq, dk and dv, and the largest each may be.
fn errors(got: &Grads, want: &ReferenceGrads) -> [(&'static str, Error, f64); 3] {
    let allowed =
        |r: &Array4<f64>| GRAD_MAX_REL * r.iter().fold(1.0f64, |m, x| m.max(x.abs()));
    [
        ("dq", error(&got.dq, &want.dq), allowed(&want.dq)),
        ("dk", error(&got.dk, &want.dk), allowed(&want.dk)),
        ("dv", error(&got.dv, &want.dv), allowed(&want.dv)),
    ]
}

#[test]
fn every_backward_matches_the_f64_reference() {
    for (tokens, head_dim) in [
        (1, 64),
        (77, 64),
        (100, 64),
        (128, 64),
        (300, 64),
        (1000, 64),
        (130, 32),
    ] {
        let shape = Shape::new(1, 2, tokens, head_dim);
        let [q, k, v] = random_qkv(shape, tokens as u64);
        let dout = random_normal(shape, 1000 + tokens as u64);
        let fwd = forward(q.view(), k.view(), v.view()).unwrap();
        let want = backward_f64(q.view(), k.view(), v.view(), dout.view()).unwrap();
        let mut by_hand = None;
        for (name, method) in METHODS {
            let got = method(q.view(), k.view(), v.view(), &fwd, dout.view()).unwrap();
            let errs = errors(&got, &want);
            for (grad, err, allowed) in errs {
                println!("{name:>16} {shape}: {grad} {err} (allowed {allowed:.1e})");
                assert!(
                    err.max_abs <= allowed,
                    "{name} on {shape}: {grad} {err}; allowed max abs {allowed:.3e}"
                );
            }
            // FlashAttention's rule: at most twice the error of the backward by hand in the
            // same precision, plus a margin of 1e-6 for lengths where both are near zero
            match &by_hand {
                None => by_hand = Some(errs),
                Some(base) => {
                    for ((grad, err, _), (_, base, _)) in errs.iter().zip(base) {
                        assert!(
                            err.max_abs <= 2.0 * base.max_abs + 1e-6,
                            "{name} on {shape}: {grad} {err}, by hand {base}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn bad_shapes_are_errors_that_say_what_was_wrong() {
    let shape = Shape::new(1, 2, 9, 8);
    let [q, k, v] = random_qkv(shape, 1);
    let dout = random_normal(shape, 2);
    let fwd = forward(q.view(), k.view(), v.view()).unwrap();
    let short = Array4::<f32>::zeros((1, 2, 8, 8));
    let mut bad_out = fwd.clone();
    bad_out.out = short.clone();
    let mut bad_lse = fwd.clone();
    bad_lse.lse = Array3::zeros((1, 2, 8));
    for (name, method) in METHODS {
        let msg = |r: Result<Grads, AttnError>| {
            let err = r.unwrap_err();
            assert!(
                matches!(err, AttnError::ShapeMismatch { .. }),
                "{name}: {err}"
            );
            err.to_string()
        };
        let m = msg(method(q.view(), k.view(), v.view(), &fwd, short.view()));
        assert!(
            m.contains("dout is [1, 2, 8, 8] but q, k and v are [1, 2, 9, 8]"),
            "{name}: {m}"
        );
        let m = msg(method(q.view(), k.view(), v.view(), &bad_out, dout.view()));
        assert!(
            m.contains("the forward's out is [1, 2, 8, 8]"),
            "{name}: {m}"
        );
        let m = msg(method(q.view(), k.view(), v.view(), &bad_lse, dout.view()));
        assert!(
            m.contains(
                "the forward's lse is [1, 2, 8] but must be [batch, heads, tokens] = [1, 2, 9]"
            ),
            "{name}: {m}"
        );
        let m = msg(method(q.view(), short.view(), v.view(), &fwd, dout.view()));
        assert!(m.contains("k is [1, 2, 8, 8]"), "{name}: {m}");
        let z = Array4::<f32>::zeros((1, 2, 9, 0));
        let zero = forward(z.view(), z.view(), z.view())
            .map(|_| ())
            .unwrap_err();
        assert_eq!(zero, AttnError::ZeroHeadDim);
        let fwd_z = step04_backward::Attention {
            out: z.clone(),
            lse: Array3::zeros((1, 2, 9)),
        };
        assert_eq!(
            method(z.view(), z.view(), z.view(), &fwd_z, z.view()).unwrap_err(),
            AttnError::ZeroHeadDim,
            "{name}"
        );
    }
}

#[test]
fn zero_block_sizes_are_an_error() {
    let shape = Shape::new(1, 1, 4, 4);
    let [q, k, v] = random_qkv(shape, 3);
    let fwd = forward(q.view(), k.view(), v.view()).unwrap();
    for blocks in [
        BlockSizes {
            queries: 0,
            keys: 4,
        },
        BlockSizes {
            queries: 4,
            keys: 0,
        },
    ] {
        let err =
            backward_with_blocks(q.view(), k.view(), v.view(), &fwd, q.view(), blocks)
                .unwrap_err()
                .to_string();
        assert!(err.contains("both must be at least 1"), "{err}");
    }
}

#[test]
fn empty_input_gives_empty_gradients() {
    for dims in [(1, 2, 0, 16), (0, 2, 5, 16), (1, 0, 5, 16)] {
        let x = Array4::<f32>::zeros(dims);
        let fwd = forward(x.view(), x.view(), x.view()).unwrap();
        for (name, method) in METHODS {
            let g = method(x.view(), x.view(), x.view(), &fwd, x.view()).unwrap();
            assert_eq!(
                (g.dq.dim(), g.dk.dim(), g.dv.dim()),
                (dims, dims, dims),
                "{name}"
            );
        }
    }
}
