//! Checks chapter 1's exercise on the CPU: compiles in the reader's `softmax_row`
//! (`exercises/softmax_row.rs`), runs it on seeded rows of scores, and says `right` or
//! `not yet` (exit 1) with the case, the entry, the two values and the rule.
//!
//! `cargo run -p step01-naive --bin naive-exercise -- softmax-row`

use std::process::ExitCode;

use clap::Parser;
use flash_core::exercise::{quiet_panics, report};
use step01_naive::exercise;

#[path = "../../exercises/softmax_row.rs"]
mod softmax_row;

/// Checks an exercise of chapter 1 on the CPU against the f64 reference: within twice the
/// error of the step's own function on every case.
#[derive(Parser, Debug)]
#[command(name = "naive-exercise")]
struct Args {
    /// Which exercise (`softmax-row`: the softmax of one row, in exercises/softmax_row.rs)
    #[arg(value_enum)]
    exercise: Exercise,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Exercise {
    /// The softmax of one row of scores, and its log-sum-exp
    SoftmaxRow,
}

fn main() -> ExitCode {
    let Exercise::SoftmaxRow = Args::parse().exercise;
    quiet_panics();
    let verdict = exercise::check(softmax_row::softmax_row);
    report(exercise::TEMPLATE, exercise::SOLUTION, verdict)
}
