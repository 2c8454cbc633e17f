//! Chapter 9's exercise checker: right for the solution, not yet for the template and for
//! near misses, each with the case that shows it.

use step09_masks::dilated::dilated;
use step09_masks::exercise::check_dilated;

#[path = "../exercises/dilated.rs"]
mod template;

#[test]
fn the_solution_is_right() {
    assert_eq!(check_dilated(dilated), Ok(23));
}

#[test]
fn the_template_is_not_yet_and_says_why() {
    let e = check_dilated(template::dilated).unwrap_err();
    assert!(
        e.why.contains("your function panicked") && e.why.contains("not yet implemented"),
        "{e}"
    );
}

#[test]
fn near_misses_are_not_yet_with_the_pair_that_shows_it() {
    // not causal
    let e = check_dilated(|q, k, w, d| q.abs_diff(k) < w * d && q.abs_diff(k) % d == 0)
        .unwrap_err();
    assert!(
        e.why.contains("is true, where the definition gives false"),
        "{e}"
    );
    // one key too many: ≤ where < is meant
    let e = check_dilated(|q, k, w, d| k <= q && q - k <= w * d && (q - k) % d == 0)
        .unwrap_err();
    assert!(e.why.contains("where the definition gives false"), "{e}");
    // a plain window, not dilated
    let e = check_dilated(|q, k, w, d| k <= q && q - k < w * d).unwrap_err();
    assert!(e.case.contains("dilation 2"), "{e}");
    // right on the positions the first cases ask about, wrong beyond them: the forward's
    // output shows it
    let e = check_dilated(|q, k, w, d| if q < 40 { dilated(q, k, w, d) } else { k <= q })
        .unwrap_err();
    assert!(e.case.contains("the CPU forward with your mask"), "{e}");
    assert!(e.why.contains("out (flattened) at ["), "{e}");
}
