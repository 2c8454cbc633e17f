//! Checks chapter 8's exercises on the CPU. `key-offset`: compiles in the reader's
//! `key_offset` (`exercises/key_offset.rs`), asks it where every token of seeded page tables
//! lives in the pool, and says `right` or `not yet` (exit 1) with the token, the answer and
//! the rule it breaks. `prefill-by-steps`: compiles in the reader's `prefill_by_steps`
//! (`exercises/prefill_by_steps.rs`), reads seeded prompts with it and with `prefill`, and
//! says `right` or `not yet` with the prompt and what differs. `sum-groups`: compiles in the
//! reader's `sum_groups` (`exercises/sum_groups.rs`) and holds it to the sum in `f64`.
//!
//! `cargo run -p step08-inference --bin decode-exercise -- key-offset`
//! `cargo run -p step08-inference --bin decode-exercise -- prefill-by-steps`
//! `cargo run -p step08-inference --bin decode-exercise -- sum-groups`

use std::process::ExitCode;

use clap::Parser;
use flash_core::exercise::{quiet_panics, report};
use step08_inference::exercise;

#[path = "../../exercises/key_offset.rs"]
mod key_offset;
#[path = "../../exercises/prefill_by_steps.rs"]
mod prefill_by_steps;
#[path = "../../exercises/sum_groups.rs"]
mod sum_groups;

/// Checks an exercise of chapter 8 on the CPU: key-offset against the rules the decoding
/// kernel relies on and its own lookup; prefill-by-steps against prefill, within twice the
/// step's own difference; sum-groups against the sum in f64.
#[derive(Parser, Debug)]
#[command(name = "decode-exercise")]
struct Args {
    /// Which exercise (`key-offset`: where a token of a paged cache lives in the pool, in
    /// exercises/key_offset.rs; `prefill-by-steps`: a prompt read one token at a time, in
    /// exercises/prefill_by_steps.rs; `sum-groups`: each group's gradient summed into its kv
    /// head, in exercises/sum_groups.rs)
    #[arg(value_enum)]
    exercise: Exercise,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Exercise {
    /// A token's place in a paged cache's pool, through the page table
    KeyOffset,
    /// A prompt read into a new cache one token at a time
    PrefillBySteps,
    /// Each group's gradient summed into its kv head
    SumGroups,
}

fn main() -> ExitCode {
    quiet_panics();
    match Args::parse().exercise {
        Exercise::KeyOffset => {
            let verdict = exercise::check(&key_offset::key_offset);
            report(exercise::TEMPLATE, exercise::SOLUTION, verdict)
        }
        Exercise::PrefillBySteps => {
            let verdict = exercise::check_prefill(&prefill_by_steps::prefill_by_steps);
            report(
                exercise::PREFILL_TEMPLATE,
                exercise::PREFILL_SOLUTION,
                verdict,
            )
        }
        Exercise::SumGroups => {
            let verdict = exercise::check_sum_groups(&sum_groups::sum_groups);
            report(
                exercise::GROUPS_TEMPLATE,
                exercise::GROUPS_SOLUTION,
                verdict,
            )
        }
    }
}
