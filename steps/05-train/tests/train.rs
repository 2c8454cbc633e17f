//! Training, end to end, at a size CI can afford: a small model on this repository's own
//! text (the Rust sources of its steps and the book's chapters) must learn, and a run must
//! be reproducible from its seed: the same split, the same batches, a checkpoint that
//! round-trips bit for bit, and a resumed run that gives the losses of one that never
//! stopped.

use std::path::{Path, PathBuf};
use std::time::Instant;

use step05_train::data::{files_under, heldout_batches, train_batch};
use step05_train::fast::FastCpu;
use step05_train::optim::{AdamWSettings, Schedule};
use step05_train::{Checkpoint, Config, Corpus, Settings, Trainer, train};

/// The repository's root, from this package's folder (`steps/05-train`): where it was
/// built, or, for a test binary copied to another machine, the folder it runs in (cargo and
/// the GPU runner both start a test binary in its package's folder).
fn repo() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR"));
    let package = if built.is_dir() {
        built.to_path_buf()
    } else {
        PathBuf::from(".")
    };
    package.join("../..")
}

/// This repository's text: every step's Rust sources and the book's chapters.
fn repo_text() -> Corpus {
    let root = repo();
    let mut files = Vec::new();
    files_under(&root.join("steps"), &[".rs"], &mut files).unwrap();
    files_under(&root.join("book/src"), &[".md"], &mut files).unwrap();
    files.sort();
    Corpus::from_files("this repository's .rs and .md files".into(), &root, &files).unwrap()
}

const SMALL: Config = Config {
    layers: 2,
    d_model: 64,
    heads: 4,
    kv_heads: 4, // [step 08]
    context: 64,
    vocab: 256,
};

fn settings(steps: usize) -> Settings {
    Settings {
        batch: 8,
        seq_len: 64,
        steps,
        schedule: Schedule {
            max: 3e-3,
            min: 3e-4,
            warmup: 20,
            steps,
        },
        adamw: AdamWSettings::default(),
        clip: 1.0,
        seed: 1337,
        eval_every: 100,
        eval_batches: 4,
        max_seconds: None,
        documents: false, // [step 09]
    }
}

#[test]
fn a_small_model_learns_this_repositorys_text() {
    let corpus = repo_text();
    let settings = Settings {
        eval_every: 400,
        ..settings(400)
    };
    let started = Instant::now();
    let mut model = Trainer::new(SMALL, &settings).unwrap();
    let mut trainer = FastCpu::new(&mut model);
    let run = train(&mut trainer, &corpus, &settings, |_| {}).unwrap();
    let seconds = started.elapsed().as_secs_f64();
    let (first, last) = (run.evals[0].loss, run.evals.last().unwrap().loss);
    eprintln!(
        "{} training and {} held-out bytes ({} and {} files); held-out loss {first:.3} → {last:.3} in {} steps, {seconds:.1} s",
        corpus.train.len(),
        corpus.heldout.len(),
        corpus.train_files,
        corpus.heldout_files,
        run.steps.len()
    );
    // knowing nothing is ln 256 = 5.55 nats a byte
    assert!(
        (first - 256f32.ln()).abs() < 0.1,
        "an untrained model's loss {first}"
    );
    // knowing only how often each byte occurs in the training text (about 3.6 here), the
    // model must do clearly better: it has learned from the bytes before each one.
    // It trains on the CPU's fast path, what `train` runs by default (`fast_path.rs` checks
    // it step by step against the readable model). Measured: 2.67 after 400 steps (120,576
    // weights, 205k tokens seen) in 4 s in the dev profile on 2 cores; the readable model
    // takes 17 s.
    let unigram = unigram_loss(&corpus);
    assert!(
        last < 3.3 && last < unigram - 0.25,
        "held-out loss {last} after {} steps; byte frequencies alone give {unigram:.3}",
        run.steps.len()
    );
}

/// The held-out loss of the best model that ignores context: each byte's frequency in the
/// training text (add-one smoothed).
fn unigram_loss(corpus: &Corpus) -> f32 {
    let mut counts = [1.0f64; 256];
    for &b in &corpus.train {
        counts[b as usize] += 1.0;
    }
    let total: f64 = counts.iter().sum();
    let sum: f64 = corpus
        .heldout
        .iter()
        .map(|&b| -(counts[b as usize] / total).ln())
        .sum();
    (sum / corpus.heldout.len() as f64) as f32
}

#[test]
fn the_split_and_the_batches_depend_only_on_the_seed() {
    let (a, b) = (repo_text(), repo_text());
    assert_eq!(a, b);
    assert!(a.heldout_files >= 1 && a.train_files > a.heldout_files);
    let one = train_batch(&a.train, 4, 16, 7, 3);
    assert_eq!(one, train_batch(&b.train, 4, 16, 7, 3));
    assert_ne!(
        one,
        train_batch(&a.train, 4, 16, 7, 4),
        "another step, another batch"
    );
    assert_ne!(
        one,
        train_batch(&a.train, 4, 16, 8, 3),
        "another seed, another batch"
    );
    // the targets are the inputs one byte later
    assert_eq!(
        one.inputs.slice(ndarray::s![.., 1..]),
        one.targets.slice(ndarray::s![.., ..15])
    );
    assert_eq!(
        heldout_batches(&a.heldout, 4, 16, 3),
        heldout_batches(&b.heldout, 4, 16, 3)
    );
}

#[test]
fn a_token_file_gives_back_the_corpus() {
    let corpus = repo_text();
    let path =
        std::env::temp_dir().join(format!("step05-tokens-{}.bin", std::process::id()));
    corpus.save(&path).unwrap();
    let back = Corpus::load(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!((back.train, back.heldout), (corpus.train, corpus.heldout));
    assert_eq!(
        (back.train_files, back.heldout_files),
        (corpus.train_files, corpus.heldout_files)
    );
}

#[test]
fn resuming_from_a_checkpoint_gives_the_losses_of_a_run_that_never_stopped() {
    let corpus = repo_text();
    let tiny = Config {
        layers: 1,
        d_model: 32,
        heads: 2,
        kv_heads: 2, // [step 08]
        context: 32,
        vocab: 256,
    };
    let settings = Settings {
        batch: 4,
        seq_len: 32,
        ..settings(12)
    };
    let mut straight = Trainer::new(tiny, &settings).unwrap();
    let all = train(&mut straight, &corpus, &settings, |_| {}).unwrap();

    let mut first = Trainer::new(tiny, &settings).unwrap();
    let half = Settings {
        steps: 6,
        ..settings
    };
    // the first half runs under the whole run's schedule, stopped at step 6
    while first.step < half.steps {
        first.train_step(&corpus, &settings).unwrap();
    }
    let path = std::env::temp_dir()
        .join(format!("step05-ckpt-{}.safetensors", std::process::id()));
    let saved = Checkpoint {
        params: first.params.clone(),
        opt: Some(first.opt.clone()),
        step: first.step,
    };
    saved.save(&path).unwrap();
    let loaded = Checkpoint::load(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    // bit for bit: every weight and both moments
    assert_eq!(loaded, saved);
    for ((_, a), (_, b)) in loaded
        .params
        .tensors()
        .iter()
        .zip(saved.params.tensors().iter())
    {
        assert!(
            a.iter()
                .zip(b.iter())
                .all(|(x, y)| x.to_bits() == y.to_bits())
        );
    }
    let mut resumed = Trainer {
        params: loaded.params,
        opt: loaded.opt.unwrap(),
        step: loaded.step,
    };
    let rest = train(&mut resumed, &corpus, &settings, |_| {}).unwrap();
    let bits = |r: &[step05_train::train::StepRecord]| {
        r.iter().map(|s| s.loss.to_bits()).collect::<Vec<_>>()
    };
    assert_eq!(bits(&rest.steps), bits(&all.steps[6..]));
    assert_eq!(resumed.params, straight.params);

    // a checkpoint of another model is refused, saying which
    let other = Config { layers: 2, ..tiny };
    let err = saved.check_config(&other).unwrap_err().to_string();
    assert!(
        err.contains("layers: 1") && err.contains("layers: 2"),
        "{err}"
    );
}

#[test]
fn bad_data_and_lengths_are_refused_with_a_reason() {
    let err = Corpus::load(Path::new("/no/such/corpus"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("no such file or folder"), "{err}");
    let empty =
        std::env::temp_dir().join(format!("step05-empty-{}.txt", std::process::id()));
    std::fs::write(&empty, b"").unwrap();
    let err = Corpus::load(&empty).unwrap_err().to_string();
    std::fs::remove_file(&empty).unwrap();
    assert!(err.contains("0 bytes"), "{err}");
    let corpus = repo_text();
    let long = Settings {
        seq_len: 65,
        ..settings(1)
    };
    let mut trainer = Trainer::new(SMALL, &long).unwrap();
    let err = train(&mut trainer, &corpus, &long, |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("longer than the model's context of 64"),
        "{err}"
    );
}
