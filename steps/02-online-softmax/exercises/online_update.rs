//! Chapter 2's exercise: the online update. Write `online_update`, then check it:
//!
//! ```sh
//! cargo run -p step02-online-softmax --bin online-exercise -- online-update
//! ```
//!
//! `git checkout steps/02-online-softmax/exercises` brings the template back.

// the parameters are unused until the body is written
#![allow(unused_variables)]

use ndarray::ArrayView2;

/// One block of keys into one query row's running values. `scores` are the row's scores
/// for the block's keys (−∞ for a key after the query), `v` the block's values, one key a
/// row. On entry `m` is the largest score the row has seen, `l` is ℓ = Σ e^(s − m) and
/// `acc` is Σ e^(s − m)·v, both over the keys before this block (on the first block: −∞,
/// 0 and zeros); on return the same three over the keys up to the end of this block.
pub fn online_update(
    m: &mut f32,
    l: &mut f32,
    acc: &mut [f32],
    scores: &[f32],
    v: ArrayView2<f32>,
) {
    todo!(
        "the new maximum, the correction e^(m_old − m_new), then each key's e^(s − m_new)"
    )
}
