//! Checks chapter 3's exercises. `banks`, on the CPU: compiles in the reader's `turns`
//! (`exercises/banks.rs`), asks it how many turns the banks take for each warp's loads of a
//! set of cases, and says `right` or `not yet` (exit 1) with the case and why. `swizzle`, on
//! the CPU: compiles in the reader's
//! `swizzled` (`exercises/swizzle.rs`), runs it on every chunk of a tile at every head dim,
//! and says `right` or `not yet` (exit 1) with the row, the chunk and the rule it breaks.
//! `rows`, on the GPU: compiles the reader's kernel (`exercises/rows.cu` unless `--file`
//! names another) as its rung is compiled, launches it as the rung is launched on seeded
//! inputs, prints each case's error beside attention by hand's, and says `right` or `not
//! yet` (exit 1). Without a GPU or NVRTC it says so, and exits 2.
//!
//! `cargo run -p step03-cuda-forward --bin exercise -- banks`
//! `cargo run -p step03-cuda-forward --bin exercise -- swizzle`
//! `cargo run -p step03-cuda-forward --bin exercise -- rows [--file PATH]`

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use flash_core::exercise::{quiet_panics, report};
use step03_cuda_forward::banks as banks_checker;
use step03_cuda_forward::exercise::{self, Exercise, checker_main};

#[path = "../../exercises/banks.rs"]
mod banks;
#[path = "../../exercises/swizzle.rs"]
mod swizzle;

/// Checks an exercise of chapter 3. banks, on the CPU: a warp's loads from shared memory
/// counted in turns of its banks, against the rule on every case. swizzle, on the CPU: every chunk of a tile at every head
/// dim, against the rules the swizzle exists for and the kernels' own. rows, on the GPU, by
/// FlashAttention's rule: on every case, your kernel's largest error against the f64
/// reference at most twice that of attention by hand in the same precision.
#[derive(Parser, Debug)]
#[command(name = "exercise")]
struct Args {
    /// Which exercise (`banks`: the turns of a warp's load, in exercises/banks.rs, on the
    /// CPU; `swizzle`: the swizzle of a tile, in exercises/swizzle.rs, on the CPU; `rows`: rung 1's key loop, in exercises/rows.cu, on a GPU)
    #[arg(value_enum)]
    exercise: Which,
    /// The kernel to check, for rows [default: the exercise's template, under the crate's
    /// folder]
    #[arg(long, value_name = "PATH")]
    file: Option<PathBuf>,
}

/// The exercises: the GPU ones are the library's [`Exercise`].
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Which {
    /// The turns shared memory's banks take for a warp's loads, in Rust on the CPU
    Banks,
    /// The swizzle of a tile in shared memory, in Rust on the CPU
    Swizzle,
    /// Rung 1's key loop: the online softmax's update for one key, on a GPU
    Rows,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let exercise = match args.exercise {
        Which::Rows => Exercise::Rows,
        Which::Banks => {
            if let Some(file) = &args.file {
                eprintln!(
                    "--file {}: banks is Rust, compiled into this checker from exercises/banks.rs; --file names a kernel for rows",
                    file.display()
                );
                return ExitCode::from(2);
            }
            quiet_panics();
            let verdict = banks_checker::check(&banks::turns);
            return report(banks_checker::TEMPLATE, banks_checker::SOLUTION, verdict);
        }
        Which::Swizzle => {
            if let Some(file) = &args.file {
                eprintln!(
                    "--file {}: swizzle is Rust, compiled into this checker from exercises/swizzle.rs; --file names a kernel for rows",
                    file.display()
                );
                return ExitCode::from(2);
            }
            quiet_panics();
            let verdict = exercise::check_swizzle(&swizzle::swizzled);
            let template = "steps/03-cuda-forward/exercises/swizzle.rs";
            return report(template, exercise::SWIZZLE_SOLUTION, verdict);
        }
    };
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
