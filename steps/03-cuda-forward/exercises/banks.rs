//! Chapter 3's first CPU exercise: a warp's load from shared memory, counted in turns of the
//! banks. Write `turns`, then check it:
//!
//! ```sh
//! cargo run -p step03-cuda-forward --bin exercise -- banks
//! ```
//!
//! `git checkout steps/03-cuda-forward/exercises` brings the template back.

// the parameters are unused until the body is written
#![allow(unused_variables)]

/// How many turns shared memory takes to serve one 4-byte load by each of a warp's 32
/// threads, thread `i` reading the word at byte address `addresses[i]` (a multiple of 4).
/// Shared memory has 32 banks of 4 bytes, the word at byte `a` in bank `(a / 4) % 32`, and
/// each bank serves one word a turn to every thread that asked for it.
pub fn turns(addresses: &[u32; 32]) -> u32 {
    todo!("for each bank, the different words asked of it; the busiest bank sets the turns")
}
