//! The CPU's fast path (`src/fast.rs`) against the readable model (`src/model.rs`), which
//! `tests/gradients.rs` checks against finite differences: the same gradients on a tiny
//! model, whatever the number of threads (and so of shards), and the same losses step
//! after step of training. They differ only in rounding: the products sum in other orders,
//! `e^x` is a polynomial, the shards' gradients are added at the end.

use flash_core::inputs::SplitMix64;
use ndarray::Array2;
use step05_train::fast::{FastCpu, Workspace, loss_and_grads};
use step05_train::optim::{AdamWSettings, Schedule};
use step05_train::train::Learner;
use step05_train::{Config, Corpus, Params, Settings, Trainer, backward, forward, loss};

const TINY: Config = Config {
    layers: 2,
    d_model: 32,
    heads: 4,
    kv_heads: 4, // [step 08]
    context: 24,
    vocab: 256,
};

/// `sequences` rows of 24 random bytes, and the targets one byte later.
fn batch(sequences: usize, seed: u64) -> (Array2<u8>, Array2<u8>) {
    let mut rng = SplitMix64::new(seed);
    let bytes: Vec<u8> = (0..sequences * 25)
        .map(|_| (rng.next_unit() * 256.0) as u8)
        .collect();
    let rows = |from: usize| {
        Array2::from_shape_fn((sequences, 24), |(s, t)| bytes[s * 25 + t + from])
    };
    (rows(0), rows(1))
}

/// GPT-2's initialisation, and then every number moved a little, so that the biases and
/// the LayerNorms' gains are not 0 and 1 and each term of every gradient counts.
fn weights(config: Config) -> Params<f32> {
    let mut p = Params::<f32>::init(config, 7).unwrap();
    let mut rng = SplitMix64::new(8);
    for (_, mut t) in p.tensors_mut() {
        t.mapv_inplace(|x| x + 0.05 * rng.next_normal() as f32);
    }
    p
}

// ANCHOR: fast_against_readable
/// The readable model's loss and gradients, against the fast path's on `threads` threads:
/// the loss within 2e-6 relatively, each tensor's gradient within 1e-5 of its largest
/// number (the largest difference measured is 7e-7 of it).
fn gradients_agree(config: Config, sequences: usize, threads: usize) {
    let p = weights(config);
    let (inputs, targets) = batch(sequences, 9);
    let acts = forward(&p, inputs.view()).unwrap();
    let want_loss = loss(&acts, targets.view());
    let want = backward(&p, &acts, inputs.view(), targets.view()).unwrap();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let (got_loss, got) = pool
        .install(|| loss_and_grads(&p, inputs.view(), targets.view(), &mut Vec::new()))
        .unwrap();
    let rel = ((got_loss - want_loss) / want_loss).abs();
    assert!(
        rel < 2e-6,
        "{threads} threads: loss {got_loss} against the readable model's {want_loss} \
         ({rel:.1e} apart)"
    );
    for ((name, w), (_, g)) in want.tensors().into_iter().zip(got.tensors()) {
        let scale = w.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = w
            .iter()
            .zip(g.iter())
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            scale > 0.0 && worst <= 1e-5 * scale,
            "{threads} threads, {name}: the fast path's gradient is {worst:.2e} from the \
             readable model's, whose largest number is {scale:.2e}"
        );
    }
}
// ANCHOR_END: fast_against_readable

#[test]
fn gradients_match_the_readable_models_on_any_number_of_threads() {
    // 5 sequences in shards of 5; 2 and 3; 1, 1, 1 and 2; five of 1, a thread left idle
    for threads in [1, 2, 4, 6] {
        gradients_agree(TINY, 5, threads);
    }
}

// [step 08]
#[test]
fn gradients_match_with_grouped_heads() {
    for kv_heads in [1, 2] {
        gradients_agree(Config { kv_heads, ..TINY }, 3, 2);
    }
}
// [/step 08]

#[test]
fn training_gives_the_readable_models_losses_step_by_step() {
    let corpus = Corpus {
        source: "two of this crate's sources".into(),
        train: include_bytes!("../src/model.rs").to_vec(),
        heldout: include_bytes!("../src/layers.rs").to_vec(),
        train_files: 1,
        heldout_files: 1,
        train_file_starts: vec![0],   // [step 09]
        heldout_file_starts: vec![0], // [step 09]
    };
    let settings = Settings {
        batch: 4,
        seq_len: 24,
        steps: 6,
        schedule: Schedule {
            max: 3e-3,
            min: 3e-4,
            warmup: 2,
            steps: 6,
        },
        adamw: AdamWSettings::default(),
        clip: 1.0,
        seed: 11,
        eval_every: 3,
        eval_batches: 2,
        max_seconds: None,
        documents: false, // [step 09]
    };
    let mut readable = Trainer::new(TINY, &settings).unwrap();
    let mut trainer = readable.clone();
    let mut fast = FastCpu::new(&mut trainer);
    for step in 1..=settings.steps {
        let want = readable.train_step(&corpus, &settings).unwrap();
        let got = Learner::train_step(&mut fast, &corpus, &settings).unwrap();
        for (what, a, b) in [
            ("loss", got.loss, want.loss),
            ("gradient norm", got.grad_norm, want.grad_norm),
        ] {
            let rel = ((a - b) / b).abs();
            assert!(
                rel < 1e-5,
                "step {step}: the fast path's {what} {a} against the readable model's {b} \
                 ({rel:.1e} apart)"
            );
        }
    }
    assert_eq!(fast.steps_done(), settings.steps);
    // the held-out losses of the two paths' forwards, on the weights they arrived at
    let batches = step05_train::data::heldout_batches(&corpus.heldout, 4, 24, 2);
    let (a, b) = (
        fast.heldout_loss(&batches).unwrap(),
        readable.heldout_loss(&batches).unwrap(),
    );
    assert!(((a - b) / b).abs() < 1e-5, "held-out loss {a} against {b}");
    // a workspace made for one model is not used for another
    let other = Config { layers: 1, ..TINY };
    let p = weights(other);
    let (inputs, targets) = batch(2, 3);
    let mut spaces: Vec<Workspace> = Vec::new();
    loss_and_grads(&weights(TINY), inputs.view(), targets.view(), &mut spaces).unwrap();
    loss_and_grads(&p, inputs.view(), targets.view(), &mut spaces).unwrap();
}
