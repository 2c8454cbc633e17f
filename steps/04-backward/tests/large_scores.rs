//! The blockwise backwards on inputs whose scores are large: queries or keys scaled by 10,
//! 30 and 100 (log-sum-exps up to about 400), queries or keys shifted by a constant, large
//! values. Each after the forward of step 01 and after that of step 02 (the `online`
//! method's), against the `f64` reference under FlashAttention's rule (`common`).
//!
//! The seeded normal inputs of `against_reference.rs` keep every score within a few units,
//! where a forward and a backward that round the scores differently still agree. Here they
//! do not: a step 02 that folds `log2 e/√d` into its queries, with a backward that folds
//! `log2 e` into its scale, puts dV's error at 10 times by hand's with the queries scaled
//! by 30, and dQ's at 33 times with the keys shifted by 20; this test fails on the first
//! case.

#[path = "common/cases.rs"]
mod cases;
mod common;

use flash_core::Shape;
use flash_core::inputs::{random_normal, random_qkv};
use step04_backward::{
    Attention, BackwardFn, BlockSizes, backward, backward_two_pass, backward_with_blocks,
    forward,
};

const ODD_BLOCKS: BlockSizes = BlockSizes {
    queries: 48,
    keys: 80,
};

const METHODS: [(&str, BackwardFn); 4] = [
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

type Forward = fn(
    ndarray::ArrayView4<f32>,
    ndarray::ArrayView4<f32>,
    ndarray::ArrayView4<f32>,
) -> Result<Attention, step04_backward::AttnError>;

const FORWARDS: [(&str, Forward); 2] = [
    ("step 01", forward),
    ("step 02", step02_online_softmax::attention),
];

#[test]
fn large_scores_meet_flash_attentions_rule() {
    // head dim 64 (a scale of 1/8, exact in binary) and 48 (not), partial blocks at both
    // lengths
    for (tokens, head_dim) in [(300, 64), (130, 48)] {
        let shape = Shape::new(1, 2, tokens, head_dim);
        let [q, k, v] = random_qkv(shape, 7);
        let dout = random_normal(shape, 8);
        let cases = cases::large_score_cases(&q, &k, &v);
        for (case, [q, k, v]) in &cases {
            let check = common::Check::new(q, k, v, &dout);
            for (fname, forward) in FORWARDS {
                let fwd = forward(q.view(), k.view(), v.view()).unwrap();
                let lse = fwd.lse.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                let floor = check.floor(&fwd.out);
                for (name, method) in METHODS {
                    let got =
                        method(q.view(), k.view(), v.view(), &fwd, dout.view()).unwrap();
                    let what =
                        format!("{name} after {fname}, {case}, {shape}, |lse| ≤ {lse:.0}");
                    match check.rule(&got, floor) {
                        Ok([dq, dk, dv]) => {
                            println!(
                                "{what}: error / baseline dq {dq:.2}, dk {dk:.2}, dv {dv:.2}"
                            )
                        }
                        Err(e) => panic!("{what}: {e}"),
                    }
                }
            }
        }
    }
}
