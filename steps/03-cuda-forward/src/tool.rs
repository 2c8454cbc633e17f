//! What the command-line tools share: their flags (`--name value` pairs and bare switches,
//! nothing more), and the start of the GPU timing tools (`forward-tune` here, `backward-tune`
//! in step 04).

use std::process::ExitCode;

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
pub fn random_input(gpu: &Gpu, shape: step01_naive::Shape, seed: u64) -> crate::DeviceTensor {
    let x = step01_naive::inputs::random_normal(shape, seed);
    gpu.upload(x.view(), crate::Dtype::Bf16)
        .expect("room on the GPU for a tool's inputs")
}

/// The median milliseconds of `runs` calls of `f` after 3 untimed ones, each timed between two
/// CUDA events on the GPU's stream, with a 0.5 ms spin kernel before it so that the host's
/// launch time is not counted. What a call returns is dropped after its end is recorded.
pub fn median_ms<T>(gpu: &Gpu, runs: usize, mut f: impl FnMut() -> T) -> f64 {
    use cudarc::driver::sys::CUevent_flags;
    let event = || {
        gpu.context()
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .expect("a CUDA event")
    };
    let mut times = Vec::new();
    for i in 0..runs + 3 {
        let (start, end) = (event(), event());
        gpu.spin(500).expect("the spin kernel");
        start.record(gpu.stream()).expect("recording an event");
        let out = f();
        end.record(gpu.stream()).expect("recording an event");
        end.synchronize().expect("the timed call");
        drop(out);
        if i >= 3 {
            times.push(start.elapsed_ms(&end).expect("an elapsed time") as f64);
        }
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}
