//! What the command-line tools share: parsers for their flags' values (the flags themselves are
//! each tool's clap `Parser`), and the start of the GPU timing tools (the lab's `forward-tune`,
//! `backward-tune` in step 04).

use std::process::ExitCode;

use flash_core::AttnError;
use flash_core::timing::{Warmup, median_ms as median_ms_of};

use crate::Gpu;

/// A count of at least 1 (`--runs`, and each of `--lengths`): clap's `value_parser`.
pub fn at_least_one(s: &str) -> Result<usize, String> {
    s.trim()
        .parse::<usize>()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("{s:?} is not a whole number of at least 1"))
}

/// A timing tool, started: the lengths and run count it was asked for, and the GPU.
pub struct Tool {
    pub lengths: Vec<usize>,
    pub runs: usize,
    pub gpu: Gpu,
}

impl Tool {
    /// Opens the GPU and prints what it is. Without a GPU, prints why, after the tool's name,
    /// and gives the exit code to end with. (A malformed flag never gets here: clap refuses
    /// it, with status 2, when the tool parses its flags.)
    pub fn start(name: &str, lengths: Vec<usize>, runs: usize) -> Result<Tool, ExitCode> {
        let gpu = Gpu::new().map_err(|e| {
            eprintln!("{name}: {e}");
            ExitCode::FAILURE
        })?;
        println!("{}", gpu.describe());
        Ok(Tool { lengths, runs, gpu })
    }
}

/// A `bf16` tensor of `shape` on the GPU, normal random values from `seed`.
pub fn random_input(gpu: &Gpu, shape: flash_core::Shape, seed: u64) -> crate::DeviceTensor {
    let x = flash_core::inputs::random_normal(shape, seed);
    gpu.upload(x.view(), crate::Dtype::Bf16)
        .expect("room on the GPU for a tool's inputs")
}

/// The median milliseconds of `runs` calls of `f` after 3 untimed ones, each timed by
/// [`Gpu::time_ms`]; on an error, prints it after the tool's name and gives the exit code to
/// end with.
pub fn median_ms<T>(
    gpu: &Gpu,
    runs: usize,
    mut f: impl FnMut() -> Result<T, AttnError>,
) -> Result<f64, ExitCode> {
    median_ms_of(Warmup::Calls(3), runs, || gpu.time_ms(&mut f)).map_err(|e| {
        eprintln!("error: {e}");
        ExitCode::FAILURE
    })
}
