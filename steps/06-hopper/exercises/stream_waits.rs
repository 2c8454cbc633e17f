//! Chapter 6.1's exercise: the waits of a stream through a ring of stages. Write
//! `stream_waits`, then check it:
//!
//! ```sh
//! cargo run -p step06-hopper --bin hopper-exercise -- stream-waits
//! ```
//!
//! `git checkout steps/06-hopper/exercises` brings the template back.

// the parameters are unused until the body is written
#![allow(unused_variables)]

use step06_hopper::exercise::Waits;

/// Block `n` (0, 1, 2, …) of the backward's stream of q and dO, in a ring of `stages`
/// buffers, each with a barrier `full` (the producer's copy has landed) and a barrier
/// `empty` (every consumer is done with it): the stage it goes through, the parity the
/// consumers wait for on `full[stage]` before they read it, and the parity the producer
/// waits for on `empty[stage]` before it copies into it (`None`: it does not wait). A wait
/// for parity `p` returns once the barrier's last completed phase has parity `p`; a new
/// barrier has completed none, and its phase 0 is under way.
pub fn stream_waits(n: usize, stages: usize) -> Waits {
    todo!(
        "the stage, then how many blocks went through it before, and the parities from that"
    )
}
