//! Checks chapter 4's exercises. `grad-scores`, on the CPU: compiles in the reader's
//! `grad_scores` (`exercises/grad_scores.rs`), runs it on every block of seeded sequences,
//! and says `right` or `not yet` (exit 1) with the block, the entry, the two values and the
//! rule. `softmax-backward`, on the GPU: runs the backward by hand with the reader's row
//! kernels (`exercises/softmax_backward.cu` unless `--file` names another) in place of the
//! step's on seeded inputs, prints each case's errors beside the backward by hand's in the
//! same precision, and says `right` or `not yet` (exit 1). Without a GPU or NVRTC it says
//! so, and exits 2.
//!
//! `cargo run -p step04-backward --bin backward-exercise -- grad-scores`
//! `cargo run -p step04-backward --bin backward-exercise -- softmax-backward [--file PATH]`

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use flash_core::exercise::{quiet_panics, report};
use step03_cuda_forward::exercise::checker_main;
use step04_backward::exercise::{self, Exercise};

#[path = "../../exercises/grad_scores.rs"]
mod grad_scores;

/// Checks an exercise of chapter 4, by FlashAttention's rule. grad-scores, on the CPU: on
/// every block, dS within twice the error of the step's own against the f64 reference.
/// softmax-backward, on the GPU: on every case, the largest error of out, dq, dk and dv
/// against the f64 reference at most twice that of the backward by hand in the same
/// precision.
#[derive(Parser, Debug)]
#[command(name = "backward-exercise")]
struct Args {
    /// Which exercise (`grad-scores`: δ and dS for one block, in exercises/grad_scores.rs,
    /// on the CPU; `softmax-backward`: dS = P ∘ (dP − δ), in
    /// exercises/softmax_backward.cu, on a GPU)
    #[arg(value_enum)]
    exercise: Exercise,
    /// The kernel to check, for softmax-backward [default: the exercise's template, under
    /// the crate's folder]
    #[arg(long, value_name = "PATH")]
    file: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let exercise = args.exercise;
    if exercise == Exercise::GradScores {
        if let Some(file) = &args.file {
            eprintln!(
                "--file {}: grad-scores is Rust, compiled into this checker from {}; --file names a kernel for softmax-backward",
                file.display(),
                exercise.template()
            );
            return ExitCode::from(2);
        }
        quiet_panics();
        let verdict = exercise::check_grad_scores(&grad_scores::grad_scores);
        let template = "steps/04-backward/exercises/grad_scores.rs";
        return report(template, exercise::GRAD_SCORES_SOLUTION, verdict);
    }
    let path = args.file.unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(exercise.template())
    });
    let baseline = "the backward by hand";
    checker_main(&path, baseline, exercise.solution_file(), |gpu, kernel| {
        println!("max abs errors against f64 of out, dq, dk and dv: yours (by hand's)");
        let checks = exercise::check(gpu, exercise, kernel, |c| {
            let verdict = if c.verdict().is_ok() { "ok" } else { "over" };
            let errors: Vec<String> = c
                .arrays
                .iter()
                .map(|a| {
                    format!(
                        "{} {:.1e} ({:.1e})",
                        a.name, a.ours.max_abs, a.by_hand.max_abs
                    )
                })
                .collect();
            println!("{:<30} {}: {verdict}", c.what, errors.join(", "));
        })?;
        Ok(checks.iter().map(|c| c.verdict()).collect())
    })
}
