//! `train`: a GPT-2-style model over bytes, on the CPU or the GPU; `sample`: text from a
//! checkpoint (on the CPU, whichever device trained it).
//!
//! ```sh
//! cargo run --release -p step05-train -- train --steps 2000 --save gpt.safetensors --out
//! run.json cargo run --release -p step05-train -- train --device cuda --model gpt2 --batch
//! 12 --max-seconds 300
//! cargo run --release -p step05-train -- train --device cuda --model gpt2 --batch 24 --gpus 2 // [step 07]
//! cargo run --release -p step05-train -- sample --checkpoint gpt.safetensors --prompt "fn
//! " --tokens 200
//! ```

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use step05_train::cuda::parallel::{DataParallel, local_batch}; // [step 07]
use step05_train::cuda::{AttentionKind, GpuTrainer};
use step05_train::model::Preset;
use step05_train::optim::{AdamWSettings, Schedule};
use step05_train::train::{Event, RunRecord};
use step05_train::{
    Checkpoint, Config, Corpus, Settings, TrainError, Trainer, sample, train,
};

#[derive(Parser)]
#[command(
    about = "Train a GPT-2-style model over bytes with our attention kernels, on the CPU or the GPU"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (or go on training one, with --resume).
    Train(Box<TrainArgs>),
    /// Generate text from a checkpoint.
    Sample(SampleArgs),
}

/// Where to train.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DeviceArg {
    /// The CPU model, in f32, with steps 02 and 04's attention
    Cpu,
    /// The GPU trainer, mixed precision, with steps 03 and 04's kernels
    Cuda,
}

/// The attention inside the model (on the GPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum AttentionArg {
    /// Our kernels: online softmax forward, blockwise backward, no T×T table
    Flash,
    /// Attention by hand: the whole table of scores in GPU memory
    ByHand,
    // [step 06]
    /// Step 06's kernels with Hopper's instructions (compute capability 9.0)
    Hopper,
    // [/step 06]
}

/// The model's shape: with --resume, the checkpoint's, and any of these given must agree.
#[derive(Args)]
struct ModelArgs {
    /// A named shape; the flags below change one number of it [default: small]
    #[arg(long, value_enum)]
    model: Option<Preset>,
    /// Transformer blocks [default: 4]
    #[arg(long)]
    layers: Option<usize>,
    /// Width of the residual stream [default: 128]
    #[arg(long)]
    d_model: Option<usize>,
    /// Attention heads (d_model / heads dimensions each) [default: 4]
    #[arg(long)]
    heads: Option<usize>,
    // [step 08]
    /// Heads of keys and values, each shared by heads / kv-heads query heads
    /// (grouped-query attention; 1 is multi-query); a divisor of --heads [default: --heads]
    #[arg(long)]
    kv_heads: Option<usize>,
    // [/step 08]
    /// Positions the model has [default: 128]
    #[arg(long)]
    context: Option<usize>,
}

impl ModelArgs {
    fn config(&self, base: Config) -> Config {
        let base = self.model.map_or(base, Preset::config);
        Config {
            layers: self.layers.unwrap_or(base.layers),
            d_model: self.d_model.unwrap_or(base.d_model),
            heads: self.heads.unwrap_or(base.heads),
            // [step 08]
            // one key and value head per query head unless --kv-heads says otherwise
            kv_heads: self.kv_heads.unwrap_or(match self.heads {
                Some(heads) if heads != base.heads => heads,
                _ => base.kv_heads,
            }),
            // [/step 08]
            context: self.context.unwrap_or(base.context),
            vocab: base.vocab,
        }
    }
}

const DEFAULT_MODEL: Config = Preset::Small.config();

/// `--lr` when none is given: 3e-3 for the small models, and from GPT-2 small's width (768)
/// on the rate that shape trains at (6e-4: GPT-3's paper for its 125M model, and llm.c).
/// Wider models take smaller steps: 3e-3 is five times that rate.
fn default_lr(config: &Config) -> f32 {
    if config.d_model >= 768 { 6e-4 } else { 3e-3 }
}

#[derive(Args)]
struct TrainArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// A text file, a folder of text files (all, sorted) or a token file from
    /// --save-tokens; by default the Rust sources of the crates Cargo.lock pins, from
    /// cargo's registry
    #[arg(long)]
    data: Option<PathBuf>,
    /// Write the corpus, split, as a token file, to train on it again with --data
    #[arg(long)]
    save_tokens: Option<PathBuf>,
    /// Sequences per step
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Tokens per sequence [default: the model's context]
    #[arg(long)]
    seq_len: Option<usize>,
    /// Steps of the whole run (the learning rate reaches its minimum at the last)
    #[arg(long, default_value_t = 1000)]
    steps: usize,
    /// The largest learning rate, reached after the warm-up [default: 3e-3; 6e-4 for a
    /// model 768 wide or wider, such as --model gpt2]
    #[arg(long)]
    lr: Option<f32>,
    /// The last learning rate, as a fraction of --lr
    #[arg(long, default_value_t = 0.1)]
    min_lr_frac: f32,
    /// Steps of linear warm-up
    #[arg(long, default_value_t = 50)]
    warmup: usize,
    /// AdamW's weight decay, on matrices only
    #[arg(long, default_value_t = 0.1)]
    weight_decay: f32,
    /// The gradients' largest global norm
    #[arg(long, default_value_t = 1.0)]
    clip: f32,
    /// Seed of the initial weights and of the batches
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// The held-out loss every this many steps
    #[arg(long, default_value_t = 100)]
    eval_every: usize,
    /// Batches of the held-out loss
    #[arg(long, default_value_t = 8)]
    eval_batches: usize,
    /// Print every this many steps (every held-out loss is printed)
    #[arg(long, default_value_t = 1)]
    print_every: usize,
    /// Write the run (every step and held-out loss) as JSON
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write a checkpoint (weights and optimizer) at the end
    #[arg(long)]
    save: Option<PathBuf>,
    /// Go on from a checkpoint: its weights, optimizer and step
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Stop after the first step that ends past this many seconds of training (held-out
    /// losses not counted); the schedule still runs over --steps
    #[arg(long)]
    max_seconds: Option<f64>,
    /// Write the initial weights (before the first step) as a checkpoint without optimizer
    /// state, for a peer trainer to start from the same weights
    #[arg(long)]
    save_init: Option<PathBuf>,
    /// Write the windows of every step of the run, [steps, batch, seq_len + 1] bytes
    /// (inputs, and the targets one byte later), and the held-out batches' likewise to
    /// PATH.heldout
    #[arg(long)]
    dump_batches: Option<PathBuf>,
    /// Where to train
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    device: DeviceArg,
    /// The attention inside the model; by-hand on the GPU only
    #[arg(long, value_enum, default_value_t = AttentionArg::Flash)]
    attention: AttentionArg,
    /// Time each phase of every step on the GPU with CUDA events, and print where the time
    /// went
    #[arg(long)]
    profile: bool,
    // [step 07]
    /// GPUs to train on (--device cuda): a replica of the model on each, --batch (the
    /// step's sequences over all of them) split evenly, the gradients averaged by NCCL
    #[arg(long, default_value_t = 1)]
    gpus: usize,
    // [/step 07]
}

#[derive(Args)]
struct SampleArgs {
    /// A checkpoint written by `train --save`
    #[arg(long)]
    checkpoint: PathBuf,
    /// The text to go on from
    #[arg(long, default_value = "\n")]
    prompt: String,
    /// Bytes to generate
    #[arg(long, default_value_t = 200)]
    tokens: usize,
    /// Below 1 sharper, above 1 flatter; 0 always takes the likeliest byte
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    #[arg(long, default_value_t = 1337)]
    seed: u64,
}

fn run_train(args: TrainArgs) -> Result<(), TrainError> {
    // [step 07]
    // before anything loads: the GPUs asked for, and the batch's split over them
    let gpus = check_gpus(&args)?;
    // [/step 07]
    if args.device == DeviceArg::Cuda {
        // before the corpus loads: no GPU is said at once
        step03_cuda_forward::Gpu::shared().map_err(TrainError::Device)?;
    }
    let resumed = args.resume.as_deref().map(Checkpoint::load).transpose()?;
    let config = match &resumed {
        Some(ckpt) => {
            let want = args.model.config(ckpt.params.config);
            ckpt.check_config(&want)?;
            want
        }
        None => args.model.config(DEFAULT_MODEL),
    };
    config.check()?;
    // [step 08]
    // heads the GPU's attention cannot take: said before the corpus loads
    if args.device == DeviceArg::Cuda && args.attention == AttentionArg::ByHand {
        step05_train::cuda::check_heads(&config, AttentionKind::ByHand)?;
    }
    // [/step 08]
    let lr = args.lr.unwrap_or_else(|| default_lr(&config));
    let settings = Settings {
        batch: args.batch,
        seq_len: args.seq_len.unwrap_or(config.context),
        steps: args.steps,
        schedule: Schedule {
            max: lr,
            min: lr * args.min_lr_frac,
            warmup: args.warmup,
            steps: args.steps,
        },
        adamw: AdamWSettings {
            weight_decay: args.weight_decay,
            ..AdamWSettings::default()
        },
        clip: args.clip,
        seed: args.seed,
        eval_every: args.eval_every,
        eval_batches: args.eval_batches,
        max_seconds: args.max_seconds,
    };
    let corpus = match &args.data {
        Some(path) => Corpus::load(path)?,
        None => Corpus::default_corpus()?,
    };
    println!("corpus: {}", corpus.source);
    println!(
        "  training: {} bytes from {} files; held out: {} bytes from {} files",
        corpus.train.len(),
        corpus.train_files,
        corpus.heldout.len(),
        corpus.heldout_files
    );
    if let Some(path) = &args.save_tokens {
        corpus.save(path)?;
        println!("  written as tokens to {}", path.display());
    }
    let mut trainer = match resumed {
        Some(ckpt) => {
            let opt = ckpt.opt.ok_or_else(|| {
                TrainError::Checkpoint(
                    "the checkpoint has no optimizer state to resume".into(),
                )
            })?;
            Trainer {
                params: ckpt.params,
                opt,
                step: ckpt.step,
            }
        }
        None => Trainer::new(config, &settings)?,
    };
    if let Some(path) = &args.dump_batches {
        dump_batches(path, &corpus, &settings, trainer.step)?;
    }
    if let Some(path) = &args.save_init {
        let init = Checkpoint {
            params: trainer.params.clone(),
            opt: None,
            step: trainer.step,
        };
        init.save(path)?;
        println!("initial weights written to {}", path.display());
    }
    println!(
        "model: {config:?}, {} parameters; {} sequences × {} tokens a step",
        trainer.params.count(),
        settings.batch,
        settings.seq_len,
    );
    let print_every = args.print_every.max(1);
    let trainer_start = trainer.step;
    let report = |event: Event| {
        match event {
            Event::Step(s) if s.step % print_every == 0 || s.step == settings.steps => {
                println!(
                    "step {:>5}/{} | loss {:.4} | lr {:.2e} | norm {:.3} | {:.1} ms | {:.0} tokens/s | {}",
                    s.step,
                    settings.steps,
                    s.loss,
                    s.lr,
                    s.grad_norm,
                    s.ms,
                    s.tokens_per_s,
                    progress(s.step, s.train_seconds, &settings, trainer_start),
                )
            }
            Event::Step(_) => {}
            Event::Eval(e) => println!("step {:>5} | held-out loss {:.4}", e.step, e.loss),
        }
        let _ = std::io::stdout().flush();
    };
    let (run, trainer) = match args.device {
        DeviceArg::Cpu => {
            if args.attention != AttentionArg::Flash {
                let name = args
                    .attention
                    .to_possible_value()
                    .expect("a value")
                    .get_name()
                    .to_string();
                return Err(TrainError::Config(format!(
                    "--attention {name} runs on the GPU only (--device cuda); the CPU model's \
                     attention is steps 02 and 04's"
                )));
            }
            if args.profile {
                return Err(TrainError::Config(
                    "--profile times the GPU's phases: it needs --device cuda".into(),
                ));
            }
            println!("device: cpu, {} threads", rayon::current_num_threads());
            let run = train(&mut trainer, &corpus, &settings, report)?;
            (run, trainer)
        }
        // [step 07]
        DeviceArg::Cuda if gpus.len() > 1 => {
            let attention = match args.attention {
                AttentionArg::Flash => AttentionKind::Flash,
                AttentionArg::ByHand => AttentionKind::ByHand,
                AttentionArg::Hopper => AttentionKind::Hopper, // [step 06]
            };
            let mut dp = DataParallel::new(
                &trainer,
                &gpus,
                settings.batch,
                settings.seq_len,
                attention,
                args.profile,
            )?;
            let first = &dp.replicas()[0];
            println!(
                "device: {} × {} ({} attention), {} sequences each, {:.2} GB allocated on each for weights, optimizer state and activations",
                gpus.len(),
                first.device_name(),
                attention.name(),
                first.batch,
                first.bytes as f64 / 1e9
            );
            let run = train(&mut dp, &corpus, &settings, report)?;
            let trainer = match args.save {
                Some(_) => dp.to_trainer()?,
                None => trainer,
            };
            (run, trainer)
        }
        // [/step 07]
        DeviceArg::Cuda => {
            let attention = match args.attention {
                AttentionArg::Flash => AttentionKind::Flash,
                AttentionArg::ByHand => AttentionKind::ByHand,
                AttentionArg::Hopper => AttentionKind::Hopper, // [step 06]
            };
            let mut gpu = GpuTrainer::new(
                &trainer,
                settings.batch,
                settings.seq_len,
                attention,
                args.profile,
            )?;
            println!(
                "device: {} ({} attention), {:.2} GB allocated for weights, optimizer state and activations",
                gpu.device_name(),
                attention.name(),
                gpu.bytes as f64 / 1e9
            );
            let run = train(&mut gpu, &corpus, &settings, report)?;
            // the weights and moments come back only to be saved
            let trainer = match args.save {
                Some(_) => gpu.to_trainer()?,
                None => trainer,
            };
            (run, trainer)
        }
    };
    summary(&run);
    if let Some(path) = &args.out {
        // one step a line (flash_core::row::row_a_line)
        let json = flash_core::row::to_json_row_a_line(&run);
        std::fs::write(path, json).map_err(|e| TrainError::io(path, e))?;
        println!("run written to {}", path.display());
    }
    if let Some(path) = &args.save {
        let ckpt = Checkpoint {
            params: trainer.params,
            opt: Some(trainer.opt),
            step: trainer.step,
        };
        ckpt.save(path)?;
        println!("checkpoint written to {}", path.display());
    }
    Ok(())
}

// [step 07]
/// The GPUs `--gpus` asks for, checked against the device, the batch, the machine and NCCL
/// before anything loads: none for the CPU.
fn check_gpus(
    args: &TrainArgs,
) -> Result<Vec<&'static step03_cuda_forward::Gpu>, TrainError> {
    if args.gpus == 0 {
        return Err(TrainError::Config(
            "--gpus 0: a run needs at least one GPU (--gpus 1, the default, is one GPU)"
                .into(),
        ));
    }
    if args.device == DeviceArg::Cpu {
        return match args.gpus {
            1 => Ok(Vec::new()),
            n => Err(TrainError::Config(format!(
                "--gpus {n} trains on {n} GPUs: it needs --device cuda (the CPU model runs on one \
                 CPU, with all its threads)"
            ))),
        };
    }
    if args.gpus == 1 {
        // GPU 0, opened next as for any run on the GPU
        return Ok(Vec::new());
    }
    local_batch(args.batch, args.gpus)?;
    let there = step03_cuda_forward::Gpu::count();
    if there == 0 {
        return Err(TrainError::Config(format!(
            "--gpus {}: no GPU here (no CUDA driver, or it sees no GPU)",
            args.gpus
        )));
    }
    if args.gpus > there {
        return Err(TrainError::Config(format!(
            "--gpus {}: this machine has {there} GPU{} that the CUDA driver sees; --gpus takes 1 to {there}",
            args.gpus,
            if there == 1 { "" } else { "s" },
        )));
    }
    if !step07_multi_gpu::comm::nccl_present() {
        return Err(TrainError::Config(format!(
            "--gpus {}: the gradients' all-reduce needs NCCL, and no libnccl.so was found: \
             install NCCL 2.28 or newer and put its folder on LD_LIBRARY_PATH (or train on \
             one GPU)",
            args.gpus
        )));
    }
    let gpus = step07_multi_gpu::comm::gpus(args.gpus).map_err(TrainError::Device)?;
    Ok(gpus)
}
// [/step 07]

/// How far the run is: a share of its steps or of its time budget, whichever is further,
/// and an estimate of the time left.
fn progress(step: usize, seconds: f64, settings: &Settings, start: usize) -> String {
    let by_steps = (step - start) as f64 / (settings.steps - start).max(1) as f64;
    let by_time = settings.max_seconds.map_or(0.0, |m| seconds / m);
    let done = by_steps.max(by_time).min(1.0);
    let left = if done > 0.0 {
        seconds * (1.0 - done) / done
    } else {
        0.0
    };
    format!("{:>3.0}% | {:.0} s left", done * 100.0, left)
}

/// The run in a few lines: throughput, memory, and with --profile where the time went.
fn summary(run: &RunRecord) {
    println!(
        "trained {} steps in {:.1} s: {:.0} tokens/s after the first step",
        run.steps.len(),
        run.seconds,
        run.tokens_per_s
    );
    if let Some(bytes) = run.peak_memory_bytes {
        println!("peak GPU memory: {:.2} GB", bytes as f64 / 1e9);
    }
    // [step 07]
    if !run.allreduce_ms.is_empty() {
        let each: Vec<String> = run
            .allreduce_ms
            .iter()
            .map(|ms| format!("{ms:.2}"))
            .collect();
        println!(
            "all-reduce of the gradients on each of {} GPUs: {} ms a step (the least is NCCL's own time, the rest waiting for the other GPUs' backward)",
            run.gpus,
            each.join(", ")
        );
    }
    // [/step 07]
    if !run.profile.is_empty() {
        let total: f64 = run.profile.iter().map(|p| p.ms).sum();
        println!(
            "where a step's time went (CUDA events, mean over steps after the first):"
        );
        let mut phases = run.profile.clone();
        phases.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        for p in phases {
            println!(
                "  {:<40} {:>8.2} ms {:>5.1}%",
                p.name,
                p.ms,
                100.0 * p.ms / total
            );
        }
        println!("  {:<40} {:>8.2} ms", "total", total);
    }
}

/// The windows of steps `from..settings.steps` to `path`, and of the held-out batches to
/// `path.heldout`: row-major u8, `seq_len + 1` bytes a window.
fn dump_batches(
    path: &std::path::Path,
    corpus: &Corpus,
    settings: &Settings,
    from: usize,
) -> Result<(), TrainError> {
    use step05_train::data::{heldout_starts, train_starts, windows};
    let (batch, tokens) = (settings.batch, settings.seq_len);
    corpus.check_window(tokens)?;
    let mut out = Vec::with_capacity(
        (settings.steps - from.min(settings.steps)) * batch * (tokens + 1),
    );
    for step in from..settings.steps {
        let starts = train_starts(corpus.train.len(), batch, tokens, settings.seed, step);
        out.extend_from_slice(&windows(&corpus.train, &starts, tokens));
    }
    std::fs::write(path, &out).map_err(|e| TrainError::io(path, e))?;
    let mut held = Vec::new();
    for starts in heldout_starts(corpus.heldout.len(), batch, tokens, settings.eval_batches)
    {
        held.extend_from_slice(&windows(&corpus.heldout, &starts, tokens));
    }
    let mut heldout_path = path.as_os_str().to_owned();
    heldout_path.push(".heldout");
    let heldout_path = PathBuf::from(heldout_path);
    std::fs::write(&heldout_path, &held).map_err(|e| TrainError::io(&heldout_path, e))?;
    println!(
        "batches of steps {from}..{} written to {} ([{}, {batch}, {}] bytes), held-out to {}",
        settings.steps,
        path.display(),
        settings.steps.saturating_sub(from),
        tokens + 1,
        heldout_path.display()
    );
    Ok(())
}

fn run_sample(args: SampleArgs) -> Result<(), TrainError> {
    let ckpt = Checkpoint::load(&args.checkpoint)?;
    let text = sample(
        &ckpt.params,
        args.prompt.as_bytes(),
        args.tokens,
        args.temperature,
        args.seed,
    )?;
    println!("{}{}", args.prompt, String::from_utf8_lossy(&text));
    Ok(())
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Train(args) => run_train(*args),
        Command::Sample(args) => run_sample(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
