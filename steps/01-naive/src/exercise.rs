//! Chapter 1's exercise, on the CPU: the softmax of one row of scores, written by the reader
//! in `exercises/softmax_row.rs` and held on seeded rows to the `f64` reference by
//! FlashAttention's rule, against the error of [`crate::softmax_row`], the function the
//! template was cut from. The `naive-exercise` binary runs it on the reader's file.

use flash_core::exercise::{NotYet, attempt, max_error, twice, within, zero_where};
use flash_core::inputs::SplitMix64;

/// The template the reader fills in, under the crate's folder.
pub const TEMPLATE: &str = "steps/01-naive/exercises/softmax_row.rs";

/// Where the solution is.
pub const SOLUTION: &str =
    "softmax_row in steps/01-naive/src/lib.rs (chapter 1, Exercises, under Solution)";

/// The cases, a name and a row of scores each: one key; a row of the causal table with the
/// keys after its query masked; the same row's scores times 100, whose exponentials
/// overflow `f32` unless the maximum is subtracted first; equal scores of −1000, whose
/// exponentials underflow to 0 unless it is; a long row.
pub fn cases() -> Vec<(&'static str, Vec<f32>)> {
    let mut rng = SplitMix64::new(101);
    let mut normal =
        |n: usize| -> Vec<f32> { (0..n).map(|_| rng.next_normal() as f32).collect() };
    let mut row_57 = normal(58);
    row_57.resize(100, f32::NEG_INFINITY);
    let times_100 = row_57.iter().map(|s| s * 100.0).collect();
    vec![
        ("one key", vec![0.3]),
        ("row 57 of 100 (58 keys seen, 42 masked)", row_57),
        (
            "row 57 of 100 times 100 (e^s overflows f32 past s = 88.7)",
            times_100,
        ),
        (
            "five scores of -1000 (e^s underflows to 0)",
            vec![-1000.0; 5],
        ),
        ("1,000 keys", normal(1000)),
    ]
}

/// The probabilities of a row of scores and its log-sum-exp, in `f64`.
fn reference(scores: &[f32]) -> (Vec<f64>, f64) {
    let max = scores
        .iter()
        .map(|&s| f64::from(s))
        .fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = scores.iter().map(|&s| (f64::from(s) - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    (e.iter().map(|x| x / sum).collect(), max + sum.ln())
}

/// Checks `softmax_row` (the reader's) on every case: the probabilities it leaves in the
/// row and the log-sum-exp it returns, each within twice the error of the step's own
/// [`crate::softmax_row`] against the `f64` reference (or of one rounding, if the step's
/// is smaller), masked keys exactly 0. The number of cases, or the first that fails and why.
pub fn check(softmax_row: impl Fn(&mut [f32]) -> f32) -> Result<usize, NotYet> {
    let cases = cases();
    let rule = "twice the error of the step's softmax_row";
    for (case, scores) in &cases {
        let (p, lse) = reference(scores);
        let mut ours = scores.clone();
        let our_lse = crate::softmax_row(&mut ours);
        let mut yours = scores.clone();
        let your_lse = attempt(case, || softmax_row(&mut yours))?;
        let allowed = twice(max_error(&ours, &p), 1.0);
        within(case, "p", &yours, &p, allowed, rule)?;
        let masked = |j: usize| scores[j] == f32::NEG_INFINITY;
        zero_where(case, "p", &yours, masked, "a masked key's probability")?;
        let allowed = twice(max_error(&[our_lse], &[lse]), lse);
        within(case, "the log-sum-exp", &[your_lse], &[lse], allowed, rule)?;
    }
    Ok(cases.len())
}
