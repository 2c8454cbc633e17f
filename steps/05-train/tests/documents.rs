//! `train --documents`: files packed into a window without padding, each token attending to
//! the earlier tokens of its own file only, through step 09's document mask.
//!
//! A token after a file boundary is blind to the file before it (its prediction does not
//! move when that file's bytes change, and does without the mask); one step's loss and
//! gradients on windows across a boundary differ from the causal model's; the fast path
//! agrees with the readable model; and the whole model with the mask, in `f64` with step
//! 09's reference inside, matches central differences of its loss and the `f32` model with
//! step 09's CPU kernels inside. The trainer's binary refuses the flag where it cannot work.

mod common;

use ndarray::Array2;
use step05_train::data::{train_batch, train_starts, window_documents};
use step05_train::fast::{FastCpu, loss_and_grads_documents};
use step05_train::model::forward_documents;
use step05_train::optim::{AdamWSettings, Schedule};
use step05_train::train::Learner;
use step05_train::{
    Checkpoint, Config, Corpus, Params, Settings, Trainer, backward, loss, train,
};
use step09_masks::Documents;

const TINY: Config = Config {
    layers: 2,
    d_model: 32,
    heads: 4,
    kv_heads: 4,
    context: 24,
    vocab: 256,
};

/// Tokens a window.
const T: usize = 24;

/// GPT-2's initialisation, every number then moved a little (as `tests/fast_path.rs`), so
/// that each term of every gradient counts.
fn weights(config: Config) -> Params<f32> {
    let mut p = Params::<f32>::init(config, 7).unwrap();
    let mut rng = flash_core::inputs::SplitMix64::new(8);
    for (_, mut t) in p.tensors_mut() {
        t.mapv_inplace(|x| x + 0.05 * rng.next_normal() as f32);
    }
    p
}

/// Windows of the test corpus's training text at `starts`, their targets, and the file of
/// each token.
fn windows(corpus: &Corpus, starts: &[usize]) -> (Array2<u8>, Array2<u8>, Documents) {
    let at = |from: usize| {
        Array2::from_shape_fn((starts.len(), T), |(b, t)| {
            corpus.train[starts[b] + t + from]
        })
    };
    let documents = window_documents(&corpus.train_file_starts, starts, T);
    (at(0), at(1), documents)
}

/// Three windows: across the first boundary (10 tokens of the first file, 14 of the
/// second), across the second (5 and 19), and one inside the third file.
fn across_boundaries(corpus: &Corpus) -> [usize; 3] {
    let f = &corpus.train_file_starts;
    [f[1] - 10, f[2] - 5, f[2] + 100]
}

#[test]
fn a_windows_ids_count_the_files_it_crosses() {
    let corpus = common::corpus();
    let (_, _, docs) = windows(&corpus, &across_boundaries(&corpus));
    let want: Vec<i32> = [10, 5, T]
        .iter()
        .flat_map(|&first| (0..T).map(move |t| i32::from(t >= first)))
        .collect();
    assert_eq!(docs.ids(), want.as_slice());
    // a window that starts on a boundary is one file
    let starts = [corpus.train_file_starts[1]];
    let docs = window_documents(&corpus.train_file_starts, &starts, T);
    assert!(docs.ids().iter().all(|&id| id == 0), "{:?}", docs.ids());
}

// ANCHOR: blind_across_files
#[test]
fn a_token_after_a_file_boundary_is_blind_to_the_file_before() {
    let corpus = common::corpus();
    let p = weights(TINY);
    let (inputs, _, docs) = windows(&corpus, &across_boundaries(&corpus));
    // the first window's first file, 10 bytes, replaced
    let mut other = inputs.clone();
    for t in 0..10 {
        other[[0, t]] = b'#';
    }
    // the largest change of the probabilities at positions 10.. of the first window
    let moved = |docs: Option<&Documents>| {
        let a = forward_documents(&p, inputs.view(), docs).unwrap();
        let b = forward_documents(&p, other.view(), docs).unwrap();
        (10 * 256..T * 256)
            .map(|i| {
                (a.probs.as_slice().unwrap()[i] - b.probs.as_slice().unwrap()[i]).abs()
            })
            .fold(0f32, f32::max)
    };
    let (masked, causal) = (moved(Some(&docs)), moved(None));
    eprintln!(
        "the second file's predictions moved by {masked:.1e} with the mask, \
         {causal:.1e} without"
    );
    assert_eq!(
        masked, 0.0,
        "with the document mask, the second file's predictions moved by {masked:.2e}"
    );
    // measured without the mask: 3.1e-3
    assert!(
        causal > 1e-4,
        "without the mask the second file's predictions should see the first's bytes; they \
         moved by {causal:.2e}"
    );
}
// ANCHOR_END: blind_across_files

/// The readable model's loss and gradients on these windows.
fn readable(
    p: &Params<f32>,
    inputs: &Array2<u8>,
    targets: &Array2<u8>,
    docs: Option<&Documents>,
) -> (f32, Params<f32>) {
    let acts = forward_documents(p, inputs.view(), docs).unwrap();
    let grads = backward(p, &acts, inputs.view(), targets.view()).unwrap();
    (loss(&acts, targets.view()), grads)
}

/// The largest difference between two gradients, over each tensor's largest number.
fn relative_gap(a: &Params<f32>, b: &Params<f32>) -> f32 {
    a.tensors()
        .into_iter()
        .zip(b.tensors())
        .map(|((_, a), (_, b))| {
            let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
            let worst = a
                .iter()
                .zip(b.iter())
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            worst / scale
        })
        .fold(0f32, f32::max)
}

#[test]
fn windows_inside_one_file_each_are_the_causal_models() {
    let corpus = common::corpus();
    let p = weights(TINY);
    let f = &corpus.train_file_starts;
    let (inputs, targets, docs) = windows(&corpus, &[f[1], f[2] + 100, f[3] - T]);
    assert!(docs.ids().iter().all(|&id| id == 0));
    let (a, ga) = readable(&p, &inputs, &targets, Some(&docs));
    let (b, gb) = readable(&p, &inputs, &targets, None);
    assert_eq!((a, ga), (b, gb));
}

#[test]
fn one_step_across_a_boundary_differs_and_the_fast_path_agrees() {
    let corpus = common::corpus();
    let p = weights(TINY);
    let (inputs, targets, docs) = windows(&corpus, &across_boundaries(&corpus));
    let (loss_docs, grads_docs) = readable(&p, &inputs, &targets, Some(&docs));
    let (loss_causal, grads_causal) = readable(&p, &inputs, &targets, None);
    let (dl, dg) = (
        ((loss_docs - loss_causal) / loss_causal).abs(),
        relative_gap(&grads_docs, &grads_causal),
    );
    // measured: 1.7e-3 and 0.9 apart
    assert!(
        dl > 1e-5 && dg > 1e-2,
        "with and without the mask: losses {loss_docs} and {loss_causal} ({dl:.1e} apart), \
         gradients {dg:.1e} of a tensor's largest number apart"
    );
    eprintln!("with and without the mask: loss {dl:.1e} apart, gradients {dg:.1e}");
    for threads in [1, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let (got_loss, got) = pool
            .install(|| {
                let (x, y) = (inputs.view(), targets.view());
                loss_and_grads_documents(&p, x, y, Some(&docs), &mut Vec::new())
            })
            .unwrap();
        let rel = ((got_loss - loss_docs) / loss_docs).abs();
        let gap = relative_gap(&grads_docs, &got);
        eprintln!(
            "{threads} threads: fast against readable: loss {rel:.1e}, gradients {gap:.1e}"
        );
        // the bounds of tests/fast_path.rs (measured: 8.5e-8 and 5.5e-7)
        assert!(
            rel < 2e-6 && gap <= 1e-5,
            "{threads} threads: the fast path's loss {got_loss} against the readable model's \
             {loss_docs} ({rel:.1e} apart), gradients {gap:.1e} of a tensor's largest apart"
        );
    }
}

#[test]
fn the_model_with_documents_matches_step_09s_reference_and_central_differences() {
    let corpus = common::corpus();
    let p32 = weights(Config { layers: 1, ..TINY });
    let p64 = p32.cast(|x| x as f64);
    let (inputs, targets, docs) = windows(&corpus, &across_boundaries(&corpus)[..2]);
    // in f64 the model's attention is step 09's reference, in f32 its CPU kernels
    let acts64 = forward_documents(&p64, inputs.view(), Some(&docs)).unwrap();
    let g64 = backward(&p64, &acts64, inputs.view(), targets.view()).unwrap();
    let (_, g32) = readable(&p32, &inputs, &targets, Some(&docs));
    let loss_of = |p: &Params<f64>| {
        let acts = forward_documents(p, inputs.view(), Some(&docs)).unwrap();
        loss(&acts, targets.view())
    };
    let h = 1e-5;
    let (mut worst32, mut worst64) = (0f64, 0f64);
    let tensors = g64.tensors();
    for (i, (name, grad64)) in tensors.iter().enumerate() {
        let grad64: Vec<f64> = grad64.iter().copied().collect();
        let grad32: Vec<f32> = g32.tensors()[i].1.iter().copied().collect();
        let scale = grad64.iter().fold(0f64, |m, g| m.max(g.abs())).max(1e-6);
        // the f32 model, step 09's kernels inside, within 1e-4 of the tensor's largest
        // gradient (tests/gradients.rs's bound for the causal model; measured: 1.0e-6)
        for (j, (a, b)) in grad64.iter().zip(&grad32).enumerate() {
            let e = (a - *b as f64).abs();
            worst32 = worst32.max(e / scale);
            assert!(
                e <= 1e-4 * scale + 1e-7,
                "{name}[{j}]: f32 {b} against the f64 reference's {a}: error {e:.2e}, the \
                 tensor's largest gradient {scale:.2e}"
            );
        }
        // the attention's weights, through the mask: the f64 backward against central
        // differences of the masked loss, at the largest gradient and two more
        // (tests/gradients.rs's bound; measured: 3.1e-7 of the difference at worst)
        if !name.contains("attn.c_attn") {
            continue;
        }
        let largest = (0..grad64.len())
            .max_by(|&a, &b| grad64[a].abs().total_cmp(&grad64[b].abs()))
            .unwrap();
        for j in [0, grad64.len() / 2, largest] {
            let at = |delta: f64| {
                let mut p = p64.clone();
                p.tensors_mut()[i].1.as_slice_mut().unwrap()[j] += delta;
                loss_of(&p)
            };
            let fd = (at(h) - at(-h)) / (2.0 * h);
            let e = (grad64[j] - fd).abs();
            worst64 = worst64.max(e / (1e-8 + fd.abs()));
            assert!(
                e <= 1e-8 + 1e-6 * fd.abs(),
                "{name}[{j}]: f64 backward {} against central differences {fd}: error {e:.2e}",
                grad64[j]
            );
        }
    }
    eprintln!(
        "worst f32 error {worst32:.1e} of the tensor's largest gradient, worst f64 error \
         {worst64:.1e} of the central difference"
    );
}

fn settings(documents: bool) -> Settings {
    Settings {
        batch: 4,
        seq_len: T,
        steps: 3,
        schedule: Schedule {
            max: 3e-3,
            min: 3e-4,
            warmup: 1,
            steps: 3,
        },
        adamw: AdamWSettings::default(),
        clip: 1.0,
        seed: 11,
        eval_every: 3,
        eval_batches: 2,
        max_seconds: None,
        documents,
    }
}

#[test]
fn training_with_documents_on_both_paths_takes_the_same_steps() {
    // files of 40 bytes: most windows of 24 cross a boundary
    let corpus = common::corpus();
    let every = |len: usize| (0..len).step_by(40).collect::<Vec<usize>>();
    let corpus = Corpus {
        train_file_starts: every(corpus.train.len()),
        heldout_file_starts: every(corpus.heldout.len()),
        ..corpus
    };
    let settings = settings(true);
    // the seed's first batch crosses a boundary, or the test would show nothing
    let starts = train_starts(corpus.train.len(), 4, T, settings.seed, 0);
    let docs = window_documents(&corpus.train_file_starts, &starts, T);
    assert!(docs.ids().iter().any(|&id| id > 0), "starts {starts:?}");
    let mut readable = Trainer::new(TINY, &settings).unwrap();
    let mut trainer = readable.clone();
    let mut causal = readable.clone();
    let mut fast = FastCpu::new(&mut trainer);
    let first_causal = causal.train_step(&corpus, &self::settings(false)).unwrap();
    for step in 1..=settings.steps {
        let want = readable.train_step(&corpus, &settings).unwrap();
        let got = Learner::train_step(&mut fast, &corpus, &settings).unwrap();
        let rel = ((got.loss - want.loss) / want.loss).abs();
        assert!(
            rel < 1e-5,
            "step {step}: the fast path's loss {} against the readable model's {} ({rel:.1e} \
             apart)",
            got.loss,
            want.loss
        );
        if step == 1 {
            assert_ne!(want.loss, first_causal.loss, "the mask changed nothing");
        }
    }
    // the same batch as without the mask: only the attention differs
    let b = train_batch(&corpus.train, 4, T, settings.seed, 0);
    assert_eq!(b.documents, None);
    // the loop: held-out batches with their documents, the flag in the record
    let mut fresh = Trainer::new(TINY, &settings).unwrap();
    let run = train(&mut fresh, &corpus, &settings, |_| {}).unwrap();
    assert!(run.settings.documents);
    assert_eq!(run.evals.len(), 2);
    let held = corpus.heldout_batches_documents(4, T, 2);
    assert!(held.iter().all(|b| b.documents.is_some()));
    // a corpus that does not know its files' boundaries is refused, naming the flag
    let tokens = Corpus {
        train_file_starts: Vec::new(),
        heldout_file_starts: Vec::new(),
        ..corpus.clone()
    };
    let mut fresh = Trainer::new(TINY, &settings).unwrap();
    let e = train(&mut fresh, &tokens, &settings, |_| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("--documents") && e.contains("accepted"), "{e}");
}

/// The trainer's binary, as cargo built it for these tests.
const TRAIN: &str = env!("CARGO_BIN_EXE_step05-train");

#[test]
fn the_flag_is_refused_where_it_cannot_work() {
    common::refused(
        &["--documents", "--device", "cuda"],
        &["--documents", "--device cpu"],
    );
    let dir = std::env::temp_dir().join(format!("step05-documents-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let corpus = common::corpus();
    std::fs::write(dir.join("text.txt"), &corpus.train).unwrap();
    // a token file as step 05 writes it: the bytes, and no file boundaries
    let bytes_only = Corpus {
        train_file_starts: Vec::new(),
        heldout_file_starts: Vec::new(),
        ..corpus.clone()
    };
    bytes_only.save(&dir.join("corpus.tokens")).unwrap();
    let run = |args: &[&str]| {
        let tiny = [
            "train",
            "--layers",
            "1",
            "--d-model",
            "16",
            "--heads",
            "2",
            "--context",
            "16",
            "--batch",
            "2",
            "--steps",
            "1",
            "--eval-batches",
            "1",
        ];
        std::process::Command::new(TRAIN)
            .current_dir(&dir)
            .args(tiny)
            .args(args)
            .output()
            .unwrap()
    };
    let failed = |args: &[&str], want: &[&str]| {
        let o = run(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} ran");
        assert!(
            err.starts_with("error: ") && !err.contains("panicked"),
            "{err}"
        );
        for w in want {
            assert!(err.contains(w), "{args:?}: {err:?} lacks {w:?}");
        }
    };
    // a token file that keeps no file boundaries
    failed(
        &["--data", "corpus.tokens", "--documents"],
        &["--documents", "token file", "accepted"],
    );
    // a checkpoint trained one way is not resumed the other
    for (with, name) in [(false, "causal.safetensors"), (true, "docs.safetensors")] {
        let mut args = vec!["--data", "text.txt", "--save", name];
        if with {
            args.push("--documents");
        }
        let o = run(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let saved = Checkpoint::metadata(&dir.join(name)).unwrap();
        assert_eq!(saved["settings"].contains("\"documents\":true"), with);
        let mut other = vec!["--data", "text.txt", "--resume", name];
        if !with {
            other.push("--documents");
        }
        failed(&other, &["--resume", "--documents", "accepted"]);
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_token_file_keeps_where_its_files_begin() {
    let dir = std::env::temp_dir().join(format!("step05-tokens-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("corpus.tokens");
    let corpus = common::corpus();
    corpus.save(&path).unwrap();
    assert_eq!(
        Corpus::load(&path).unwrap().train_file_starts,
        corpus.train_file_starts
    );
    let loaded = Corpus::load(&path).unwrap();
    assert_eq!(
        (loaded.train, loaded.heldout, loaded.heldout_file_starts),
        (
            corpus.train.clone(),
            corpus.heldout.clone(),
            corpus.heldout_file_starts.clone()
        )
    );
    // the held-out part's last start moved past its end, then a byte too many: refused
    let bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 8;
    let mut past = bytes.clone();
    past[last..].copy_from_slice(&(corpus.heldout.len() as u64).to_le_bytes());
    let mut longer = bytes.clone();
    longer.push(0);
    for (bad, why) in [
        (past, "not increasing from 0 below"),
        (longer, "bytes follow its file starts"),
    ] {
        std::fs::write(&path, bad).unwrap();
        let e = Corpus::load(&path).unwrap_err().to_string();
        assert!(
            e.contains("not a valid token file") && e.contains(why),
            "{e}"
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}
