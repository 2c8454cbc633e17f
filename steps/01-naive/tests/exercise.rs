//! The exercise checker can tell right from wrong: it accepts the step's own `softmax_row`
//! (the solution), and refuses the template as shipped (a `todo!()`) and the two mistakes
//! the cases are there to catch. None of them reads `exercises/`, so these keep passing once
//! a reader has filled the template in.

use step01_naive::exercise::{self, check};

#[test]
fn the_checker_accepts_the_solution() {
    assert_eq!(
        check(step01_naive::softmax_row),
        Ok(exercise::cases().len())
    );
}

#[test]
fn the_checker_refuses_the_template() {
    let e = check(|_: &mut [f32]| -> f32 { todo!() }).unwrap_err();
    assert_eq!(e.case, "one key");
    assert!(e.why.contains("not yet implemented"), "{e}");
}

#[test]
fn the_checker_refuses_a_softmax_without_the_maximum() {
    let e = check(|row: &mut [f32]| {
        row.iter_mut().for_each(|x| *x = x.exp());
        let sum: f32 = row.iter().sum();
        row.iter_mut().for_each(|x| *x /= sum);
        sum.ln()
    })
    .unwrap_err();
    assert!(e.case.contains("overflows"), "{e}");
}

#[test]
fn the_checker_refuses_a_log_sum_exp_without_the_maximum() {
    let e = check(|row: &mut [f32]| {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        row.iter_mut().for_each(|x| *x = (*x - max).exp());
        let sum: f32 = row.iter().sum();
        row.iter_mut().for_each(|x| *x /= sum);
        sum.ln() // ln ℓ, where m + ln ℓ is the log-sum-exp
    })
    .unwrap_err();
    assert_eq!(e.case, "one key");
    assert!(e.why.starts_with("the log-sum-exp"), "{e}");
}
