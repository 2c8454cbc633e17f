//! Chapter 1's exercise: the softmax of one row of scores. Write `softmax_row`, then check
//! it:
//!
//! ```sh
//! cargo run -p step01-naive --bin naive-exercise -- softmax-row
//! ```
//!
//! `git checkout steps/01-naive/exercises` brings the template back.

// the parameter is unused until the body is written
#![allow(unused_variables)]

/// Turns `row`, the scores one query gives its keys (a masked key's score is −∞), into
/// probabilities in place, `p_j = e^(s_j − m) / ℓ` with `m` the row's maximum and
/// `ℓ = Σ_j e^(s_j − m)`, and returns the row's log-sum-exp, `m + ln ℓ`.
pub fn softmax_row(row: &mut [f32]) -> f32 {
    todo!("the row's maximum, the exponentials, their sum, the division; return m + ln ℓ")
}
