//! `generate`: text from step 05's model with the key/value cache ([`generate`]), or
//! without it (`--no-cache`: step 05's [`sample`], the whole forward again for every new
//! byte), and the tokens a second of each, on the CPU or (`--device cuda`) on the GPU
//! ([`generate_gpu`], [`sample_gpu`]); `--out` adds one row to a JSON file of
//! `charts/data/`.
//!
//! ```sh
//! cargo run --release -p step08-inference --bin generate -- \
//!     --checkpoint gpt.safetensors --prompt "fn " --count 100
//! cargo run --release -p step08-inference --bin generate -- --model small \
//!     --prompt-len 32 --count 64 --runs 5 --out charts/data/generate-cpu.json
//! ```

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use std::cell::RefCell;

use clap::{Parser, ValueEnum};
use flash_core::timing::median;
use serde::{Deserialize, Serialize};
use step05_train::cuda::{AttentionKind, GpuTrainer};
use step05_train::flag;
use step05_train::model::{Config, Params, Preset};
use step05_train::train::Trainer;
use step05_train::{Checkpoint, TrainError, sample};
use step08_inference::cpu_description;
use step08_inference::generate::{generate, prefill, step};
use step08_inference::gpu_generate::{GpuModel, generate_gpu, sample_gpu};

/// The seed of `--model`'s random weights: `train`'s default seed, so they are the weights
/// `train --model ...` starts from.
const INIT_SEED: u64 = 1337;

/// Text from step 05's model, generated with a key/value cache (or without one, as step
/// 05's `sample`), and how many tokens a second each writes.
///
/// With a cache the prompt is read once and each new byte costs one token's work; without,
/// each new byte runs the whole forward over every byte before it. On the CPU, one thread
/// pool (rayon's) for both; on the GPU, the model in bf16 as step 05's GPU trainer runs
/// it, with a paged cache and the decoding kernel (or, without the cache, the trainer's
/// forward over the whole window for every new byte).
#[derive(Parser, Debug)]
#[command(name = "generate")]
struct Cli {
    /// Where the model runs
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    /// A model of this shape with random weights (those `train` starts from, seed 1337):
    /// its text is noise, its speed is the trained model's [default: small]
    #[arg(long, value_enum, conflicts_with = "checkpoint")]
    model: Option<Preset>,
    /// For --model's random weights: heads of keys and values, each shared by a group of
    /// query heads (grouped-query attention), a divisor of the model's heads [default: the
    /// model's heads]
    #[arg(long, conflicts_with = "checkpoint")]
    kv_heads: Option<usize>,
    /// A checkpoint written by step 05's `train --save`
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// The text to go on from
    #[arg(long, default_value = "\n")]
    prompt: String,
    /// Repeat the prompt (or cut it) to this many bytes
    #[arg(long)]
    prompt_len: Option<usize>,
    /// Bytes to generate; with the cache, the prompt and these must fit in the model's
    /// context together
    #[arg(long, default_value_t = 64)]
    count: usize,
    /// Below 1 sharper, above 1 flatter; 0 always takes the likeliest byte (0 or more)
    #[arg(long, default_value_t = 0.8, value_parser = flag::temperature, allow_hyphen_values = true)]
    temperature: f32,
    /// The seed of the draws
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Run step 05's `sample` instead: the whole forward again for every new byte
    #[arg(long, conflicts_with = "compare")]
    no_cache: bool,
    /// Run both, with the cache and without, and print both speeds and whether they wrote
    /// the same bytes (on the GPU, with the cache both as graphs and by launches)
    #[arg(long)]
    compare: bool,
    /// On the GPU: launch each step's kernels one by one instead of replaying the step as
    /// one CUDA graph
    #[arg(long)]
    no_graph: bool,
    /// Timed runs of each, after an untimed one, 1 or more; the median is reported
    #[arg(long, default_value_t = 3, value_parser = flag::at_least_one)]
    runs: usize,
    /// Add a row (the device, commit, date, model, prompt length, count, and tokens a
    /// second with and without the cache) to this JSON file's list, creating it; runs both,
    /// as --compare does
    #[arg(long, conflicts_with = "no_cache")]
    out: Option<PathBuf>,
}

/// Where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Device {
    /// f32, step 02's loop against the cache
    Cpu,
    /// GPU 0, bf16, this step's decoding kernel against a paged cache
    Cuda,
}

/// One measurement as `--out` writes it: a row of `charts/data/generate-*.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct GenerateRow {
    /// The CPU's name and the threads the model may use, or the GPU's name.
    device: String,
    /// The commit the binary was built from ([`flash_core::row::COMMIT`]).
    commit: String,
    date: String,
    /// `--model`'s preset, or the checkpoint's file name.
    model: String,
    config: Config,
    /// Numbers in the model.
    params: usize,
    prompt_len: usize,
    count: usize,
    temperature: f32,
    /// Timed runs of each; the tokens a second are the median run's.
    runs: usize,
    /// `count` over the seconds of a whole `generate` call, the prefill included; on the
    /// GPU, each step's kernels launched one by one.
    tokens_per_s_cached: f64,
    /// On the GPU, the same with each step replayed as one CUDA graph.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tokens_per_s_graph: Option<f64>,
    /// Whether the graphs wrote the bytes the launches did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    same_text_graph: Option<bool>,
    /// `count` over the seconds of a whole `sample` call.
    tokens_per_s_uncached: f64,
    /// Milliseconds of the prefill alone (the median of as many runs): the part of a
    /// `generate` call before its first decoding step.
    prefill_ms: f64,
    /// Bytes of keys and values in the cache after the last token.
    cache_bytes: usize,
    /// Whether the two wrote the same bytes.
    same_text: bool,
    /// What it wrote with the cache (bytes that are not UTF-8 shown as �).
    #[serde(default)]
    text: String,
}

/// Something `run` times: a whole generation, or the prefill alone.
type Call<'a> = &'a dyn Fn() -> Result<Vec<u8>, TrainError>;

/// What each of `calls` returns, and its median milliseconds over `runs` runs, after one
/// untimed run of each. The runs take turns (one of each, then again), so that a machine
/// that is busier for a while slows all of them alike, and their ratios hold.
fn timed(calls: &[Call], runs: usize) -> Result<Vec<(Vec<u8>, f64)>, TrainError> {
    let first = calls
        .iter()
        .map(|call| call())
        .collect::<Result<Vec<_>, _>>()?;
    let mut ms = vec![Vec::with_capacity(runs); calls.len()];
    for _ in 0..runs {
        for (call, ms) in calls.iter().zip(&mut ms) {
            let start = Instant::now();
            let result = call();
            ms.push(start.elapsed().as_secs_f64() * 1e3);
            result?;
        }
    }
    Ok(first.into_iter().zip(ms.into_iter().map(median)).collect())
}

/// How a time was taken, in words: "one run", or "median of 3 runs".
fn of_runs(runs: usize) -> String {
    match runs {
        1 => "one run".into(),
        n => format!("median of {n} runs"),
    }
}

/// The rows already in `path` (none if there is no file).
fn read_rows(path: &Path) -> Result<Vec<GenerateRow>, TrainError> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text).map_err(|e| {
            TrainError::Config(format!(
                "{}: not a list of generate's rows ({e}); --out adds a row to such a \
                 list, or writes a new file",
                path.display()
            ))
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(TrainError::io(path, e)),
    }
}

/// Appends `row` to the list in `path` (a new list if there is no file).
fn add_row(path: &Path, row: &GenerateRow) -> Result<(), TrainError> {
    let mut rows = read_rows(path)?;
    rows.push(row.clone());
    let json = flash_core::row::to_json_row_a_line(&rows);
    // whole or not at all: the rows already there survive a failed write
    flash_core::files::write_atomic(path, json.as_bytes()).map_err(TrainError::from)
}

/// The prompt and what came after it, as text (bytes that are not UTF-8 shown as �).
fn print_text(prompt: &[u8], text: &[u8]) {
    let (prompt, text) = (
        String::from_utf8_lossy(prompt),
        String::from_utf8_lossy(text),
    );
    println!("{prompt}{text}");
}

fn run(cli: Cli) -> Result<(), TrainError> {
    check_flags(&cli)?;
    let (params, name) = load_model(&cli)?;
    println!("  {:?}, {} parameters", params.config, params.count());
    let prompt = prompt_of(&cli)?;
    match cli.device {
        Device::Cpu => run_cpu(&cli, &params, name, &prompt),
        Device::Cuda => run_cuda(&cli, &params, name, &prompt),
    }
}

/// Before the model loads or anything is timed: what the flags ask for can be done.
fn check_flags(cli: &Cli) -> Result<(), TrainError> {
    // before the model loads or anything is timed: --out can be written, and what is
    // there already is a list of rows to add to
    if let Some(path) = &cli.out {
        flash_core::files::check_output("--out", path)?;
        read_rows(path)?;
    }
    if cli.no_graph && matches!(cli.device, Device::Cpu) {
        return Err(TrainError::Config(
            "--no-graph chooses how a GPU step runs (its kernels launched one by one rather \
             than replayed as one CUDA graph); the CPU runs no graphs: add --device cuda, or \
             leave --no-graph out"
                .into(),
        ));
    }
    Ok(())
}

/// The model: the checkpoint's, or a preset's with random weights; and its name for the
/// report.
fn load_model(cli: &Cli) -> Result<(Params<f32>, String), TrainError> {
    let model = match &cli.checkpoint {
        Some(path) => {
            let ckpt = Checkpoint::load(path)?;
            println!("model: {}, trained {} steps", path.display(), ckpt.step);
            let file = path.file_name().unwrap_or(path.as_os_str());
            (ckpt.params, file.to_string_lossy().into_owned())
        }
        None => {
            let preset = cli.model.unwrap_or(Preset::Small);
            let mut config = preset.config();
            let mut name = format!("{preset:?}").to_lowercase();
            if let Some(kv_heads) = cli.kv_heads {
                config.kv_heads = kv_heads;
                name = format!("{name}-kv{kv_heads}");
            }
            println!("model: {name}, random weights (seed {INIT_SEED})");
            (Params::init(config, INIT_SEED)?, name)
        }
    };
    Ok(model)
}

/// The prompt's bytes: --prompt, or --prompt-len bytes of it repeated.
fn prompt_of(cli: &Cli) -> Result<Vec<u8>, TrainError> {
    let prompt = match cli.prompt_len {
        Some(0) => {
            return Err(TrainError::Config(
                "--prompt-len 0: the model needs at least one byte to go on from".into(),
            ));
        }
        Some(_) if cli.prompt.is_empty() => {
            return Err(TrainError::Config(
                "--prompt-len repeats the prompt, and --prompt is empty: give --prompt at \
                 least one byte"
                    .into(),
            ));
        }
        Some(n) => cli.prompt.bytes().cycle().take(n).collect(),
        None => cli.prompt.clone().into_bytes(),
    };
    Ok(prompt)
}

/// On the CPU: step 08's cache against step 05's `sample`.
fn run_cpu(
    cli: &Cli,
    params: &Params<f32>,
    name: String,
    prompt: &[u8],
) -> Result<(), TrainError> {
    let (count, t, seed) = (cli.count, cli.temperature, cli.seed);
    let both = cli.compare || cli.out.is_some();
    let cached = || generate(params, prompt, count, t, seed);
    let uncached = || sample(params, prompt, count, t, seed);
    let prefill_only = || prefill(params, prompt).map(|_| Vec::new());
    let cache_bytes = |text: &[u8]| -> Result<usize, TrainError> {
        // the cache as the last token left it: the prompt and every new token but
        // the last
        let (mut cache, _) = prefill(params, prompt)?;
        for &token in &text[..count.saturating_sub(1)] {
            step(params, &mut cache, token)?;
        }
        Ok(cache.bytes())
    };
    let calls = Calls {
        cached: &cached,
        graph: None,
        uncached: &uncached,
        prefill: &prefill_only,
        uncached_is: "step 05's sample",
    };
    report(
        cli,
        params,
        name,
        prompt,
        cpu_description(),
        calls,
        both,
        &cache_bytes,
    )
}

/// On the GPU: step 08's cached model (by launches or as graphs) against step 05's GPU
/// trainer's forward over the window.
fn run_cuda(
    cli: &Cli,
    params: &Params<f32>,
    name: String,
    prompt: &[u8],
) -> Result<(), TrainError> {
    let config = params.config;
    let (count, t, seed) = (cli.count, cli.temperature, cli.seed);
    let both = cli.compare || cli.out.is_some();
    let model = RefCell::new(GpuModel::new(params)?);
    let start = Trainer {
        params: params.clone(),
        opt: step05_train::AdamW::new(config, Default::default()),
        step: 0,
    };
    // the fastest attention step 05's trainer has on this GPU: step 06's on Hopper
    let attention = match model.borrow().arch() {
        "sm_90" | "sm_90a" => AttentionKind::Hopper,
        _ => AttentionKind::Flash,
    };
    let trainer = if cli.no_cache || both {
        Some(RefCell::new(GpuTrainer::new(
            &start,
            1,
            config.context,
            attention,
            false,
        )?))
    } else {
        None
    };
    let device = model.borrow().device_name();
    // with the cache, each step's kernels launched one by one or as one graph
    let with_graphs = |graphs: bool| {
        let mut model = model.borrow_mut();
        model.graphs = graphs;
        generate_gpu(&mut model, prompt, count, t, seed)
    };
    let cached = || with_graphs(!cli.no_graph && !both);
    let graphs = || with_graphs(true);
    let uncached = || match &trainer {
        Some(trainer) => sample_gpu(&mut trainer.borrow_mut(), prompt, count, t, seed),
        None => unreachable!("made for --no-cache and for both"),
    };
    let prefill_only = || {
        let mut model = model.borrow_mut();
        model.reset()?;
        model.prefill(prompt)?;
        Ok(Vec::new())
    };
    let cache_bytes = |text: &[u8]| -> Result<usize, TrainError> {
        let mut model = model.borrow_mut();
        generate_gpu(&mut model, prompt, text.len(), t, seed)?;
        Ok(model.cache_bytes())
    };
    let calls = Calls {
        cached: &cached,
        graph: if cli.no_graph { None } else { Some(&graphs) },
        uncached: &uncached,
        prefill: &prefill_only,
        uncached_is: "step 05's GPU forward over the window",
    };
    let device = format!(
        "{device} ({} attention without the cache)",
        attention.name()
    );
    report(cli, params, name, prompt, device, calls, both, &cache_bytes)
}

/// What `report` times: generation with and without the cache, and the prefill alone.
struct Calls<'a> {
    /// With the cache (on the GPU, by launches when both are timed).
    cached: Call<'a>,
    /// On the GPU, with the cache and the step as a graph.
    graph: Option<Call<'a>>,
    uncached: Call<'a>,
    prefill: Call<'a>,
    /// What runs without the cache, as the report names it.
    uncached_is: &'a str,
}

/// Times what `cli` asks for, prints the text and the speeds, and adds `--out`'s row.
#[allow(clippy::too_many_arguments)]
fn report(
    cli: &Cli,
    params: &Params<f32>,
    name: String,
    prompt: &[u8],
    device: String,
    calls: Calls,
    both: bool,
    cache_bytes: &dyn Fn(&[u8]) -> Result<usize, TrainError>,
) -> Result<(), TrainError> {
    let count = cli.count;
    let speed = |what: &str, tokens_per_s: f64| {
        println!(
            "{what}: {count} tokens at {tokens_per_s:.0} tokens/s ({})",
            of_runs(cli.runs)
        );
    };
    let tokens_per_s = |ms: f64| count as f64 / (ms / 1e3);
    let without = format!("without the cache ({})", calls.uncached_is);
    if !both {
        let (call, what): (Call, _) = if cli.no_cache {
            (calls.uncached, without.as_str())
        } else {
            (calls.cached, "with the cache")
        };
        let timed = timed(&[call], cli.runs)?;
        let (text, ms) = &timed[0];
        print_text(prompt, text);
        speed(what, tokens_per_s(*ms));
        return Ok(());
    }
    let mut timed_calls = vec![calls.cached, calls.uncached, calls.prefill];
    timed_calls.extend(calls.graph);
    let timed = timed(&timed_calls, cli.runs)?;
    let [(text, with_ms), (other, without_ms), (_, prefill_ms)] = &timed[..3] else {
        unreachable!("three calls at least, as many results")
    };
    let (with, without_tps) = (tokens_per_s(*with_ms), tokens_per_s(*without_ms));
    // on the GPU, the graphs' speed and whether they wrote the launches' bytes
    let graph = timed
        .get(3)
        .map(|(graph_text, ms)| (tokens_per_s(*ms), graph_text == text));
    print_text(prompt, text);
    match graph {
        Some((graph_tps, same)) => {
            speed("with the cache, each step one graph", graph_tps);
            speed(
                "with the cache, each step's kernels launched one by one",
                with,
            );
            println!(
                "the graph: {:.2}× the tokens a second; {}",
                graph_tps / with,
                if same {
                    "the same bytes"
                } else {
                    "different bytes"
                }
            );
        }
        None => speed("with the cache", with),
    }
    speed(&without, without_tps);
    let same = other == text;
    println!(
        "the cache: {:.1}× the tokens a second; {}",
        with / without_tps,
        if same {
            "the same bytes".to_string()
        } else {
            let at = text.iter().zip(other).take_while(|(a, b)| a == b).count();
            format!("the texts part at byte {at} (the two round differently)")
        }
    );
    println!(
        "the prefill of {} bytes alone: {prefill_ms:.2} ms ({})",
        prompt.len(),
        of_runs(cli.runs)
    );
    if let Some(path) = &cli.out {
        let row = GenerateRow {
            device,
            commit: flash_core::row::COMMIT.into(),
            date: flash_core::row::utc_now(),
            model: name,
            config: params.config,
            params: params.count(),
            prompt_len: prompt.len(),
            count,
            temperature: cli.temperature,
            runs: cli.runs,
            tokens_per_s_cached: with,
            tokens_per_s_graph: graph.map(|(tps, _)| tps),
            same_text_graph: graph.map(|(_, same)| same),
            tokens_per_s_uncached: without_tps,
            prefill_ms: *prefill_ms,
            cache_bytes: cache_bytes(text)?,
            same_text: same,
            text: String::from_utf8_lossy(text).into_owned(),
        };
        add_row(path, &row)?;
        println!("row added to {}", path.display());
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
