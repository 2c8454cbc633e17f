//! Chapter 5's exercise: the backward of LayerNorm for one row. Write `layernorm_dx`, then
//! check it:
//!
//! ```sh
//! cargo run -p step05-train --bin train-exercise -- layernorm-backward
//! ```
//!
//! `git checkout steps/05-train/exercises` brings the template back.

// the parameters are unused until the body is written
#![allow(unused_variables)]

/// The gradient of a loss with respect to one row `x` of a LayerNorm's input, given the
/// row's weights `w` and the loss's gradient `dy` with respect to the row's output
/// `y_j = (x_j − μ) / σ · w_j + b_j`, where `μ` is the mean of `x`, `σ = √(var + eps)` and
/// `var` is the mean of `(x_j − μ)²` (divided by the row's length, as in GPT-2). `b` does
/// not change `dx`. All three slices have the row's length; so does the answer.
pub fn layernorm_dx(x: &[f64], w: &[f64], dy: &[f64], eps: f64) -> Vec<f64> {
    todo!(
        "x̂ and 1/σ from the row, g = dy ∘ w, then dx from g, its mean and the mean of g ∘ x̂"
    )
}
