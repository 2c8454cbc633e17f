//! What the lab's timing tools (`forward-tune`, `backward-tune`) share: their start on the
//! GPU, their inputs, and the timing of a call.

use std::process::ExitCode;

use flash_core::AttnError;
use flash_core::timing::{Warmup, median_ms as median_ms_of};

use step03_cuda_forward::gpu::{DeviceTensor, Dtype, Gpu};

pub use step03_cuda_forward::tool::at_least_one;

/// A timing tool, started: the lengths and run count it was asked for, and the GPU.
pub struct Tool {
    pub lengths: Vec<usize>,
    pub runs: usize,
    pub gpu: Gpu,
}

impl Tool {
    /// Opens the GPU and prints what it is. Without a GPU, prints why, after the tool's
    /// name, and gives the exit code to end with. (A malformed flag never gets here: clap
    /// refuses it, with status 2, when the tool parses its flags.)
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
pub fn random_input(gpu: &Gpu, shape: flash_core::Shape, seed: u64) -> DeviceTensor {
    let x = flash_core::inputs::random_normal(shape, seed);
    gpu.upload(x.view(), Dtype::Bf16)
        .expect("room on the GPU for a tool's inputs")
}

/// The median milliseconds of `runs` calls of `f` after 3 untimed ones, each timed by
/// [`Gpu::time_ms`]; on an error, prints it after the tool's name and gives the exit code
/// to end with.
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
