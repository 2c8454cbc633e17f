//! The training loop, the held-out loss, the run's record, and sampling.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use flash_core::inputs::SplitMix64;
use serde::{Deserialize, Serialize};

use crate::TrainError;
use crate::checkpoint::Checkpoint;
use crate::data::{Batch, Corpus, heldout_batches, train_batch};
use crate::model::forward_documents; // [step 09]
use crate::model::{Config, Params, backward, forward, loss, next_token_probs};
use crate::optim::{AdamW, AdamWSettings, Schedule, clip_grad_norm};

/// How to train.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per sequence (at most the model's context).
    pub seq_len: usize,
    /// Steps of the whole run: the schedule decays to its minimum at the last.
    pub steps: usize,
    pub schedule: Schedule,
    pub adamw: AdamWSettings,
    /// The largest global norm of the gradients; larger ones are scaled down to it.
    pub clip: f32,
    /// The seed of the initial weights and of the batches.
    pub seed: u64,
    /// The held-out loss every this many steps (and before the first and after the last).
    pub eval_every: usize,
    /// Batches of the held-out loss.
    pub eval_batches: usize,
    /// A budget of training time in seconds (`--max-seconds`): the run stops after the
    /// first step that ends past it, even before `steps`. The schedule still runs over
    /// `steps`, so a faster trainer gets further along it in the same time. Held-out losses
    /// are not counted.
    #[serde(default)]
    pub max_seconds: Option<f64>,
    // [step 09]
    /// Documents packed without padding (`--documents`): a token attends to the earlier
    /// tokens of its own file only, never across a file boundary inside its window. Written
    /// only when true, so that a run without it reads as one from before step 09 (a
    /// checkpoint's settings compare equal), and false in a file without it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub documents: bool,
    // [/step 09]
}

/// One step as the run prints and records it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Steps done, counting this one.
    pub step: usize,
    pub loss: f32,
    pub lr: f32,
    /// The global norm of the gradients before clipping.
    pub grad_norm: f32,
    /// Wall-clock milliseconds of this step, from drawing its batch to its loss and
    /// gradient norm being known on the host.
    pub ms: f64,
    /// `batch · seq_len / (ms / 1000)`.
    pub tokens_per_s: f64,
    /// Seconds spent in training steps from the start of this run up to the end of this one
    /// (held-out losses not counted): the x axis of the loss against time.
    #[serde(default)]
    pub train_seconds: f64,
}

impl StepRecord {
    /// Step `step` (counting it), which took `seconds` over `tokens` tokens; the loop fills
    /// in `train_seconds`.
    pub fn timed(
        step: usize,
        loss: f32,
        lr: f32,
        grad_norm: f32,
        seconds: f64,
        tokens: usize,
    ) -> StepRecord {
        StepRecord {
            step,
            loss,
            lr,
            grad_norm,
            ms: seconds * 1e3,
            tokens_per_s: tokens as f64 / seconds,
            train_seconds: 0.0,
        }
    }
}

/// The held-out loss after `step` steps.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalRecord {
    pub step: usize,
    /// The mean loss over the held-out batches, in nats per byte.
    pub loss: f32,
    /// [`StepRecord::train_seconds`] of the step it follows (0 before the first).
    #[serde(default)]
    pub train_seconds: f64,
}

/// Where a step's time goes on the GPU (`--profile`): one phase of the step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PhaseRecord {
    /// The phase, e.g. `forward: attention` or `optimizer: adamw`.
    pub name: String,
    /// Its mean milliseconds per step, from CUDA events around it, over the profiled steps.
    pub ms: f64,
}

// ANCHOR: run_record
/// A whole run, as `--out` writes it for the charts. A peer trainer (PyTorch) writes the
/// same fields; the ones after `seconds` came with the GPU trainer and read as their
/// defaults from an older file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// The model's shape.
    pub config: Config,
    /// How it was trained: batch, sequence length, steps, schedule, optimizer, seed.
    pub settings: Settings,
    /// Numbers in the model.
    pub params: usize,
    /// Where the text came from.
    pub corpus: String,
    pub train_bytes: usize,
    pub heldout_bytes: usize,
    pub train_files: usize,
    pub heldout_files: usize,
    /// CPU threads (rayon's pool) on the CPU; on the GPU the same count, unused by the
    /// model.
    pub threads: usize,
    /// The step the run started from: 0, or a checkpoint's with `--resume`.
    pub started_at_step: usize,
    /// Every step, in order.
    pub steps: Vec<StepRecord>,
    /// Every held-out loss: before the first step, every `eval_every` steps, after the
    /// last.
    pub evals: Vec<EvalRecord>,
    /// Wall-clock seconds of the whole run, held-out losses included.
    pub seconds: f64,
    /// What trained: `step05-train` here; a peer names itself (`pytorch-eager`, say).
    #[serde(default)]
    pub trainer: String,
    /// `cpu` or `cuda`.
    #[serde(default)]
    pub device: String,
    /// The device's name: the GPU's as its driver gives it (`NVIDIA H200`), or `cpu`.
    #[serde(default)]
    pub device_name: String,
    /// The attention inside the model: ours are `flash` (online softmax and the blockwise
    /// backward: steps 02 and 04 on the CPU, the kernels of steps 03 and 04 on the GPU) and
    /// `by-hand` (the whole table of scores in memory); a peer names its own
    /// (`flash-attention-2`, `cudnn`, ...).
    #[serde(default)]
    pub attention: String,
    /// How numbers are kept: `f32` (everything, the CPU model), or `bf16-mixed` (matrix
    /// products on bf16 inputs accumulating in f32; master weights, optimizer state,
    /// gradients, LayerNorm statistics, the residual stream and the loss in f32).
    #[serde(default)]
    pub precision: String,
    /// Tokens a step trains on: `batch · seq_len`.
    #[serde(default)]
    pub tokens_per_step: usize,
    /// The run's throughput: the tokens of every step but the first over those steps'
    /// seconds (the first compiles kernels and fills caches); 0 with fewer than two steps.
    #[serde(default)]
    pub tokens_per_s: f64,
    /// The high-water mark of device memory the run allocated, in bytes: weights, optimizer
    /// state, gradients, activations, workspaces (PyTorch's
    /// `torch.cuda.max_memory_allocated`). None on the CPU.
    #[serde(default)]
    pub peak_memory_bytes: Option<u64>,
    /// The commit the trainer was built from ([`flash_core::row::COMMIT`]).
    #[serde(default)]
    pub commit: String,
    /// When the run started, UTC, `YYYY-MM-DDTHH:MM:SSZ`.
    #[serde(default)]
    pub date: String,
    /// Where a step's time went, phase by phase, with `--profile` (on the GPU); empty
    /// otherwise.
    #[serde(default)]
    pub profile: Vec<PhaseRecord>,
    // [step 07]
    /// GPUs the run trained on, a replica of the model on each (data parallelism),
    /// `--batch` split evenly over them; 1 on one device, and in a file from before step
    /// 07.
    #[serde(default = "one")]
    pub gpus: usize,
    /// With several GPUs, each GPU's all-reduce of the gradients, in milliseconds a step
    /// (the mean over the steps after the first), from CUDA events on its stream around the
    /// call: a GPU that finished its backward first waits there for the others, so the
    /// smallest is the collective's own time. Empty on one device.
    #[serde(default)]
    pub allreduce_ms: Vec<f64>,
    // [/step 07]
}
// ANCHOR_END: run_record

// [step 07]
fn one() -> usize {
    1
}
// [/step 07]

/// What the loop reports as it goes.
pub enum Event<'a> {
    Step(&'a StepRecord),
    Eval(&'a EvalRecord),
    /// A checkpoint was saved along the way (`Control::save_every`), after this many steps.
    Saved(usize),
}

/// What saves a checkpoint along the way, given it and the run's record so far.
pub type SaveFn<'a> = dyn FnMut(&Checkpoint, &RunRecord) -> Result<(), TrainError> + 'a;

/// What may stop a run before its last step, and what it saves on the way.
pub struct Control<'a> {
    /// Set from outside (by Ctrl-C or SIGTERM): the loop finishes the step it is in and
    /// returns, without its held-out loss, so that what it did can be saved.
    pub interrupt: Option<&'a AtomicBool>,
    /// Every this many steps (counted from 0, not from the resumed step), hand a
    /// checkpoint to `save`; 0: never.
    pub save_every: usize,
    /// Where a checkpoint along the way goes, with the run's record so far.
    pub save: Option<&'a mut SaveFn<'a>>,
}

impl Control<'_> {
    /// Runs to the end: nothing stops it, nothing is saved on the way.
    pub fn none() -> Control<'static> {
        Control {
            interrupt: None,
            save_every: 0,
            save: None,
        }
    }

    fn interrupted(&self) -> bool {
        self.interrupt
            .is_some_and(|flag| flag.load(Ordering::SeqCst))
    }
}

/// The hardware a run trained on and how, for its record.
#[derive(Clone, Debug, PartialEq)]
pub struct Hardware {
    /// `cpu` or `cuda`.
    pub device: String,
    /// The GPU's name, or `cpu`.
    pub device_name: String,
    /// `flash` or `by-hand`.
    pub attention: String,
    /// `f32` or `bf16-mixed`.
    pub precision: String,
}

/// What the loop trains: the CPU model ([`Trainer`]), or the GPU one.
pub trait Learner {
    /// The model's shape.
    fn config(&self) -> Config;
    /// Steps done so far.
    fn steps_done(&self) -> usize;
    /// Numbers in the model.
    fn params_count(&self) -> usize;
    /// One training step at `settings`: its batch, forward, backward, clipping, AdamW.
    fn train_step(
        &mut self,
        corpus: &Corpus,
        settings: &Settings,
    ) -> Result<StepRecord, TrainError>;
    /// The mean loss over the given batches, without training.
    fn heldout_loss(&mut self, batches: &[Batch]) -> Result<f32, TrainError>;
    /// Where and how it trains.
    fn hardware(&self) -> Hardware;
    /// What trained, as the record names it: `step05-train`, the readable CPU model and the
    /// GPU trainer; the CPU's fast path is `step05-train-fast`.
    fn trainer(&self) -> &'static str {
        "step05-train"
    }
    /// The high-water mark of device memory so far, where there is a device.
    fn peak_memory_bytes(&self) -> Result<Option<u64>, TrainError> {
        Ok(None)
    }
    /// Where the profiled steps' time went, if any were profiled.
    fn profile(&self) -> Vec<PhaseRecord> {
        Vec::new()
    }
    // [step 07]
    /// GPUs it trains on, a replica of the model on each.
    fn gpus(&self) -> usize {
        1
    }
    /// Each GPU's all-reduce of the gradients, milliseconds a step (see
    /// [`RunRecord::allreduce_ms`]); empty on one device.
    fn allreduce_ms(&self) -> Vec<f64> {
        Vec::new()
    }
    // [/step 07]
    /// The weights, the optimizer's state and the step, on the host, to be saved (on the
    /// GPU, copied back).
    fn checkpoint(&self) -> Result<Checkpoint, TrainError>;
    // [step 09]
    /// Whether it honours `Settings::documents`, the mask of packed documents: the CPU's
    /// two paths do; the GPU trainers' kernels are causal over the whole window.
    fn packs_documents(&self) -> bool {
        false
    }
    // [/step 09]
}

/// A model, its optimizer and how far it has trained, on the CPU.
#[derive(Clone, Debug, PartialEq)]
pub struct Trainer {
    pub params: Params<f32>,
    pub opt: AdamW,
    /// Steps done.
    pub step: usize,
}

impl Trainer {
    /// A new model, initialised from the settings' seed.
    pub fn new(config: Config, settings: &Settings) -> Result<Trainer, TrainError> {
        Ok(Trainer {
            params: Params::init(config, settings.seed)?,
            opt: AdamW::new(config, settings.adamw),
            step: 0,
        })
    }

    // ANCHOR: train_step
    /// One step: the batch of this step, forward, backward, clipping, AdamW at the
    /// schedule's rate.
    pub fn train_step(
        &mut self,
        corpus: &Corpus,
        settings: &Settings,
    ) -> Result<StepRecord, TrainError> {
        let started = Instant::now();
        let Batch {
            inputs,
            targets,
            .. // [step 09]
        } = train_batch(
            &corpus.train,
            settings.batch,
            settings.seq_len,
            settings.seed,
            self.step,
        );
        // [step 09]
        // --documents: the same windows, each token blind to the files before its own
        let (batch, tokens, seed) = (settings.batch, settings.seq_len, settings.seed);
        let documents = settings
            .documents
            .then(|| corpus.train_documents(batch, tokens, seed, self.step));
        let forward = |p, inputs| forward_documents(p, inputs, documents.as_ref());
        // [/step 09]
        let acts = forward(&self.params, inputs.view())?;
        let loss = loss(&acts, targets.view());
        let mut grads = backward(&self.params, &acts, inputs.view(), targets.view())?;
        let grad_norm = clip_grad_norm(&mut grads, settings.clip);
        let lr = settings.schedule.lr(self.step);
        self.opt.step(&mut self.params, &grads, lr);
        self.step += 1;
        let seconds = started.elapsed().as_secs_f64();
        Ok(StepRecord::timed(
            self.step,
            loss,
            lr,
            grad_norm,
            seconds,
            settings.batch * settings.seq_len,
        ))
    }
    // ANCHOR_END: train_step

    /// The mean loss over the given batches.
    pub fn heldout_loss(&self, batches: &[Batch]) -> Result<f32, TrainError> {
        let mut sum = 0.0;
        for b in batches {
            // [step 09]
            let forward = |p, inputs| match &b.documents {
                Some(documents) => forward_documents(p, inputs, Some(documents)),
                None => forward(p, inputs),
            };
            // [/step 09]
            let acts = forward(&self.params, b.inputs.view())?;
            sum += loss(&acts, b.targets.view()) as f64;
        }
        Ok((sum / batches.len() as f64) as f32)
    }
}

impl Learner for Trainer {
    fn config(&self) -> Config {
        self.params.config
    }

    fn steps_done(&self) -> usize {
        self.step
    }

    fn params_count(&self) -> usize {
        self.params.count()
    }

    fn train_step(
        &mut self,
        corpus: &Corpus,
        settings: &Settings,
    ) -> Result<StepRecord, TrainError> {
        Trainer::train_step(self, corpus, settings)
    }

    fn heldout_loss(&mut self, batches: &[Batch]) -> Result<f32, TrainError> {
        Trainer::heldout_loss(self, batches)
    }

    fn hardware(&self) -> Hardware {
        Hardware {
            device: "cpu".into(),
            device_name: "cpu".into(),
            attention: "flash".into(),
            precision: "f32".into(),
        }
    }

    fn checkpoint(&self) -> Result<Checkpoint, TrainError> {
        Ok(Checkpoint {
            params: self.params.clone(),
            opt: Some(self.opt.clone()),
            step: self.step,
        })
    }
    // [step 09]

    fn packs_documents(&self) -> bool {
        true
    }
    // [/step 09]
}

/// Checks the settings against the model and the corpus.
pub fn check(
    config: &Config,
    settings: &Settings,
    corpus: &Corpus,
) -> Result<(), TrainError> {
    if settings.seq_len > config.context {
        return Err(TrainError::Config(format!(
            "--seq-len {} is longer than the model's context of {}: the model has positions \
             0..{} only",
            settings.seq_len, config.context, config.context
        )));
    }
    if settings.batch == 0 || settings.seq_len == 0 || settings.eval_batches == 0 {
        return Err(TrainError::Config(
            "--batch, --seq-len and --eval-batches must each be at least 1".into(),
        ));
    }
    corpus.check_window(settings.seq_len)
}

/// Trains from the learner's step to `settings.steps` (or until `settings.max_seconds` of
/// training), telling `report` of every step and every held-out loss.
pub fn train<L: Learner + ?Sized>(
    learner: &mut L,
    corpus: &Corpus,
    settings: &Settings,
    report: impl FnMut(Event),
) -> Result<RunRecord, TrainError> {
    train_with(learner, corpus, settings, Control::none(), report)
}

/// [`train`], stopped early by `control.interrupt` (after the step it is in) and saving a
/// checkpoint every `control.save_every` steps.
///
/// A step depends only on the learner's state and its step number: its batch on the seed
/// and the step ([`train_batch`]), its rate on the step ([`Schedule::lr`]), AdamW's bias
/// correction on the optimizer's count of steps, which the checkpoint keeps. So a run
/// stopped at any step, saved and resumed, takes the steps, bit for bit, of a run that
/// never stopped.
pub fn train_with<L: Learner + ?Sized>(
    learner: &mut L,
    corpus: &Corpus,
    settings: &Settings,
    mut control: Control,
    mut report: impl FnMut(Event),
) -> Result<RunRecord, TrainError> {
    let config = learner.config();
    check(&config, settings, corpus)?;
    let started = Instant::now();
    let heldout = heldout_batches(
        &corpus.heldout,
        settings.batch,
        settings.seq_len,
        settings.eval_batches,
    );
    // [step 09]
    let heldout = match settings.documents {
        true => {
            if !learner.packs_documents() {
                return Err(TrainError::Config(format!(
                    "--documents: {} attends causally across the whole window; accepted: \
                     the CPU model (--device cpu, either --cpu-path)",
                    learner.trainer()
                )));
            }
            corpus.check_documents()?;
            let (batch, tokens) = (settings.batch, settings.seq_len);
            corpus.heldout_batches_documents(batch, tokens, settings.eval_batches)
        }
        false => heldout,
    };
    // [/step 09]
    let mut run = new_record(learner, corpus, settings);
    let mut train_seconds = 0.0;
    let eval = |learner: &mut L, train_seconds: f64| -> Result<EvalRecord, TrainError> {
        Ok(EvalRecord {
            step: learner.steps_done(),
            loss: learner.heldout_loss(&heldout)?,
            train_seconds,
        })
    };
    let first = eval(learner, train_seconds)?;
    report(Event::Eval(&first));
    run.evals.push(first);
    let every = settings.eval_every.max(1);
    let out_of_time = |t: f64| settings.max_seconds.is_some_and(|max| t >= max);
    while learner.steps_done() < settings.steps
        && !out_of_time(train_seconds)
        && !control.interrupted()
    {
        let step = learner.steps_done();
        let mut record = learner
            .train_step(corpus, settings)
            .map_err(|e| diverged(e, step))?;
        if !record.loss.is_finite() || !record.grad_norm.is_finite() {
            return Err(diverged_at(step + 1, &record));
        }
        train_seconds += record.ms / 1e3;
        record.train_seconds = train_seconds;
        report(Event::Step(&record));
        run.steps.push(record);
        if control.interrupted() {
            // asked to stop: no held-out loss, the caller saves at once
            break;
        }
        let step = learner.steps_done();
        if step.is_multiple_of(every)
            || step == settings.steps
            || out_of_time(train_seconds)
        {
            let e = eval(learner, train_seconds)?;
            report(Event::Eval(&e));
            run.evals.push(e);
        }
        if let Some(save) = control.save.as_mut()
            && control.save_every > 0
            && step.is_multiple_of(control.save_every)
            && step < settings.steps
        {
            run.seconds = started.elapsed().as_secs_f64();
            run.tokens_per_s = throughput(&run.steps, run.tokens_per_step);
            save(&learner.checkpoint()?, &run)?;
            report(Event::Saved(step));
        }
    }
    run.seconds = started.elapsed().as_secs_f64();
    run.tokens_per_s = throughput(&run.steps, run.tokens_per_step);
    run.peak_memory_bytes = learner.peak_memory_bytes()?;
    run.profile = learner.profile();
    run.allreduce_ms = learner.allreduce_ms(); // [step 07]
    Ok(run)
}

/// A run's record before its first step: the model, the settings, the corpus and the
/// hardware, with no step, evaluation or timing yet.
fn new_record<L: Learner + ?Sized>(
    learner: &L,
    corpus: &Corpus,
    settings: &Settings,
) -> RunRecord {
    let hw = learner.hardware();
    RunRecord {
        config: learner.config(),
        settings: *settings,
        params: learner.params_count(),
        corpus: corpus.source.clone(),
        train_bytes: corpus.train.len(),
        heldout_bytes: corpus.heldout.len(),
        train_files: corpus.train_files,
        heldout_files: corpus.heldout_files,
        threads: rayon::current_num_threads(),
        started_at_step: learner.steps_done(),
        steps: Vec::new(),
        evals: Vec::new(),
        seconds: 0.0,
        trainer: learner.trainer().into(),
        device: hw.device,
        device_name: hw.device_name,
        attention: hw.attention,
        precision: hw.precision,
        tokens_per_step: settings.batch * settings.seq_len,
        tokens_per_s: 0.0,
        peak_memory_bytes: None,
        commit: flash_core::row::COMMIT.into(),
        date: flash_core::row::utc_now(),
        profile: Vec::new(),
        gpus: learner.gpus(),     // [step 07]
        allreduce_ms: Vec::new(), // [step 07]
    }
}

/// A step's failure on numbers that are no longer finite said as what it is: the run
/// diverged (the attention would report only its non-finite input).
fn diverged(e: TrainError, step: usize) -> TrainError {
    match e {
        TrainError::Attention(flash_core::AttnError::NonFinite { what }) => {
            TrainError::Config(format!(
                "step {}: the run diverged, the model's numbers are no longer finite ({what}); \
                 train again from the last checkpoint with a smaller --lr or --clip",
                step + 1
            ))
        }
        e => e,
    }
}

/// The error for a step whose loss or gradient norm is not finite.
fn diverged_at(step: usize, record: &StepRecord) -> TrainError {
    TrainError::Config(format!(
        "step {step}: the run diverged (loss {}, gradient norm {}); nothing of this step is \
         saved: train again from the last checkpoint with a smaller --lr or --clip",
        record.loss, record.grad_norm
    ))
}

/// Tokens a second over every step but the first (see [`RunRecord::tokens_per_s`]).
pub fn throughput(steps: &[StepRecord], tokens_per_step: usize) -> f64 {
    if steps.len() < 2 {
        return 0.0;
    }
    let seconds: f64 = steps[1..].iter().map(|s| s.ms / 1e3).sum();
    (steps.len() - 1) as f64 * tokens_per_step as f64 / seconds
}

/// `count` tokens after `prompt`, each drawn from the model's distribution sharpened by
/// `temperature` (0: always the likeliest), from a stream of `seed`.
pub fn sample(
    params: &Params<f32>,
    prompt: &[u8],
    count: usize,
    temperature: f32,
    seed: u64,
) -> Result<Vec<u8>, TrainError> {
    let mut out = Vec::with_capacity(count);
    sample_each(params, prompt, count, temperature, seed, |t| {
        out.push(t);
        Ok(())
    })?;
    Ok(out)
}

/// [`sample`], handing each token to `each` as soon as it is drawn (`sample` prints as it
/// goes).
pub fn sample_each(
    params: &Params<f32>,
    prompt: &[u8],
    count: usize,
    temperature: f32,
    seed: u64,
    mut each: impl FnMut(u8) -> Result<(), TrainError>,
) -> Result<(), TrainError> {
    check_temperature(temperature)?;
    let mut rng = SplitMix64::new(seed);
    let mut tokens = prompt.to_vec();
    for _ in 0..count {
        let probs = next_token_probs(params, &tokens)?;
        let probs = probs.as_slice().expect("one row");
        check_probs(probs)?;
        let next = pick(probs, temperature, &mut rng);
        tokens.push(next);
        each(next)?;
    }
    Ok(())
}

/// An error unless `temperature` is a number of 0 or more (0: always the likeliest).
pub fn check_temperature(temperature: f32) -> Result<(), TrainError> {
    if temperature.is_nan() || temperature < 0.0 || temperature.is_infinite() {
        return Err(TrainError::Config(format!(
            "a temperature of {temperature}: it takes a finite number, 0 or more (0 always \
             takes the likeliest byte)"
        )));
    }
    Ok(())
}

/// An error unless the model's distribution is made of numbers: a model with a NaN
/// somewhere gives NaN probabilities, and a draw from them means nothing.
pub fn check_probs(probs: &[f32]) -> Result<(), TrainError> {
    if probs.iter().any(|p| !p.is_finite()) {
        return Err(TrainError::Config(
            "the model's probabilities of the next byte are not all finite: its weights \
             hold a NaN or an infinity, or overflow on this prompt"
                .into(),
        ));
    }
    Ok(())
}

/// The next token from the model's distribution `probs`: the likeliest at `temperature` 0
/// (the first of equals), otherwise a draw from `p^(1/τ)` renormalised, taking one number
/// of `rng`.
///
/// The weights are computed in log space, `e^((ln p − ln p_max) / τ)`: the likeliest byte
/// weighs exactly 1 at any `τ`, and the others less. `p^(1/τ)` itself underflows to 0 for
/// every byte once `τ` is small (`0.5^(1/10⁻⁶)`), and a draw from all-zero weights would
/// take whatever byte the loop ends on; in log space a small `τ` tends to the likeliest
/// byte, as it should.
pub fn pick(probs: &[f32], temperature: f32, rng: &mut SplitMix64) -> u8 {
    let likeliest = probs
        .iter()
        .enumerate()
        .fold(
            (0, f32::MIN),
            |best, (i, &p)| if p > best.1 { (i, p) } else { best },
        )
        .0;
    if temperature <= 0.0 {
        return likeliest as u8;
    }
    let ln_max = (probs[likeliest] as f64).ln();
    let inv_t = 1.0 / temperature as f64;
    // each weight in (0, 1], 1 for the likeliest; p = 0 gives ln p = −∞ and weight 0
    let weights: Vec<f64> = probs
        .iter()
        .map(|&p| (((p as f64).ln() - ln_max) * inv_t).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut u = rng.next_unit() * total;
    let mut pick = likeliest;
    for (i, w) in weights.iter().enumerate() {
        if u <= *w && *w > 0.0 {
            pick = i;
            break;
        }
        u -= w;
    }
    pick as u8
}

/// Bytes to text as they come, as [`String::from_utf8_lossy`] would show them all at the
/// end: a character split over several bytes waits for its last byte, and bytes that can
/// never be UTF-8 become U+FFFD.
#[derive(Debug, Default)]
pub struct Utf8Stream {
    /// Bytes of a character begun but not finished.
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// The text that `byte` completes (often empty, while a character is unfinished).
    pub fn push(&mut self, byte: u8) -> String {
        self.pending.push(byte);
        let mut text = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    text.push_str(s);
                    self.pending.clear();
                    return text;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    text.push_str(
                        std::str::from_utf8(&self.pending[..good]).expect("valid"),
                    );
                    match e.error_len() {
                        // unfinished: wait for the next byte
                        None => {
                            self.pending.drain(..good);
                            return text;
                        }
                        Some(bad) => {
                            text.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..good + bad);
                        }
                    }
                }
            }
        }
    }

    /// What is left at the end: U+FFFD for a character never finished.
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}
