//! What the command-line tools share: their flags (`--name value` pairs and bare switches,
//! nothing more), and the start of the GPU timing tools (`forward-tune` here, `backward-tune`
//! in step 04).

use std::process::ExitCode;

use flash_core::AttnError;
use flash_core::timing::{Warmup, median_ms as median_ms_of};

use crate::Gpu;

/// The arguments after the program's name.
pub struct Flags(Vec<String>);

impl Flags {
    pub fn from_env() -> Flags {
        Flags(std::env::args().skip(1).collect())
    }

    /// The value after `flag`, if the flag is given.
    pub fn value(&self, flag: &str) -> Option<String> {
        let i = self.0.iter().position(|a| a == flag)?;
        self.0.get(i + 1).cloned()
    }

    /// Whether the switch `flag` is given.
    pub fn has(&self, flag: &str) -> bool {
        self.0.iter().any(|a| a == flag)
    }
}

/// A timing tool, started: its flags, the lengths and run count they ask for, and the GPU.
pub struct Tool {
    pub flags: Flags,
    pub lengths: Vec<usize>,
    pub runs: usize,
    pub gpu: Gpu,
}

impl Tool {
    /// Reads `--lengths a,b,c` and `--runs N` (with these defaults), opens the GPU and prints
    /// what it is. On a malformed flag or without a GPU, prints why, after the tool's name, and
    /// gives the exit code to end with.
    pub fn start(name: &str, lengths: &str, runs: usize) -> Result<Tool, ExitCode> {
        let flags = Flags::from_env();
        let fail = |why: String| {
            eprintln!("{name}: {why}");
            ExitCode::FAILURE
        };
        let lengths = flags.value("--lengths").unwrap_or_else(|| lengths.into());
        let lengths = lengths
            .split(',')
            .map(|s| s.trim().parse::<usize>().ok().filter(|&t| t > 0))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                fail(format!(
                    "--lengths {lengths}: token counts of at least 1, separated by commas"
                ))
            })?;
        let runs = match flags.value("--runs") {
            None => runs,
            Some(s) => s
                .parse::<usize>()
                .ok()
                .filter(|&r| r > 0)
                .ok_or_else(|| fail(format!("--runs {s}: a number of at least 1")))?,
        };
        let gpu = Gpu::new().map_err(|e| fail(e.to_string()))?;
        println!("{}", gpu.describe());
        Ok(Tool {
            flags,
            lengths,
            runs,
            gpu,
        })
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
