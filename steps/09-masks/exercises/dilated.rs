//! Chapter 9's CPU exercise: a dilated sliding window. Write `dilated`, then check it:
//!
//! ```sh
//! cargo run -p step09-masks --bin masks-exercise -- dilated
//! ```
//!
//! `git checkout steps/09-masks/exercises` brings the template back.

// the parameters are unused until the body is written
#![allow(unused_variables)]

/// Whether query position `q` sees key `k` (both absolute positions) in a sliding window of
/// `window` keys taken every `dilation`-th key, counting back from the query itself: the
/// key is not after the query, it is less than `window · dilation` positions back, and the
/// distance `q − k` is a multiple of `dilation`. `window` and `dilation` are at least 1.
pub fn dilated(q: usize, k: usize, window: usize, dilation: usize) -> bool {
    todo!("causal, within window · dilation positions, and every dilation-th key")
}
