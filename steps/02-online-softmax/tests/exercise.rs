//! The exercise checker can tell right from wrong: it accepts the step's own
//! `online_update` (the solution), and refuses the template as shipped (a `todo!()`) and an
//! update that forgets to rescale what the row has summed so far. None of them reads
//! `exercises/`, so these keep passing once a reader has filled the template in.

use ndarray::ArrayView2;
use step02_online_softmax::blocked::online_update;
use step02_online_softmax::exercise::{CASES, check};

#[test]
fn the_checker_accepts_the_solution() {
    assert_eq!(check(&online_update), Ok(CASES.len()));
}

#[test]
fn the_checker_refuses_the_template() {
    let e = check(&|_: &mut f32,
                    _: &mut f32,
                    _: &mut [f32],
                    _: &[f32],
                    _: ArrayView2<f32>| { todo!() })
    .unwrap_err();
    assert!(e.why.contains("not yet implemented"), "{e}");
}

#[test]
fn the_checker_refuses_an_update_without_the_correction() {
    let e = check(&|m: &mut f32,
                    l: &mut f32,
                    acc: &mut [f32],
                    scores: &[f32],
                    v: ArrayView2<f32>| {
        let m_new = scores.iter().fold(*m, |a, &s| a.max(s));
        for (&s, v) in scores.iter().zip(v.rows()) {
            let p = (s - m_new).exp();
            *l += p;
            acc.iter_mut().zip(v).for_each(|(a, &v)| *a += p * v);
        }
        *m = m_new;
    })
    .unwrap_err();
    // a row's first block needs no correction: the first to fail is a later one
    assert!(e.case.contains("row 1, after keys 1..2"), "{e}");
}
