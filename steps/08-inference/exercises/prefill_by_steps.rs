//! Chapter 8's exercise on the cache: a prompt read one token at a time. Write
//! `prefill_by_steps`, then check it:
//!
//! ```sh
//! cargo run -p step08-inference --bin decode-exercise -- prefill-by-steps
//! ```
//!
//! `git checkout steps/08-inference/exercises` brings the template back.

// the parameters and `step` are unused until the body is written
#![allow(unused_variables, unused_imports)]

use ndarray::Array1;
use step05_train::{Params, TrainError};
use step08_inference::generate::{ModelCache, step};

/// What `prefill` returns, a new cache holding `prompt` and the logits of the token after
/// it, made by calling `step` once per byte of the prompt. An empty prompt is an error.
pub fn prefill_by_steps(
    params: &Params<f32>,
    prompt: &[u8],
) -> Result<(ModelCache, Array1<f32>), TrainError> {
    todo!("a new cache, then step for every byte; the last step's logits")
}
