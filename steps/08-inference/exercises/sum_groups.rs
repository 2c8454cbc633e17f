//! Chapter 8.2's exercise: each group's gradient summed into its kv head. Write
//! `sum_groups`, then check it:
//!
//! ```sh
//! cargo run -p step08-inference --bin decode-exercise -- sum-groups
//! ```
//!
//! `git checkout steps/08-inference/exercises` brings the template back.

// the parameters are unused until the body is written
#![allow(unused_variables)]

use ndarray::{Array4, ArrayView4};

/// The gradient of the shared keys (or values) of grouped-query attention, from the one the
/// backward computes for each query head: `dk` is `[batch, heads, tokens, head_dim]`, one
/// for each query head, and each kv head's gradient is the sum of those of the query heads
/// that read it; the result is `[batch, kv_heads, tokens, head_dim]`. `kv_heads` divides
/// `heads`.
pub fn sum_groups(dk: ArrayView4<f32>, kv_heads: usize) -> Array4<f32> {
    todo!("which kv head each query head reads, then each kv head's sum")
}
