//! Chapter 4's CPU exercise: δ and dS for one block. Write `grad_scores`, then check it:
//!
//! ```sh
//! cargo run -p step04-backward --bin backward-exercise -- grad-scores
//! ```
//!
//! `git checkout steps/04-backward/exercises` brings the template back.

// the parameters are unused until the body is written
#![allow(unused_variables)]

use ndarray::{ArrayView2, ArrayViewMut2};

/// The score gradients of one block of the blockwise backward: queries `i` (the rows of
/// `out`, `dout`, `p` and `ds`) against keys `j` (the columns of `p` and `ds`). `out` and
/// `dout` are the block's rows of the forward's output and of its gradient, `[rows, d]`;
/// `p` is the block of probabilities, 0 where a key comes after its query; `ds` holds the
/// block of dP = dO·Vᵀ on entry, and must hold dS_ij = P_ij·(dP_ij − δ_i) on return, where
/// δ_i = Σ_j P_ij·dP_ij runs over the whole row i, not only this block's keys.
pub fn grad_scores(
    out: ArrayView2<f32>,
    dout: ArrayView2<f32>,
    p: ArrayView2<f32>,
    ds: ArrayViewMut2<f32>,
) {
    todo!("δ for each row without the rest of the row's P and dP, then dS in place over dP")
}
