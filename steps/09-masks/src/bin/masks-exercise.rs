//! Checks chapter 9's exercises. `dilated`, on the CPU: compiles in the reader's `dilated`
//! (`exercises/dilated.rs`), asks it about every (query, key) pair of small windows and
//! dilations against the definition, runs the CPU forward with it as a mask against the
//! `f64` reference, and says `right` or `not yet` (exit 1) with the case and why.
//! `dilated-cuda`, on a Hopper GPU: the reader's `mask_mod` in `exercises/dilated.cu`,
//! compiled into the masked kernels, forward and backward against the `f64` reference.
//!
//! `cargo run -p step09-masks --bin masks-exercise -- dilated` (or `dilated-cuda`)

use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use flash_core::exercise::{quiet_panics, report};
use step03_cuda_forward::gpu::Gpu;
use step09_masks::exercise::{CUDA_SOLUTION, SOLUTION, check_dilated, check_dilated_cuda};

#[path = "../../exercises/dilated.rs"]
mod dilated;

/// Which exercise of chapter 9.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Exercise {
    /// A dilated sliding window as a mask, in exercises/dilated.rs, on the CPU
    Dilated,
    /// The same window as CUDA, in exercises/dilated.cu, in the Hopper kernels (needs a
    /// Hopper GPU)
    DilatedCuda,
}

/// Checks an exercise of chapter 9. dilated, on the CPU: the reader's mask against its
/// definition on every pair of positions, then the CPU forward with it within twice the
/// error of attention by hand against the f64 reference.
#[derive(Parser, Debug)]
#[command(name = "masks-exercise")]
struct Args {
    #[arg(value_enum)]
    exercise: Exercise,
}

fn main() -> ExitCode {
    let Args { exercise } = Args::parse();
    match exercise {
        Exercise::Dilated => {
            quiet_panics();
            let verdict = check_dilated(dilated::dilated);
            report("steps/09-masks/exercises/dilated.rs", SOLUTION, verdict)
        }
        Exercise::DilatedCuda => {
            let gpu = match Gpu::shared() {
                Ok(gpu) => gpu,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let verdict =
                check_dilated_cuda(gpu, include_str!("../../exercises/dilated.cu"));
            report(
                "steps/09-masks/exercises/dilated.cu",
                CUDA_SOLUTION,
                verdict,
            )
        }
    }
}
