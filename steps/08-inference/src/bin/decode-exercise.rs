//! Checks chapter 8's exercise on the CPU: compiles in the reader's `key_offset`
//! (`exercises/key_offset.rs`), asks it where every token of seeded page tables lives in the
//! pool, and says `right` or `not yet` (exit 1) with the token, the answer and the rule it
//! breaks.
//!
//! `cargo run -p step08-inference --bin decode-exercise -- key-offset`

use std::process::ExitCode;

use clap::Parser;
use flash_core::exercise::{quiet_panics, report};
use step08_inference::exercise;

#[path = "../../exercises/key_offset.rs"]
mod key_offset;

/// Checks an exercise of chapter 8 on the CPU, against the rules the decoding kernel relies
/// on and its own lookup.
#[derive(Parser, Debug)]
#[command(name = "decode-exercise")]
struct Args {
    /// Which exercise (`key-offset`: where a token of a paged cache lives in the pool, in
    /// exercises/key_offset.rs)
    #[arg(value_enum)]
    exercise: Exercise,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Exercise {
    /// A token's place in a paged cache's pool, through the page table
    KeyOffset,
}

fn main() -> ExitCode {
    let Exercise::KeyOffset = Args::parse().exercise;
    quiet_panics();
    let verdict = exercise::check(&key_offset::key_offset);
    report(exercise::TEMPLATE, exercise::SOLUTION, verdict)
}
