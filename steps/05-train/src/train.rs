//! The training loop, the held-out loss, the run's record, and sampling.

use std::time::Instant;

use flash_core::inputs::SplitMix64;
use serde::{Deserialize, Serialize};

use crate::TrainError;
use crate::data::{Batch, Corpus, heldout_batches, train_batch};
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
    pub ms: f64,
    pub tokens_per_s: f64,
}

/// The held-out loss after `step` steps.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalRecord {
    pub step: usize,
    pub loss: f32,
}

/// A whole run, as `--out` writes it for the charts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    pub config: Config,
    pub settings: Settings,
    pub params: usize,
    pub corpus: String,
    pub train_bytes: usize,
    pub heldout_bytes: usize,
    pub train_files: usize,
    pub heldout_files: usize,
    pub threads: usize,
    pub started_at_step: usize,
    pub steps: Vec<StepRecord>,
    pub evals: Vec<EvalRecord>,
    pub seconds: f64,
}

/// What the loop reports as it goes.
pub enum Event<'a> {
    Step(&'a StepRecord),
    Eval(&'a EvalRecord),
}

/// A model, its optimizer and how far it has trained.
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
        let Batch { inputs, targets } = train_batch(
            &corpus.train,
            settings.batch,
            settings.seq_len,
            settings.seed,
            self.step,
        );
        let acts = forward(&self.params, inputs.view())?;
        let loss = loss(&acts, targets.view());
        let mut grads = backward(&self.params, &acts, inputs.view(), targets.view())?;
        let grad_norm = clip_grad_norm(&mut grads, settings.clip);
        let lr = settings.schedule.lr(self.step);
        self.opt.step(&mut self.params, &grads, lr);
        self.step += 1;
        let seconds = started.elapsed().as_secs_f64();
        Ok(StepRecord {
            step: self.step,
            loss,
            lr,
            grad_norm,
            ms: seconds * 1e3,
            tokens_per_s: (settings.batch * settings.seq_len) as f64 / seconds,
        })
    }
    // ANCHOR_END: train_step

    /// The mean loss over the given batches.
    pub fn heldout_loss(&self, batches: &[Batch]) -> Result<f32, TrainError> {
        let mut sum = 0.0;
        for b in batches {
            let acts = forward(&self.params, b.inputs.view())?;
            sum += loss(&acts, b.targets.view()) as f64;
        }
        Ok((sum / batches.len() as f64) as f32)
    }
}

/// Checks the settings against the model and the corpus.
pub fn check(config: &Config, settings: &Settings, corpus: &Corpus) -> Result<(), TrainError> {
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

/// Trains from `trainer.step` to `settings.steps`, telling `report` of every step and every
/// held-out loss.
pub fn train(
    trainer: &mut Trainer,
    corpus: &Corpus,
    settings: &Settings,
    mut report: impl FnMut(Event),
) -> Result<RunRecord, TrainError> {
    let config = trainer.params.config;
    check(&config, settings, corpus)?;
    let started = Instant::now();
    let heldout = heldout_batches(
        &corpus.heldout,
        settings.batch,
        settings.seq_len,
        settings.eval_batches,
    );
    let mut run = RunRecord {
        config,
        settings: *settings,
        params: trainer.params.count(),
        corpus: corpus.source.clone(),
        train_bytes: corpus.train.len(),
        heldout_bytes: corpus.heldout.len(),
        train_files: corpus.train_files,
        heldout_files: corpus.heldout_files,
        threads: rayon::current_num_threads(),
        started_at_step: trainer.step,
        steps: Vec::new(),
        evals: Vec::new(),
        seconds: 0.0,
    };
    let eval = |trainer: &Trainer| -> Result<EvalRecord, TrainError> {
        Ok(EvalRecord {
            step: trainer.step,
            loss: trainer.heldout_loss(&heldout)?,
        })
    };
    let first = eval(trainer)?;
    report(Event::Eval(&first));
    run.evals.push(first);
    let every = settings.eval_every.max(1);
    while trainer.step < settings.steps {
        let record = trainer.train_step(corpus, settings)?;
        report(Event::Step(&record));
        run.steps.push(record);
        if trainer.step.is_multiple_of(every) || trainer.step == settings.steps {
            let e = eval(trainer)?;
            report(Event::Eval(&e));
            run.evals.push(e);
        }
    }
    run.seconds = started.elapsed().as_secs_f64();
    Ok(run)
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
    let mut rng = SplitMix64::new(seed);
    let mut tokens = prompt.to_vec();
    for _ in 0..count {
        let probs = next_token_probs(params, &tokens)?;
        let next = if temperature <= 0.0 {
            probs
                .iter()
                .enumerate()
                .fold(
                    (0, f32::MIN),
                    |best, (i, &p)| if p > best.1 { (i, p) } else { best },
                )
                .0
        } else {
            // p^(1/τ), renormalised: the softmax of the logits divided by τ
            let weights: Vec<f64> = probs
                .iter()
                .map(|&p| (p as f64).powf(1.0 / temperature as f64))
                .collect();
            let total: f64 = weights.iter().sum();
            let mut u = rng.next_unit() * total;
            let mut pick = weights.len() - 1;
            for (i, w) in weights.iter().enumerate() {
                if u <= *w {
                    pick = i;
                    break;
                }
                u -= w;
            }
            pick
        };
        tokens.push(next as u8);
    }
    Ok(tokens[prompt.len()..].to_vec())
}
