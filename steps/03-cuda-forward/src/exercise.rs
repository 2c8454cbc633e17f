//! Chapter 3's exercise: rung 1's key loop, written by the reader. `exercises/rows.cu` is
//! `kernels/ladder_1_rows.cu` with the online softmax's update (the running maximum, the
//! correction, the sum and the output) taken out; the `exercise` binary compiles the
//! reader's file with the `-D` options and launch of rung 1
//! ([`Gpu::ladder_attention_from`]) and holds it to FlashAttention's rule
//! ([`ForwardCheck`]) on seeded inputs whose lengths leave partial blocks, exactly as the
//! GPU tests hold rung 1 itself.

use std::path::Path;
use std::process::ExitCode;

use flash_core::{AttnError, Shape};

use crate::kernel::TENSOR_CORES_CUH;
use crate::rule::{ForwardCheck, KERNEL_LSE};
use crate::{Dtype, Gpu, Rung};

/// The exercises of this step, by the name the `exercise` binary takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Exercise {
    /// Rung 1's key loop: the online softmax's update for one key.
    Rows,
}

impl Exercise {
    /// The rung whose kernel the reader writes again.
    pub fn rung(self) -> Rung {
        match self {
            Exercise::Rows => Rung::Rows,
        }
    }

    /// The template the reader fills in, under the crate's folder.
    pub fn template(self) -> &'static str {
        match self {
            Exercise::Rows => "exercises/rows.cu",
        }
    }

    /// The solution's file, under the crate's folder: the rung's own kernel.
    pub fn solution_file(self) -> &'static str {
        self.rung().file()
    }

    /// The solution's text (the rung's own kernel file).
    pub fn solution(self) -> &'static str {
        self.rung().kernel_file()
    }
}

/// Sequences, heads, tokens and head dim of each case: one token, lengths that leave
/// partial blocks of 128 rows, a whole block, odd numbers of sequences and heads, and head
/// dim 32.
pub const CASES: [(usize, usize, usize, usize); 5] = [
    (1, 1, 1, 64),
    (3, 5, 77, 64),
    (2, 3, 128, 64),
    (3, 1, 300, 64),
    (2, 3, 190, 32),
];

/// Runs `kernel` (the text of a reader's file, without `tensor_cores.cuh`, which is put in
/// front as for the rung's own) on every case in bf16 and f16, and measures each run;
/// `each` sees every check as it is made. An error where the kernel does not compile or its
/// launch fails.
pub fn check(
    gpu: &Gpu,
    exercise: Exercise,
    kernel: &str,
    mut each: impl FnMut(&ForwardCheck),
) -> Result<Vec<ForwardCheck>, AttnError> {
    let rung = exercise.rung();
    let source = [TENSOR_CORES_CUH, kernel].concat();
    let mut checks = Vec::new();
    for dtype in [Dtype::Bf16, Dtype::F16] {
        for (seed, (batch, heads, tokens, head_dim)) in CASES.into_iter().enumerate() {
            let shape = Shape::new(batch, heads, tokens, head_dim);
            let check = ForwardCheck::run(
                gpu,
                shape,
                dtype,
                3000 + seed as u64,
                "yours",
                |gpu: &Gpu, q, k, v, dtype| {
                    gpu.ladder_attention_from(rung, &source, q, k, v, dtype)
                },
                KERNEL_LSE,
            )?;
            each(&check);
            checks.push(check);
        }
    }
    Ok(checks)
}

/// What an exercise checker does once it knows which file to check (the `exercise` binaries
/// of steps 03 and 04): reads `path`, opens the GPU, runs `check` on the file's text (which
/// prints a line for each case and returns each case's verdict), and says `right` or `not
/// yet` (exit 1); `baseline` names what the rule doubles, `solution` where the solution is.
/// Without the file, a GPU or NVRTC it says so, and exits 2.
pub fn checker_main(
    path: &Path,
    baseline: &str,
    solution: &str,
    check: impl FnOnce(&Gpu, &str) -> Result<Vec<Result<(), String>>, AttnError>,
) -> ExitCode {
    let kernel = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) => {
            eprintln!("cannot read {}: {e}", path.display());
            return ExitCode::from(2);
        }
    };
    let gpu = match Gpu::new() {
        Ok(gpu) => gpu,
        Err(e) => {
            eprintln!("{e}");
            eprintln!(
                "this checker runs your kernel, so it needs a CUDA GPU (compute capability 8.0 or newer), its driver and NVRTC"
            );
            return ExitCode::from(2);
        }
    };
    println!("checking {} on {}", path.display(), gpu.describe());
    let verdicts = match check(&gpu, &kernel) {
        Ok(verdicts) => verdicts,
        Err(e) => {
            println!("{e}");
            println!("not yet: the kernel did not run");
            return ExitCode::FAILURE;
        }
    };
    let failed: Vec<&String> = verdicts.iter().filter_map(|v| v.as_ref().err()).collect();
    if failed.is_empty() {
        println!(
            "right: every case within twice {baseline}'s error (the solution is {solution})"
        );
        return ExitCode::SUCCESS;
    }
    for e in &failed {
        println!("{e}");
    }
    println!(
        "not yet: {} of {} cases over twice {baseline}'s error",
        failed.len(),
        verdicts.len()
    );
    ExitCode::FAILURE
}
