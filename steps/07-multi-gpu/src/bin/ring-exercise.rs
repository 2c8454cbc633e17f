//! Checks chapter 7's exercise on the CPU: compiles in the reader's `merge_row`
//! (`exercises/merge_row.rs`), merges the two partial results of every row of seeded
//! sequences with it, and says `right` or `not yet` (exit 1) with the row, the two values
//! and the rule.
//!
//! `cargo run -p step07-multi-gpu --bin ring-exercise -- merge-row`

use std::process::ExitCode;

use clap::Parser;
use flash_core::exercise::{quiet_panics, report};
use step07_multi_gpu::exercise;

#[path = "../../exercises/merge_row.rs"]
mod merge_row;

/// Checks an exercise of chapter 7 on the CPU against the f64 reference: within twice the
/// error of the step's own function on every case.
#[derive(Parser, Debug)]
#[command(name = "ring-exercise")]
struct Args {
    /// Which exercise (`merge-row`: two partial results of a row made one, in
    /// exercises/merge_row.rs)
    #[arg(value_enum)]
    exercise: Exercise,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Exercise {
    /// The merge of two partial results through their log-sum-exps
    MergeRow,
}

fn main() -> ExitCode {
    let Exercise::MergeRow = Args::parse().exercise;
    quiet_panics();
    let verdict = exercise::check(&merge_row::merge_row);
    report(exercise::TEMPLATE, exercise::SOLUTION, verdict)
}
