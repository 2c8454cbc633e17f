//! Chapter 7's exercise: the merge of two partial results. Write `merge_row`, then check
//! it:
//!
//! ```sh
//! cargo run -p step07-multi-gpu --bin ring-exercise -- merge-row
//! ```
//!
//! `git checkout steps/07-multi-gpu/exercises` brings the template back.

// the parameters are unused until the body is written
#![allow(unused_variables)]

use ndarray::{ArrayView1, ArrayViewMut1};

/// Merges a row's partial result over keys B, `(o_b, lse_b)`, into its partial result over
/// keys A, `(o_a, lse_a)`, A and B disjoint: afterwards `(o_a, lse_a)` is the row's output
/// and log-sum-exp over A ∪ B. A part that saw no key is `(0, −∞)`.
pub fn merge_row(
    o_a: ArrayViewMut1<f32>,
    lse_a: &mut f32,
    o_b: ArrayView1<f32>,
    lse_b: f32,
) {
    todo!("the log-sum-exp of the union, each part's share of it, the weighted sum")
}
