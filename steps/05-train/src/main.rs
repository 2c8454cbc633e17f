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
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::{Args, Parser, Subcommand, ValueEnum};
use flash_core::files;
use step05_train::cuda::parallel::{DataParallel, local_batch}; // [step 07]
use step05_train::cuda::{AttentionKind, GpuTrainer};
use step05_train::fast::FastCpu;
use step05_train::flag;
use step05_train::model::Preset;
use step05_train::optim::{AdamWSettings, Schedule};
use step05_train::train::{
    EvalRecord, Event, RunRecord, StepRecord, Utf8Stream, sample_each, throughput,
};
use step05_train::{
    Checkpoint, Config, Control, Corpus, Learner, Settings, TrainError, Trainer, train_with,
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
    ///
    /// Ctrl-C or SIGTERM stops the run after the step it is in: the run's JSON so far is
    /// written (--out), the checkpoint is saved (to --save, or, without it, to a new file
    /// train-interrupted-STEP.safetensors in the current folder), the command that resumes
    /// it is printed, and the exit status is 130. A second Ctrl-C quits at once, leaving
    /// every file as it was. --save-every N saves along the way; --resume goes on, exactly.
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

/// Which code trains on the CPU: the same model, the same losses within f32 rounding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum CpuPathArg {
    /// A shard of the batch per core, faer's matrix products, fused passes (src/fast.rs)
    Fast,
    /// The model as chapter 5 reads it, layer by layer on ndarray (src/model.rs)
    Readable,
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
    /// The largest learning rate, reached after the warm-up, in (0, 1] [default: 3e-3;
    /// 6e-4 for a model 768 wide or wider, such as --model gpt2]
    #[arg(long, value_parser = flag::learning_rate, allow_hyphen_values = true)]
    lr: Option<f32>,
    /// The last learning rate, as a fraction of --lr, in [0, 1]
    #[arg(long, default_value_t = 0.1, value_parser = flag::fraction, allow_hyphen_values = true)]
    min_lr_frac: f32,
    /// Steps of linear warm-up
    #[arg(long, default_value_t = 50)]
    warmup: usize,
    /// AdamW's weight decay, on matrices only, in [0, 1]
    #[arg(long, default_value_t = 0.1, value_parser = flag::fraction, allow_hyphen_values = true)]
    weight_decay: f32,
    /// The gradients' largest global norm, above 0
    #[arg(long, default_value_t = 1.0, value_parser = flag::positive, allow_hyphen_values = true)]
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
    /// Write a checkpoint (weights and optimizer) at the end, on Ctrl-C, and with
    /// --save-every along the way; each save replaces the last whole, never half-written
    #[arg(long)]
    save: Option<PathBuf>,
    /// Save the checkpoint to --save every this many steps, as well as at the end
    #[arg(long, requires = "save")]
    save_every: Option<usize>,
    /// Go on from a checkpoint: its weights, optimizer and step. With the flags, device and
    /// threads of the run that wrote it, the steps that follow are bit for bit those that
    /// run would have taken
    /// (the batches, the rate and AdamW's step depend only on the seed and the step);
    /// with --out naming that run's JSON, the steps are added to it
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Stop after the first step that ends past this many seconds of training (held-out
    /// losses not counted); the schedule still runs over --steps
    #[arg(long, value_parser = flag::seconds, allow_hyphen_values = true)]
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
    /// Which code trains on the CPU (--device cpu) [default: fast]
    #[arg(long, value_enum)]
    cpu_path: Option<CpuPathArg>,
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
    // [step 09]
    /// Documents packed without padding: a token attends to the earlier tokens of its own
    /// file only, never across a file boundary inside its window (step 09's document mask;
    /// on the CPU, either --cpu-path; not with a token file, which keeps no boundaries)
    #[arg(long)]
    documents: bool,
    // [/step 09]
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
    /// Below 1 sharper, above 1 flatter; 0 always takes the likeliest byte (0 or more)
    #[arg(long, default_value_t = 0.8, value_parser = flag::temperature, allow_hyphen_values = true)]
    temperature: f32,
    #[arg(long, default_value_t = 1337)]
    seed: u64,
}

fn run_train(args: TrainArgs) -> Result<ExitCode, TrainError> {
    // every file the run writes can be written: said before anything loads or trains
    check_outputs(&args)?;
    // [step 07]
    // before anything loads: the GPUs asked for, and the batch's split over them
    let gpus = check_gpus(&args)?;
    // [/step 07]
    check_device(&args)?;
    // [step 09]
    if let Some(path) = &args.resume {
        check_resumed_documents(path, args.documents)?;
    }
    // [/step 09]
    let resumed = args.resume.as_deref().map(Checkpoint::load).transpose()?;
    let config = model_config(&args, resumed.as_ref())?;
    let settings = settings_of(&args, &config);
    let corpus = load_corpus(&args)?;
    // what a checkpoint of this run keeps of it, and what a resumed run compares
    let run_meta = run_metadata(&settings, &corpus, trained_how(&args));
    if let Some(path) = &args.resume {
        resume_notes(path, &run_meta)?;
    }
    let mut trainer = start_trainer(resumed, config, &settings)?;
    write_before_training(&args, &corpus, &settings, &trainer, &run_meta)?;
    println!(
        "model: {config:?}, {} parameters; {} sequences × {} tokens a step",
        trainer.params.count(),
        settings.batch,
        settings.seq_len,
    );
    let print_every = args.print_every.max(1);
    let trainer_start = trainer.step;
    let save = args.save.as_deref();
    let report =
        |event: Event| print_event(event, print_every, &settings, trainer_start, save);
    // the run's JSON before this one, continued if it ends where the checkpoint starts
    let earlier = earlier_record(&args, &config, &settings, trainer.step);
    // from here on, Ctrl-C and SIGTERM stop the run after its step, saved
    let stop = interrupt_flag()?;
    let mut save_along = |ckpt: &Checkpoint, run: &RunRecord| -> Result<(), TrainError> {
        if let Some(path) = &args.out {
            write_record(path, &continued(earlier.as_ref(), run))?;
        }
        let path = args.save.as_deref().expect("--save-every requires --save");
        ckpt.save_with(path, &run_meta)
    };
    let control = Control {
        interrupt: Some(stop),
        save_every: args.save_every.unwrap_or(0),
        save: Some(&mut save_along),
    };
    // the checkpoint is copied back from a GPU only when it is saved
    let wanted = |learner: &dyn Learner| -> Result<Option<Checkpoint>, TrainError> {
        match args.save.is_some() || stop.load(Ordering::SeqCst) {
            true => learner.checkpoint().map(Some),
            false => Ok(None),
        }
    };
    let (run, ckpt) = match args.device {
        DeviceArg::Cpu => {
            let run =
                train_on_cpu(&args, &mut trainer, &corpus, &settings, control, report)?;
            (run, wanted(&trainer)?)
        }
        // [step 07]
        DeviceArg::Cuda if gpus.len() > 1 => {
            let mut dp = data_parallel(&args, &gpus, &trainer, &settings)?;
            let run = train_with(&mut dp, &corpus, &settings, control, report)?;
            (run, wanted(&dp)?)
        }
        // [/step 07]
        DeviceArg::Cuda => {
            let mut gpu = gpu_trainer(&args, &trainer, &settings)?;
            let run = train_with(&mut gpu, &corpus, &settings, control, report)?;
            (run, wanted(&gpu)?)
        }
    };
    let interrupted = stop.load(Ordering::SeqCst);
    finish(
        &args,
        &run,
        ckpt,
        earlier.as_ref(),
        &run_meta,
        &settings,
        interrupted,
    )
}

/// The flags that depend on the device, before the corpus loads: the CPU's paths and
/// documents need --device cpu, and --device cuda a GPU.
fn check_device(args: &TrainArgs) -> Result<(), TrainError> {
    if args.device == DeviceArg::Cuda && args.cpu_path.is_some() {
        return Err(TrainError::Config(
            "--cpu-path chooses the code that trains on the CPU: it needs --device cpu (the \
             GPU trainer is one, src/cuda/)"
                .into(),
        ));
    }
    // [step 09]
    if args.documents && args.device == DeviceArg::Cuda {
        return Err(TrainError::Config(
            "--documents needs --device cpu: the GPU trainer's kernels attend causally across \
             the whole window; accepted: --documents with --device cpu (either --cpu-path)"
                .into(),
        ));
    }
    // [/step 09]
    if args.device == DeviceArg::Cuda {
        // before the corpus loads: no GPU is said at once
        step03_cuda_forward::gpu::Gpu::shared().map_err(TrainError::Device)?;
    }
    Ok(())
}

/// The model's shape: the preset's, or the checkpoint's with what --model changes.
fn model_config(
    args: &TrainArgs,
    resumed: Option<&Checkpoint>,
) -> Result<Config, TrainError> {
    let config = match resumed {
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
    Ok(config)
}

/// The weights, AdamW's state and the step to start from: the checkpoint's, or new ones.
fn start_trainer(
    resumed: Option<Checkpoint>,
    config: Config,
    settings: &Settings,
) -> Result<Trainer, TrainError> {
    let trainer = match resumed {
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
        None => Trainer::new(config, settings)?,
    };
    Ok(trainer)
}

/// What the run writes before it trains: --dump-batches' windows and --save-init's weights.
fn write_before_training(
    args: &TrainArgs,
    corpus: &Corpus,
    settings: &Settings,
    trainer: &Trainer,
    run_meta: &[(&str, String)],
) -> Result<(), TrainError> {
    if let Some(path) = &args.dump_batches {
        dump_batches(path, corpus, settings, trainer.step)?;
    }
    if let Some(path) = &args.save_init {
        let init = Checkpoint {
            params: trainer.params.clone(),
            opt: None,
            step: trainer.step,
        };
        init.save_with(path, run_meta)?;
        println!("initial weights written to {}", path.display());
    }
    Ok(())
}

/// Prints a step every `print_every` (and the last), each held-out loss and each
/// checkpoint saved along the way (to `save`).
fn print_event(
    event: Event,
    print_every: usize,
    settings: &Settings,
    trainer_start: usize,
    save: Option<&Path>,
) {
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
                progress(s.step, s.train_seconds, settings, trainer_start),
            )
        }
        Event::Step(_) => {}
        Event::Eval(e) => println!("step {:>5} | held-out loss {:.4}", e.step, e.loss),
        Event::Saved(step) => {
            let path = save.expect("--save-every requires --save");
            println!("step {step:>5} | checkpoint saved to {}", path.display());
        }
    }
    let _ = std::io::stdout().flush();
}

/// Trains on the CPU, through --cpu-path's code.
fn train_on_cpu(
    args: &TrainArgs,
    trainer: &mut Trainer,
    corpus: &Corpus,
    settings: &Settings,
    control: Control,
    report: impl FnMut(Event),
) -> Result<RunRecord, TrainError> {
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
    let path = args.cpu_path.unwrap_or(CpuPathArg::Fast);
    println!(
        "device: cpu, {} threads, the {} path",
        rayon::current_num_threads(),
        path.to_possible_value().expect("a value").get_name()
    );
    match path {
        CpuPathArg::Fast => {
            let mut fast = FastCpu::new(trainer);
            train_with(&mut fast, corpus, settings, control, report)
        }
        CpuPathArg::Readable => train_with(trainer, corpus, settings, control, report),
    }
}

// [step 07]
/// The replicas of data parallelism on `gpus`, each with a share of the batch.
fn data_parallel(
    args: &TrainArgs,
    gpus: &[&'static step03_cuda_forward::gpu::Gpu],
    trainer: &Trainer,
    settings: &Settings,
) -> Result<DataParallel, TrainError> {
    let attention = attention_kind(args.attention);
    let dp = DataParallel::new(
        trainer,
        gpus,
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
    Ok(dp)
}
// [/step 07]

/// The trainer on GPU 0.
fn gpu_trainer(
    args: &TrainArgs,
    trainer: &Trainer,
    settings: &Settings,
) -> Result<GpuTrainer, TrainError> {
    let attention = attention_kind(args.attention);
    let gpu = GpuTrainer::new(
        trainer,
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
    Ok(gpu)
}

/// After training: the summary, the run's JSON, the checkpoint (saved where --save says,
/// or to a fresh path), and on an interrupted run the command that resumes it.
fn finish(
    args: &TrainArgs,
    run: &RunRecord,
    ckpt: Option<Checkpoint>,
    earlier: Option<&RunRecord>,
    run_meta: &[(&str, String)],
    settings: &Settings,
    interrupted: bool,
) -> Result<ExitCode, TrainError> {
    if interrupted {
        println!(
            "interrupted after step {}: saving",
            ckpt.as_ref().map_or(0, |c| c.step)
        );
    }
    summary(run);
    if let Some(path) = &args.out {
        let run = continued(earlier, run);
        write_record(path, &run)?;
        println!(
            "run written to {} (steps {}..{})",
            path.display(),
            run.started_at_step,
            run.started_at_step + run.steps.len()
        );
    }
    let Some(ckpt) = ckpt else {
        return Ok(ExitCode::SUCCESS);
    };
    let path = match &args.save {
        Some(path) => path.clone(),
        None => fresh_checkpoint_path(ckpt.step),
    };
    ckpt.save_with(&path, run_meta)?;
    println!("checkpoint written to {}", path.display());
    if !interrupted {
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "to go on from step {} of {}, exactly where it stopped:\n  {}",
        ckpt.step,
        settings.steps,
        resume_command(&path, args.save.is_none())
    );
    // 128 + SIGINT: how a shell reports a command stopped by Ctrl-C
    Ok(ExitCode::from(130))
}

/// The run's settings from its flags, the model's default rate where --lr is not given.
fn settings_of(args: &TrainArgs, config: &Config) -> Settings {
    let lr = args.lr.unwrap_or_else(|| default_lr(config));
    Settings {
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
        documents: args.documents, // [step 09]
    }
}

/// The corpus --data names (or the default one), described, and written as tokens with
/// --save-tokens.
fn load_corpus(args: &TrainArgs) -> Result<Corpus, TrainError> {
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
    Ok(corpus)
}

/// The GPU trainer's attention for the flag.
fn attention_kind(arg: AttentionArg) -> AttentionKind {
    match arg {
        AttentionArg::Flash => AttentionKind::Flash,
        AttentionArg::ByHand => AttentionKind::ByHand,
        AttentionArg::Hopper => AttentionKind::Hopper, // [step 06]
    }
}

/// What a checkpoint keeps of the run that saved it: the settings that decide its steps
/// (not the held-out loss's, nor the time budget) and its corpus's fingerprint.
fn run_metadata(
    settings: &Settings,
    corpus: &Corpus,
    how: String,
) -> Vec<(&'static str, String)> {
    let steps_depend_on = Settings {
        eval_every: 0,
        eval_batches: 0,
        max_seconds: None,
        ..*settings
    };
    let settings = serde_json::to_string(&steps_depend_on).expect("a plain struct");
    vec![
        ("settings", settings),
        ("corpus", corpus.fingerprint()),
        ("trained", how),
    ]
}

/// What, besides the settings, decides how a step's numbers are rounded: on the CPU the
/// path, the threads (the fast path sums one shard of the batch a thread) and the
/// instructions; on the GPU the device. A run resumed elsewhere is told it differs.
fn trained_how(args: &TrainArgs) -> String {
    match args.device {
        DeviceArg::Cpu => format!(
            "cpu, the {} path, {} threads, {:?}",
            args.cpu_path
                .unwrap_or(CpuPathArg::Fast)
                .to_possible_value()
                .expect("a value")
                .get_name(),
            rayon::current_num_threads(),
            step02_online_softmax::Isa::detect()
        ),
        DeviceArg::Cuda => "cuda".into(),
    }
}

/// With --resume: where this run differs from the one that saved the checkpoint, said
/// before training, since the steps that follow are then not those that run would have
/// taken. A checkpoint from before these entries, or from a peer, says nothing.
fn resume_notes(path: &Path, now: &[(&str, String)]) -> Result<(), TrainError> {
    let saved = Checkpoint::metadata(path)?;
    let mut differ = Vec::new();
    for (key, value) in now {
        let Some(then) = saved.get(*key) else {
            continue;
        };
        if *key == "settings" {
            let (then, now): (serde_json::Value, serde_json::Value) = (
                serde_json::from_str(then).unwrap_or_default(),
                serde_json::from_str(value).expect("written above"),
            );
            differ.extend(json_differences("", &then, &now));
        } else if then != value {
            differ.push(format!("{key}: {then} then, {value} now"));
        }
    }
    if !differ.is_empty() {
        println!(
            "note: this run is not the one that saved {}, so the steps that follow are not \
             those it would have taken; it differs in\n  {}",
            path.display(),
            differ.join("\n  ")
        );
    }
    Ok(())
}
// [step 09]

/// With --resume: the checkpoint's run packed documents (`--documents`) exactly when this
/// one does, since the steps that follow would otherwise train another model than the one
/// saved. A checkpoint that does not say (from before step 09, or a peer's) was trained
/// without.
fn check_resumed_documents(path: &Path, documents: bool) -> Result<(), TrainError> {
    let saved = Checkpoint::metadata(path)?;
    let then = saved
        .get("settings")
        .and_then(|s| serde_json::from_str::<serde_json::Value>(s).ok())
        .and_then(|s| s.get("documents").and_then(serde_json::Value::as_bool))
        .unwrap_or(false);
    if then == documents {
        return Ok(());
    }
    let (with, without) = ("with --documents", "without --documents");
    let (then_how, now_how) = if then {
        (with, without)
    } else {
        (without, with)
    };
    Err(TrainError::Config(format!(
        "--resume {}: its run trained {then_how}, this one asks {now_how}; accepted: \
         --resume {} {then_how}, as the run that saved it (or train anew)",
        path.display(),
        path.display()
    )))
}
// [/step 09]

/// Every field where two JSON values differ, by its path (`schedule.max: 0.003 then,
/// 0.001 now`).
fn json_differences(
    at: &str,
    then: &serde_json::Value,
    now: &serde_json::Value,
) -> Vec<String> {
    use serde_json::Value;
    match (then, now) {
        (Value::Object(a), Value::Object(b)) => b
            .iter()
            .flat_map(|(key, b_value)| {
                let path = if at.is_empty() {
                    key.clone()
                } else {
                    format!("{at}.{key}")
                };
                match a.get(key) {
                    Some(a_value) => json_differences(&path, a_value, b_value),
                    None => vec![format!("{path}: none then, {b_value} now")],
                }
            })
            .collect(),
        (a, b) if a != b => vec![format!("{at}: {a} then, {b} now")],
        _ => Vec::new(),
    }
}

/// Every output path, checked before the corpus loads: its folder exists and takes files,
/// and it is not a folder; the message names the flag.
fn check_outputs(args: &TrainArgs) -> Result<(), TrainError> {
    let outputs = [
        ("--out", &args.out),
        ("--save", &args.save),
        ("--save-tokens", &args.save_tokens),
        ("--save-init", &args.save_init),
        ("--dump-batches", &args.dump_batches),
    ];
    for (flag, path) in outputs {
        if let Some(path) = path {
            files::check_output(flag, path)?;
        }
    }
    if let Some(path) = &args.dump_batches {
        files::check_output("--dump-batches (its .heldout)", &heldout_path(path))?;
    }
    if args.save.is_none() {
        // without --save, Ctrl-C saves into the current folder (fresh_checkpoint_path)
        files::check_output(
            "the checkpoint Ctrl-C saves without --save (train-interrupted-STEP.safetensors)",
            &fresh_checkpoint_path(0),
        )?;
    }
    if args.save_every == Some(0) {
        return Err(TrainError::Config(
            "--save-every 0: it takes a number of steps, 1 or more (leave it out to save \
             only at the end and on Ctrl-C)"
                .into(),
        ));
    }
    Ok(())
}

/// A flag that Ctrl-C, SIGTERM or SIGHUP sets; the training loop stops after the step it
/// is in. A second signal quits at once: every file is then as it was, since each is
/// written whole or not at all.
fn interrupt_flag() -> Result<&'static AtomicBool, TrainError> {
    static STOP: AtomicBool = AtomicBool::new(false);
    ctrlc::set_handler(|| {
        if STOP.swap(true, Ordering::SeqCst) {
            eprintln!("\ninterrupted again: quitting without saving");
            std::process::exit(130);
        }
        eprintln!(
            "\ninterrupted: finishing this step, then saving (Ctrl-C again to quit at once)"
        );
    })
    .map_err(|e| TrainError::Config(format!("cannot catch Ctrl-C: {e}")))?;
    Ok(&STOP)
}

/// Where an interrupted run without --save puts its checkpoint: a new file in the current
/// folder, never one that is there already.
fn fresh_checkpoint_path(step: usize) -> PathBuf {
    (0..)
        .map(|n| match n {
            0 => PathBuf::from(format!("train-interrupted-{step}.safetensors")),
            n => PathBuf::from(format!("train-interrupted-{step}-{n}.safetensors")),
        })
        .find(|p| !p.exists())
        .expect("a free name")
}

/// This command line with `--resume CHECKPOINT` (and `--save CHECKPOINT` when it had no
/// --save), less the flags that write the run's inputs (--save-tokens, --save-init,
/// --dump-batches: written already, and --save-init would be overwritten by weights that
/// are no longer the initial ones), quoted for a POSIX shell.
fn resume_command(checkpoint: &Path, add_save: bool) -> String {
    let drop = ["--resume", "--save-tokens", "--save-init", "--dump-batches"];
    let mut words: Vec<String> = Vec::new();
    let mut args = std::env::args_os().map(|a| a.to_string_lossy().into_owned());
    while let Some(arg) = args.next() {
        let name = arg.split('=').next().unwrap_or_default();
        if drop.contains(&name) {
            if !arg.contains('=') {
                args.next(); // its value
            }
            continue;
        }
        words.push(arg);
    }
    let path = checkpoint.display().to_string();
    if add_save {
        words.extend(["--save".into(), path.clone()]);
    }
    words.extend(["--resume".into(), path]);
    words
        .iter()
        .map(|w| shell_quoted(w))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `word` as a POSIX shell reads it back: as it is when it is plain, else in single quotes.
fn shell_quoted(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        return word.to_string();
    }
    format!("'{}'", word.replace('\'', r"'\''"))
}

/// The run's record as JSON, one step a line ([`flash_core::row::row_a_line`]), whole or
/// not at all.
fn write_record(path: &Path, run: &RunRecord) -> Result<(), TrainError> {
    let json = flash_core::row::to_json_row_a_line(run);
    files::write_atomic(path, json.as_bytes()).map_err(TrainError::from)
}

/// With --resume and --out: the record already in --out, if it is this run's up to the
/// checkpoint's step (the same model and settings, a step `step` in it, or started
/// there), cut at that step; the resumed run's steps are added to it. None otherwise, and
/// --out is written anew.
fn earlier_record(
    args: &TrainArgs,
    config: &Config,
    settings: &Settings,
    step: usize,
) -> Option<RunRecord> {
    let (Some(_), Some(path)) = (&args.resume, &args.out) else {
        return None;
    };
    let text = std::fs::read_to_string(path).ok()?;
    let mut run: RunRecord = serde_json::from_str(&text).ok()?;
    // the time budget is a run's own; everything else must be the same
    let same = |s: &Settings| Settings {
        max_seconds: None,
        ..*s
    };
    let reaches = run.started_at_step == step || run.steps.iter().any(|s| s.step == step);
    if run.config != *config || same(&run.settings) != same(settings) || !reaches {
        println!(
            "{} is not this run's record up to step {step}: it is written anew",
            path.display()
        );
        return None;
    }
    run.steps.retain(|s| s.step <= step);
    run.evals.retain(|e| e.step < step);
    println!(
        "{}: the run's record up to step {step}, the steps that follow are added to it",
        path.display()
    );
    Some(run)
}

/// `run` after `earlier` (see [`earlier_record`]): one record of the whole run, its
/// training seconds counted on from the earlier part's.
fn continued(earlier: Option<&RunRecord>, run: &RunRecord) -> RunRecord {
    let Some(earlier) = earlier else {
        return run.clone();
    };
    let offset = earlier.steps.last().map_or(0.0, |s| s.train_seconds);
    let mut whole = earlier.clone();
    whole.steps.extend(run.steps.iter().map(|s| StepRecord {
        train_seconds: s.train_seconds + offset,
        ..*s
    }));
    whole.evals.extend(run.evals.iter().map(|e| EvalRecord {
        train_seconds: e.train_seconds + offset,
        ..*e
    }));
    whole.seconds += run.seconds;
    whole.tokens_per_s = throughput(&whole.steps, whole.tokens_per_step);
    whole
}

// [step 07]
/// The GPUs `--gpus` asks for, checked against the device, the batch, the machine and NCCL
/// before anything loads: none for the CPU.
fn check_gpus(
    args: &TrainArgs,
) -> Result<Vec<&'static step03_cuda_forward::gpu::Gpu>, TrainError> {
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
    let there = step03_cuda_forward::gpu::Gpu::count();
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

/// Bytes free for this user in the file system of `folder`, where the platform says.
fn free_bytes(folder: &Path) -> Option<u64> {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let name = std::ffi::CString::new(folder.as_os_str().as_bytes()).ok()?;
        let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
        // SAFETY: `name` is a NUL-terminated path and `st` a place statvfs fills on success
        let st = unsafe {
            if libc::statvfs(name.as_ptr(), st.as_mut_ptr()) != 0 {
                return None;
            }
            st.assume_init()
        };
        #[allow(clippy::unnecessary_cast)] // the fields' widths differ between platforms
        Some(st.f_bavail as u64 * st.f_frsize as u64)
    }
    #[cfg(not(unix))]
    {
        let _ = folder;
        None
    }
}

/// Where `--dump-batches PATH` puts the held-out batches: `PATH.heldout`.
fn heldout_path(path: &Path) -> PathBuf {
    let mut heldout = path.as_os_str().to_owned();
    heldout.push(".heldout");
    PathBuf::from(heldout)
}

/// The windows of steps `from..settings.steps` to `path`, and of the held-out batches to
/// `path.heldout`: row-major u8, `seq_len + 1` bytes a window. The size is checked against
/// the disk before anything is written, and the windows stream to the file a step at a
/// time; the two files are written whole, both or neither.
fn dump_batches(
    path: &Path,
    corpus: &Corpus,
    settings: &Settings,
    from: usize,
) -> Result<(), TrainError> {
    use step05_train::data::{heldout_starts, train_starts, windows};
    let (batch, tokens) = (settings.batch, settings.seq_len);
    corpus.check_window(tokens)?;
    let steps = settings.steps.saturating_sub(from);
    let window = tokens as u128 + 1;
    let bytes = steps as u128 * batch as u128 * window
        + settings.eval_batches as u128 * batch as u128 * window;
    let folder = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let free = free_bytes(folder);
    if bytes > u64::MAX as u128 || free.is_some_and(|free| bytes > free as u128) {
        return Err(TrainError::Config(format!(
            "--dump-batches: {steps} steps × {batch} sequences × {window} bytes (and the \
             held-out batches) need {bytes} bytes ({:.1} GB), but {} has {}: use fewer \
             --steps or a smaller --batch or --seq-len",
            bytes as f64 / 1e9,
            folder.display(),
            free.map_or("less".into(), |f| format!(
                "{f} bytes free ({:.1} GB)",
                f as f64 / 1e9
            )),
        )));
    }
    let heldout = heldout_path(path);
    let mut staged = files::Staged::new();
    staged.add(path, |w| {
        for step in from..settings.steps {
            let starts =
                train_starts(corpus.train.len(), batch, tokens, settings.seed, step);
            w.write_all(&windows(&corpus.train, &starts, tokens))?;
        }
        Ok(())
    })?;
    staged.add(&heldout, |w| {
        let held =
            heldout_starts(corpus.heldout.len(), batch, tokens, settings.eval_batches);
        for starts in held {
            w.write_all(&windows(&corpus.heldout, &starts, tokens))?;
        }
        Ok(())
    })?;
    staged.commit()?;
    println!(
        "batches of steps {from}..{} written to {} ([{steps}, {batch}, {window}] bytes), \
         held-out to {}",
        settings.steps,
        path.display(),
        heldout.display()
    );
    Ok(())
}

fn run_sample(args: SampleArgs) -> Result<ExitCode, TrainError> {
    let ckpt = Checkpoint::load(&args.checkpoint)?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let io = |e: std::io::Error| TrainError::io(Path::new("standard output"), e);
    out.write_all(args.prompt.as_bytes()).map_err(io)?;
    // each byte printed as it is drawn, a character once its last byte is there
    let mut text = Utf8Stream::default();
    sample_each(
        &ckpt.params,
        args.prompt.as_bytes(),
        args.tokens,
        args.temperature,
        args.seed,
        |byte| {
            out.write_all(text.push(byte).as_bytes())
                .and_then(|()| out.flush())
                .map_err(io)
        },
    )?;
    writeln!(out, "{}", text.finish()).map_err(io)?;
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Train(args) => run_train(*args),
        Command::Sample(args) => run_sample(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
