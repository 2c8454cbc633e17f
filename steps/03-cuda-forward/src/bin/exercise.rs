//! Checks chapter 3's exercise on the GPU: compiles the reader's kernel
//! (`exercises/rows.cu` unless `--file` names another) as its rung is compiled, launches it
//! as the rung is launched on seeded inputs, prints each case's error beside attention by
//! hand's, and says `right` or `not yet` (exit 1). Without a GPU or NVRTC it says so, and
//! exits 2.
//!
//! `cargo run -p step03-cuda-forward --bin exercise -- rows [--file PATH]`

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use step03_cuda_forward::exercise::{self, Exercise, checker_main};

/// Checks an exercise of chapter 3 on the GPU, by FlashAttention's rule: on every case,
/// your kernel's largest error against the f64 reference at most twice that of attention by
/// hand in the same precision.
#[derive(Parser, Debug)]
#[command(name = "exercise")]
struct Args {
    /// Which exercise (`rows`: rung 1's key loop, in exercises/rows.cu)
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
    let baseline = "attention by hand";
    checker_main(&path, baseline, exercise.solution_file(), |gpu, kernel| {
        println!(
            "as rung {} ({}); max abs errors against f64, yours and by hand's",
            exercise.rung().number(),
            exercise.rung().name()
        );
        let checks = exercise::check(gpu, exercise, kernel, |c| {
            let verdict = if c.verdict().is_ok() { "ok" } else { "over" };
            println!(
                "{:<30} yours {:.3e}, by hand {:.3e}, lse {:.3e}: {verdict}",
                c.what, c.ours.max_abs, c.by_hand.max_abs, c.lse.max_abs
            );
        })?;
        Ok(checks.iter().map(|c| c.verdict()).collect())
    })
}
