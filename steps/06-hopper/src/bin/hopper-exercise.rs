//! Checks chapters 6's and 6.1's exercises on the CPU. `accumulator`: compiles in the
//! reader's `accumulator_element` (`exercises/accumulator.rs`), asks it for every register
//! of every thread of a warpgroup, and says `right` or `not yet` (exit 1) with the thread,
//! the register and the rule it breaks. `stream-waits`: compiles in the reader's
//! `stream_waits` (`exercises/stream_waits.rs`), runs streams through rings of 2 to 4 stages
//! by its waits, and says `right` or `not yet` with the block and what would go wrong. No
//! GPU needed.
//!
//! `cargo run -p step06-hopper --bin hopper-exercise -- accumulator`
//! `cargo run -p step06-hopper --bin hopper-exercise -- stream-waits`

use std::process::ExitCode;

use clap::Parser;
use flash_core::exercise::{quiet_panics, report};
use step06_hopper::exercise;

#[path = "../../exercises/accumulator.rs"]
mod accumulator;
#[path = "../../exercises/stream_waits.rs"]
mod stream_waits;

/// Checks an exercise of chapter 6 or 6.1 on the CPU: every register of every thread, against
/// the rules the kernels rely on and the hardware's layout; or every block of a stream,
/// against what its waits would do and the kernels' own.
#[derive(Parser, Debug)]
#[command(name = "hopper-exercise")]
struct Args {
    /// Which exercise (`accumulator`: the element of a wgmma accumulator a register holds,
    /// in exercises/accumulator.rs; `stream-waits`: a stream's stages and barrier phases, in
    /// exercises/stream_waits.rs)
    #[arg(value_enum)]
    exercise: Exercise,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Exercise {
    /// The element of a wgmma accumulator each register of each thread holds
    Accumulator,
    /// The stage and the barriers' parities each block of a stream waits for
    StreamWaits,
}

fn main() -> ExitCode {
    quiet_panics();
    match Args::parse().exercise {
        Exercise::Accumulator => {
            let verdict = exercise::check(&accumulator::accumulator_element);
            let template = "steps/06-hopper/exercises/accumulator.rs";
            report(template, exercise::SOLUTION, verdict)
        }
        Exercise::StreamWaits => {
            let verdict = exercise::check_waits(&stream_waits::stream_waits);
            let template = "steps/06-hopper/exercises/stream_waits.rs";
            report(template, exercise::WAITS_SOLUTION, verdict)
        }
    }
}
