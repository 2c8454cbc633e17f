//! The exercise checker can tell right from wrong: it accepts the step's own `merge_row`
//! (the solution), and refuses the template as shipped (a `todo!()`), a merge that weighs
//! by `e^lse` itself, and one without the guard for two parts that saw no key. None of them
//! reads `exercises/`, so these keep passing once a reader has filled the template in.

use ndarray::{ArrayView1, ArrayViewMut1};
use step07_multi_gpu::exercise::{cases, check};
use step07_multi_gpu::merge::{logaddexp, merge_row};

#[test]
fn the_checker_accepts_the_solution() {
    assert_eq!(check(&merge_row), Ok(cases().len()));
}

#[test]
fn the_checker_refuses_the_template() {
    let e =
        check(&|_: ArrayViewMut1<f32>, _: &mut f32, _: ArrayView1<f32>, _: f32| todo!())
            .unwrap_err();
    assert!(e.why.contains("not yet implemented"), "{e}");
}

#[test]
fn the_checker_refuses_a_merge_that_overflows() {
    // right in exact arithmetic, but e^lse overflows f32 past lse = 88.7
    let e = check(&|mut o_a: ArrayViewMut1<f32>,
                    lse_a: &mut f32,
                    o_b: ArrayView1<f32>,
                    lse_b: f32| {
        let (e_a, e_b) = (lse_a.exp(), lse_b.exp());
        if e_a + e_b == 0.0 {
            return;
        }
        o_a.zip_mut_with(&o_b, |a, &b| *a = (e_a * *a + e_b * b) / (e_a + e_b));
        *lse_a = (e_a + e_b).ln();
    })
    .unwrap_err();
    assert!(e.case.contains("times 40"), "{e}");
}

#[test]
fn the_checker_refuses_a_merge_without_the_guard_for_two_empty_parts() {
    let e = check(&|mut o_a: ArrayViewMut1<f32>,
                    lse_a: &mut f32,
                    o_b: ArrayView1<f32>,
                    lse_b: f32| {
        let lse = logaddexp(*lse_a, lse_b);
        let (w_a, w_b) = ((*lse_a - lse).exp(), (lse_b - lse).exp());
        o_a.zip_mut_with(&o_b, |a, &b| *a = w_a * *a + w_b * b);
        *lse_a = lse;
    })
    .unwrap_err();
    assert!(e.case.contains("mod 3") && e.case.ends_with("row 0"), "{e}");
}
