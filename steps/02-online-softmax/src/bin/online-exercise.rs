//! Checks chapter 2's exercise on the CPU: compiles in the reader's `online_update`
//! (`exercises/online_update.rs`), walks seeded rows through it a block of keys at a time,
//! and says `right` or `not yet` (exit 1) with the row, the block, the two values and the
//! rule.
//!
//! `cargo run -p step02-online-softmax --bin online-exercise -- online-update`

use std::process::ExitCode;

use clap::Parser;
use flash_core::exercise::{quiet_panics, report};
use step02_online_softmax::exercise;

#[path = "../../exercises/online_update.rs"]
mod online_update;

/// Checks an exercise of chapter 2 on the CPU against the f64 reference: within twice the
/// error of the step's own function on every case.
#[derive(Parser, Debug)]
#[command(name = "online-exercise")]
struct Args {
    /// Which exercise (`online-update`: one block of keys into a row's running values, in
    /// exercises/online_update.rs)
    #[arg(value_enum)]
    exercise: Exercise,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Exercise {
    /// One block of keys into a row's running maximum, sum and output
    OnlineUpdate,
}

fn main() -> ExitCode {
    let Exercise::OnlineUpdate = Args::parse().exercise;
    quiet_panics();
    let verdict = exercise::check(&online_update::online_update);
    report(exercise::TEMPLATE, exercise::SOLUTION, verdict)
}
