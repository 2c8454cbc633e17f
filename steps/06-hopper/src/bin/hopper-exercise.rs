//! Checks chapter 6's exercise on the CPU: compiles in the reader's `accumulator_element`
//! (`exercises/accumulator.rs`), asks it for every register of every thread of a
//! warpgroup, and says `right` or `not yet` (exit 1) with the thread, the register and the
//! rule it breaks. No GPU needed.
//!
//! `cargo run -p step06-hopper --bin hopper-exercise -- accumulator`

use std::process::ExitCode;

use clap::Parser;
use flash_core::exercise::{quiet_panics, report};
use step06_hopper::exercise;

#[path = "../../exercises/accumulator.rs"]
mod accumulator;

/// Checks an exercise of chapter 6 on the CPU: every register of every thread, against the
/// rules the kernels rely on and the hardware's layout.
#[derive(Parser, Debug)]
#[command(name = "hopper-exercise")]
struct Args {
    /// Which exercise (`accumulator`: the element of a wgmma accumulator a register holds,
    /// in exercises/accumulator.rs)
    #[arg(value_enum)]
    exercise: Exercise,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Exercise {
    /// The element of a wgmma accumulator each register of each thread holds
    Accumulator,
}

fn main() -> ExitCode {
    let Exercise::Accumulator = Args::parse().exercise;
    quiet_panics();
    let verdict = exercise::check(&accumulator::accumulator_element);
    let template = "steps/06-hopper/exercises/accumulator.rs";
    report(template, exercise::SOLUTION, verdict)
}
