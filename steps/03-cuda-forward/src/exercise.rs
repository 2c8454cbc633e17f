//! Chapter 3's exercises. On the CPU: the swizzle of the tiles in shared memory, written in
//! Rust by the reader in `exercises/swizzle.rs` and checked on every chunk of a tile at
//! every head dim by the rules it exists for and against the kernels' own
//! ([`check_swizzle`], [`swizzled`]). On the GPU: rung 1's key loop, written by the reader. `exercises/rows.cu` is
//! `kernels/ladder_1_rows.cu` with the online softmax's update (the running maximum, the
//! correction, the sum and the output) taken out; the `exercise` binary compiles the
//! reader's file with the `-D` options and launch of rung 1
//! ([`Gpu::ladder_attention_from`]) and holds it to FlashAttention's rule
//! ([`ForwardCheck`]) on seeded inputs whose lengths leave partial blocks, exactly as the
//! GPU tests hold rung 1 itself.

use std::path::Path;
use std::process::ExitCode;

use flash_core::exercise::{NotYet, attempt};
use flash_core::{AttnError, Shape};

use crate::Rung;
use crate::gpu::{Dtype, Gpu};
use crate::kernel::TENSOR_CORES_CUH;
use crate::rule::{ForwardCheck, KERNEL_LSE};

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

/// Where the CPU exercise's solution is.
pub const SWIZZLE_SOLUTION: &str = "swizzled in steps/03-cuda-forward/kernels/tensor_cores.cuh \
     (chapter 3, Exercises, under Solution)";

/// The head dims of the CPU exercise: every head dim the kernels are compiled for.
pub const SWIZZLE_HEAD_DIMS: [usize; 3] = [32, 64, 128];

/// Rows of a tile the CPU exercise checks: a block of the kernel's 128.
pub const SWIZZLE_ROWS: usize = 128;

/// `tensor_cores.cuh`'s `swizzled` in Rust: the offset, in elements, of 16-byte chunk
/// `chunk` of row `row` in a tile of `head_dim`-wide 16-bit rows, the chunk index XOR-ed
/// with the row's lowest bits within groups of up to 8 chunks (128 bytes, all 32 banks).
/// `tests/exercise.rs` holds it to the `.cuh`'s text.
pub fn swizzled(row: usize, chunk: usize, head_dim: usize) -> usize {
    let swizzle = (head_dim / 8).min(8);
    row * head_dim + ((chunk ^ (row & (swizzle - 1))) << 3)
}

/// Checks `swizzle` (the reader's `swizzled`) at every head dim, on every chunk of every
/// row of a tile, in the order a reader can fix them: each chunk stays in its own row, on a
/// chunk's boundary; no two chunks of a row share a place; at head dims 64 and 128 the 8
/// chunks one `ldmatrix` matrix reads (one chunk of 8 consecutive rows) fall in 8
/// different groups of 4 banks; and the offset is the kernel's own, which the other offsets
/// of the kernels (`b_offsets`) assume. The number of head dims, or the first rule broken.
pub fn check_swizzle(
    swizzle: &dyn Fn(usize, usize, usize) -> usize,
) -> Result<usize, NotYet> {
    // the rules first at every head dim, then the kernel's own offsets: a layout that breaks
    // a rule is told which, rather than only that it differs
    let mut tiles = Vec::new();
    for head_dim in SWIZZLE_HEAD_DIMS {
        let chunks = head_dim / 8;
        let case = format!("head dim {head_dim} ({chunks} chunks of 16 bytes a row)");
        let mut offsets = vec![vec![0usize; chunks]; SWIZZLE_ROWS];
        for (row, offsets) in offsets.iter_mut().enumerate() {
            for (chunk, offset) in offsets.iter_mut().enumerate() {
                let at = format!("{case}, row {row}, chunk {chunk}");
                *offset = attempt(&at, || swizzle(row, chunk, head_dim))?;
                let row_elements = row * head_dim..(row + 1) * head_dim;
                if !row_elements.contains(offset) {
                    return Err(NotYet::new(
                        at,
                        format!(
                            "offset {offset} lies outside the row, elements {} to {}",
                            row_elements.start,
                            row_elements.end - 1
                        ),
                    ));
                }
                if *offset % 8 != 0 {
                    return Err(NotYet::new(
                        at,
                        format!(
                            "offset {offset} is not a multiple of 8: a chunk's 8 values are \
                             one 16-byte load, which must be aligned"
                        ),
                    ));
                }
            }
            if let Some(chunk) = (0..chunks).find(|&c| offsets[..c].contains(&offsets[c])) {
                let first = offsets
                    .iter()
                    .position(|&o| o == offsets[chunk])
                    .unwrap_or(0);
                return Err(NotYet::new(
                    format!("{case}, row {row}"),
                    format!(
                        "chunks {first} and {chunk} both go to offset {}: a swizzle must \
                         permute the row's chunks",
                        offsets[chunk]
                    ),
                ));
            }
        }
        // 32 banks of 4 bytes: a chunk at byte b sits in banks 4g..4g+3, g = (b / 16) mod 8.
        // At head dim 32 a group of 8 rows is 512 bytes and the kernel's swizzle leaves
        // 2-way conflicts, which it accepts: only wider rows are held to none.
        if head_dim >= 64 {
            for row0 in (0..SWIZZLE_ROWS).step_by(8) {
                for chunk in 0..chunks {
                    let mut rows_in = vec![Vec::new(); 8];
                    for row in row0..row0 + 8 {
                        rows_in[(offsets[row][chunk] * 2 / 16) % 8].push(row);
                    }
                    if let Some(rows) = rows_in.iter().find(|rows| rows.len() > 1) {
                        let worst = rows_in.iter().map(Vec::len).max().unwrap_or(0);
                        return Err(NotYet::new(
                            format!("{case}, chunk {chunk} of rows {row0} to {}", row0 + 7),
                            format!(
                                "rows {rows:?} put it in the same 4 banks, so the ldmatrix \
                                 that reads these 8 chunks takes {worst} turns, not 1"
                            ),
                        ));
                    }
                }
            }
        }
        tiles.push((head_dim, case, offsets));
    }
    for (head_dim, case, offsets) in tiles {
        for (row, offsets) in offsets.iter().enumerate() {
            for (chunk, &offset) in offsets.iter().enumerate() {
                let kernel = swizzled(row, chunk, head_dim);
                if offset != kernel {
                    return Err(NotYet::new(
                        format!("{case}, row {row}, chunk {chunk}"),
                        format!(
                            "offset {offset}, the kernel's {kernel}: your layout keeps the \
                             rules, but the kernels' other offsets (b_offsets) assume the \
                             chunk XOR (row mod {})",
                            (head_dim / 8).min(8)
                        ),
                    ));
                }
            }
        }
    }
    Ok(SWIZZLE_HEAD_DIMS.len())
}
