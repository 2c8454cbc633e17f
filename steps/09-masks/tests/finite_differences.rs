//! The `f64` reference backward against finite differences of the `f64` reference forward,
//! for every mask and score function, with grouped heads and fewer queries than keys.

mod common;

use common::{inputs, masks, score_mods};
use ndarray::Array4;
use step09_masks::reference::{attention_f64, backward_f64};
use step09_masks::{Mask, ScoreMod};

/// 2 sequences, 2 query heads on 1 kv head, 4 queries on 7 keys, head dim 3.
const SHAPE: (usize, usize, usize, usize, usize, usize) = (2, 2, 1, 4, 7, 3);

/// `L = Σ dO ∘ O`, in `f64`.
fn loss(
    q: &Array4<f64>,
    k: &Array4<f64>,
    v: &Array4<f64>,
    dout: &Array4<f64>,
    mask: &Mask,
    score: &ScoreMod,
) -> f64 {
    let r = attention_f64(q.view(), k.view(), v.view(), mask, score).unwrap();
    (&r.out * dout).sum()
}

#[test]
fn the_reference_backward_matches_finite_differences() {
    let x = inputs(SHAPE, 41);
    let wide = |a: &Array4<f32>| a.mapv(f64::from);
    let (q, k, v, dout) = (wide(&x.q), wide(&x.k), wide(&x.v), wide(&x.dout));
    // the tiny shape has 7 keys: windows and prefixes that cut into it
    let mut all = masks(SHAPE.4);
    all[2] = Mask::Sliding { window: 3 };
    all[3] = Mask::PrefixLm { prefix: 4 };
    let h = 1e-6;
    for mask in &all {
        for score in score_mods(SHAPE.1) {
            let g = backward_f64(q.view(), k.view(), v.view(), dout.view(), mask, &score)
                .unwrap();
            let mut worst = 0.0f64;
            for (which, grad) in [(0, &g.dq), (1, &g.dk), (2, &g.dv)] {
                for (at, &analytic) in grad.indexed_iter() {
                    let at = [at.0, at.1, at.2, at.3];
                    let nudged = |by: f64| {
                        let (mut q, mut k, mut v) = (q.clone(), k.clone(), v.clone());
                        [&mut q, &mut k, &mut v][which][at] += by;
                        loss(&q, &k, &v, &dout, mask, &score)
                    };
                    let numeric = (nudged(h) - nudged(-h)) / (2.0 * h);
                    let e = (numeric - analytic).abs();
                    assert!(
                        e < 1e-6 * (1.0 + analytic.abs()),
                        "mask {}, score {}: {}{at:?} is {analytic}, finite differences \
                         {numeric}",
                        mask.name(),
                        score.name(),
                        ["dq", "dk", "dv"][which]
                    );
                    worst = worst.max(e);
                }
            }
            println!(
                "mask {}, score {}: worst {worst:.1e}",
                mask.name(),
                score.name()
            );
        }
    }
}
