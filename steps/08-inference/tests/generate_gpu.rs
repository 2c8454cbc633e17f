//! The cache on the GPU: each position's logits from [`GpuModel`]'s steps (the decoding
//! kernel against a paged cache) against the same model in `f64`, with step 05's GPU
//! forward over the whole text as the measure of what bf16 costs. Ignored where there is
//! no GPU (`cargo test -- --include-ignored` runs them on one).

use flash_core::inputs::SplitMix64;
use ndarray::{Array2, ArrayView2};
use step03_cuda_forward::gpu::Gpu;
use step05_train::cuda::{AttentionKind, GpuTrainer};
use step05_train::model::{Config, Params, forward};
use step05_train::optim::AdamW;
use step05_train::train::Trainer;
use step08_inference::gpu_generate::{GpuModel, generate_gpu, sample_gpu};

/// Head dim 64 (256 / 4), a context that leaves a last page partial (300 = 4·64 + 44) and
/// that the decoding kernel cuts into 2 splits at its end, merged by the last block.
const CONFIG: Config = Config {
    layers: 2,
    d_model: 256,
    heads: 4,
    kv_heads: 4,
    context: 300,
    vocab: 256,
};

/// The same model with 2 kv heads, and with 1 (multi-query attention): the cache holds
/// `kv_heads` heads a layer, and each decoding step reads a head for its group of queries.
const GROUPED: [Config; 2] = [
    Config {
        kv_heads: 2,
        ..CONFIG
    },
    Config {
        kv_heads: 1,
        ..CONFIG
    },
];

fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| rng.next_u64() as u8).collect()
}

/// The f64 logits at every position of `tokens`.
fn exact_logits(p: &Params<f32>, tokens: &[u8]) -> Array2<f64> {
    let p = p.cast(f64::from);
    let inputs = ArrayView2::from_shape((1, tokens.len()), tokens).unwrap();
    let acts = forward(&p, inputs).unwrap();
    acts.ln_f.out.dot(&p.wte.t())
}

fn trainer(p: &Params<f32>) -> GpuTrainer {
    let start = Trainer {
        params: p.clone(),
        opt: AdamW::new(p.config, Default::default()),
        step: 0,
    };
    let attention = match Gpu::shared().unwrap().arch() {
        "sm_90" | "sm_90a" => AttentionKind::Hopper,
        _ => AttentionKind::Flash,
    };
    GpuTrainer::new(&start, 1, p.config.context, attention, false).unwrap()
}

// ANCHOR: gpu_logits_test
/// Both GPU paths compute in bf16 (the same products, the same kernels but the attention);
/// the cache's error against `f64` is at most twice that of step 05's GPU forward over the
/// whole text, plus 1e-4 for a forward whose error is near zero by luck. The prompt goes
/// in by a prefill (its last row's logits checked), every later token by a step: each
/// step's kernels launched one by one, and replayed as one graph. With one kv head per
/// query head, and grouped.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_cached_logits_are_as_close_to_f64_as_the_gpu_forward() {
    for (config, model_seed, prompt) in [
        (CONFIG, 1, 1),
        (CONFIG, 2, 70),
        (CONFIG, 3, CONFIG.context),
        (GROUPED[0], 4, 70),
        (GROUPED[1], 5, 1),
        (GROUPED[1], 6, CONFIG.context),
    ] {
        for graphs in [false, true] {
            cached_logits(config, model_seed, prompt, graphs);
        }
    }
}

fn cached_logits(config: Config, model_seed: u64, prompt: usize, graphs: bool) {
    let p = Params::init(config, model_seed).unwrap();
    let tokens = bytes(CONFIG.context, 100 + model_seed);
    let exact = exact_logits(&p, &tokens);
    let mut model = GpuModel::new(&p).unwrap();
    model.graphs = graphs;
    if graphs {
        // the step captured on another text, then a fresh start: every step below
        // replays a graph captured at other lengths
        model.prefill(&tokens[..5]).unwrap();
        for &token in &tokens[5..8] {
            model.step(token).unwrap();
        }
        model.reset().unwrap();
    }
    let mut gpu = trainer(&p);
    gpu.loss(
        ArrayView2::from_shape((1, tokens.len()), &tokens[..]).unwrap(),
        ArrayView2::from_shape((1, tokens.len()), &tokens[..]).unwrap(),
    )
    .unwrap();
    let mut cached = vec![(prompt - 1, model.prefill(&tokens[..prompt]).unwrap())];
    for (pos, &token) in tokens.iter().enumerate().skip(prompt) {
        cached.push((pos, model.step(token).unwrap()));
    }
    let (mut ours, mut by_forward) = (0.0f64, 0.0f64);
    for (pos, row) in cached {
        let full = gpu.logits_row(pos).unwrap();
        for ((&c, &f), &e) in row.iter().zip(&full).zip(exact.row(pos)) {
            ours = ours.max((c as f64 - e).abs());
            by_forward = by_forward.max((f as f64 - e).abs());
        }
    }
    assert_eq!(model.len(), CONFIG.context);
    assert_eq!(
        model.cache_bytes(),
        2 * 2 * config.kv_heads * 64 * CONFIG.context * 2
    );
    let how = if graphs { "graphs" } else { "launches" };
    println!(
        "{} kv heads, model {model_seed}, a prompt of {prompt}, {how}: the cache's \
         logits {ours:.3e} from f64, the GPU forward's {by_forward:.3e}",
        config.kv_heads
    );
    assert!(
        ours <= 2.0 * by_forward + 1e-4,
        "{config:?}, model {model_seed}, a prompt of {prompt}, {how}: the cache's \
         logits are {ours:.3e} from f64, the GPU forward's {by_forward:.3e}"
    );
    // one more token has no position embedding, and a prefill needs an empty cache:
    // refused, nothing changed
    let e = model.step(0).unwrap_err().to_string();
    assert!(e.contains("no more tokens fit"), "{e}");
    let e = model.prefill(b"fn").unwrap_err().to_string();
    assert!(e.contains("into an empty cache"), "{e}");
    assert_eq!(model.len(), CONFIG.context);
}
// ANCHOR_END: gpu_logits_test

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_generation_refuses_what_does_not_fit_and_draws_as_sample_draws() {
    let p = Params::init(CONFIG, 5).unwrap();
    draws_as_sample_draws(&p);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn grouped_gpu_generation_draws_as_sample_draws() {
    for (i, config) in GROUPED.into_iter().enumerate() {
        draws_as_sample_draws(&Params::init(config, 7 + i as u64).unwrap());
    }
}

fn draws_as_sample_draws(p: &Params<f32>) {
    let mut model = GpuModel::new(p).unwrap();
    let e = generate_gpu(&mut model, &[b'a'; 200], 101, 0.8, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("at most 300"), "{e}");
    let e = generate_gpu(&mut model, &[], 1, 0.8, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("at least one token"), "{e}");
    assert!(
        generate_gpu(&mut model, b"fn", 0, 0.8, 1)
            .unwrap()
            .is_empty()
    );
    // the same seed draws the same bytes, run after run (the cache emptied between)
    let first = generate_gpu(&mut model, b"fn main", 40, 0.8, 9).unwrap();
    let again = generate_gpu(&mut model, b"fn main", 40, 0.8, 9).unwrap();
    assert_eq!(first, again);
    // with and without the cache, the same draws from the same stream: the two bf16
    // paths' probabilities differ by rounding only, which moves a draw only when it lands
    // within that rounding of a boundary between two bytes
    let mut gpu = trainer(p);
    let uncached = sample_gpu(&mut gpu, b"fn main", 40, 0.8, 9).unwrap();
    let same = first
        .iter()
        .zip(&uncached)
        .take_while(|(a, b)| a == b)
        .count();
    println!("with and without the cache: the first {same} of 40 bytes agree");
    assert!(same >= 10, "{first:?} against {uncached:?}");
}
