//! Chapter 6's exercise: which element of a wgmma accumulator a register holds. Write
//! `accumulator_element`, then check it:
//!
//! ```sh
//! cargo run -p step06-hopper --bin hopper-exercise -- accumulator
//! ```
//!
//! `git checkout steps/06-hopper/exercises` brings the template back.

// the parameters are unused until the body is written
#![allow(unused_variables)]

/// The element `(row, column)` of the 64 × `n` f32 accumulator of an m64nNk16 `wgmma` that
/// register `register` (0 to n/2 − 1) of thread `thread` (0 to 127) of the warpgroup holds.
pub fn accumulator_element(thread: usize, register: usize, n: usize) -> (usize, usize) {
    todo!("the warp and lane of the thread, then the row and column of register 4j + e")
}
