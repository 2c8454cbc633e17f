//! Checks chapter 4's exercise on the GPU: runs the backward by hand with the reader's row
//! kernels (`exercises/softmax_backward.cu` unless `--file` names another) in place of the
//! step's on seeded inputs, prints each case's errors beside the backward by hand's in the
//! same precision, and says `right` or `not yet` (exit 1). Without a GPU or NVRTC it says
//! so, and exits 2.
//!
//! `cargo run -p step04-backward --bin backward-exercise -- softmax-backward [--file PATH]`

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use step03_cuda_forward::exercise::checker_main;
use step04_backward::exercise::{self, Exercise};

/// Checks an exercise of chapter 4 on the GPU, by FlashAttention's rule: on every case, the
/// largest error of out, dq, dk and dv against the f64 reference at most twice that of the
/// backward by hand in the same precision.
#[derive(Parser, Debug)]
#[command(name = "backward-exercise")]
struct Args {
    /// Which exercise (`softmax-backward`: dS = P ∘ (dP − δ), in
    /// exercises/softmax_backward.cu)
    #[arg(value_enum)]
    exercise: Exercise,
    /// The kernel to check [default: the exercise's template, under the crate's folder]
    #[arg(long, value_name = "PATH")]
    file: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let exercise = args.exercise;
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
