//! Checks chapter 5's exercise on the CPU: compiles in the reader's `layernorm_dx`
//! (`exercises/layernorm_backward.rs`), runs it on seeded rows of every width the cases
//! name, and says `right` or `not yet` (exit 1) with the row, the entry, the two values and
//! the rule.
//!
//! `cargo run -p step05-train --bin train-exercise -- layernorm-backward`

use std::process::ExitCode;

use clap::Parser;
use flash_core::exercise::{quiet_panics, report};
use step05_train::exercise;

#[path = "../../exercises/layernorm_backward.rs"]
mod layernorm_backward;

/// Checks an exercise of chapter 5 on the CPU against finite differences of the f64
/// forward: within twice the error of the step's own function on every row.
#[derive(Parser, Debug)]
#[command(name = "train-exercise")]
struct Args {
    /// Which exercise (`layernorm-backward`: dx of one row of LayerNorm, in
    /// exercises/layernorm_backward.rs)
    #[arg(value_enum)]
    exercise: Exercise,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Exercise {
    /// The gradient of one row of LayerNorm with respect to its input
    LayernormBackward,
}

fn main() -> ExitCode {
    let Exercise::LayernormBackward = Args::parse().exercise;
    quiet_panics();
    let verdict = exercise::check(&layernorm_backward::layernorm_dx);
    report(exercise::TEMPLATE, exercise::SOLUTION, verdict)
}
