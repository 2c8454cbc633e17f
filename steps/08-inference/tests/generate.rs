//! The cache changes how much the model computes, not what it says: `generate` returns
//! step 05's `sample`'s bytes, and each position's logits are those of the full forward,
//! both checked against the model in `f64`.

use flash_core::inputs::SplitMix64;
use ndarray::{Array2, ArrayView2};
use step05_train::layers::Float;
use step05_train::model::{Config, Params, forward};
use step05_train::sample;
use step08_inference::generate::{ModelCache, extend, generate, prefill, step};

mod common;

/// A model small enough for a test, with a context that leaves the cache's last block of
/// keys partial (100 = 64 + 36).
const CONFIG: Config = Config {
    layers: 2,
    d_model: 32,
    heads: 4,
    kv_heads: 4,
    context: 100,
    vocab: 256,
};

/// The same model with grouped heads: 4 query heads sharing 2 key and value heads, and
/// sharing 1 (multi-query attention).
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

fn model(seed: u64) -> Params<f32> {
    Params::init(CONFIG, seed).unwrap()
}

/// Seeded random bytes.
fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| rng.next_u64() as u8).collect()
}

/// The logits at every position of `tokens` by the full forward: `ln_f(x) · wteᵀ`.
fn full_logits<A: Float>(p: &Params<A>, tokens: &[u8]) -> Array2<A> {
    let inputs = ArrayView2::from_shape((1, tokens.len()), tokens).unwrap();
    let acts = forward(p, inputs).unwrap();
    acts.ln_f.out.dot(&p.wte.t())
}

// ANCHOR: same_as_sample
#[test]
fn generate_returns_what_sample_returns() {
    for (config, model_seed, prompt, count) in [
        (CONFIG, 1, &b"fn main() {"[..], 89), // to the end of the context
        (CONFIG, 2, &b"\n"[..], 70),          // the cache past one block of 64 keys
        (CONFIG, 3, &b"let x = 1;\nlet y"[..], 20),
        (GROUPED[0], 4, &b"fn main() {"[..], 89),
        (GROUPED[1], 5, &b"\n"[..], 70),
    ] {
        let p = Params::init(config, model_seed).unwrap();
        for temperature in [0.0, 0.8, 1.5] {
            let seed = 7 + model_seed;
            let uncached = sample(&p, prompt, count, temperature, seed).unwrap();
            let cached = generate(&p, prompt, count, temperature, seed).unwrap();
            assert_eq!(
                cached, uncached,
                "{config:?}, model {model_seed}, prompt {prompt:?}, temperature \
                 {temperature}"
            );
        }
    }
}
// ANCHOR_END: same_as_sample

// ANCHOR: same_logits
/// Every position's logits from the cache (a prefill of `prompt` tokens, then one step a
/// token) against the full forward's, both against the same model in `f64`. The two `f32`
/// paths round differently: the prefill and the full forward take step 02's fast kernel
/// (`2^x` by a polynomial, its own order of sums), a step takes the plain loop of
/// `attend_one`, and the one-row products sum in their own order. Neither is closer to the
/// truth, so the repository's rule for a low-precision method applies: the cache's error
/// against `f64` at most twice the full forward's, plus 1e-6 for a forward whose error is
/// near zero by luck.
#[test]
fn cached_logits_match_the_full_forward() {
    let configs = [CONFIG, CONFIG, CONFIG, CONFIG, GROUPED[0], GROUPED[1]];
    for (config, (model_seed, prompt)) in
        configs
            .into_iter()
            .zip([(1, 1), (2, 5), (3, 64), (4, 99), (5, 64), (6, 5)])
    {
        let p = Params::init(config, model_seed).unwrap();
        let tokens = bytes(CONFIG.context, 100 + model_seed);
        let full = full_logits(&p, &tokens);
        let exact = full_logits(&p.cast(f64::from), &tokens);
        let (mut cache, first) = prefill(&p, &tokens[..prompt]).unwrap();
        let mut cached = vec![first];
        for &t in &tokens[prompt..] {
            cached.push(step(&p, &mut cache, t).unwrap());
        }
        assert_eq!(cache.len(), CONFIG.context);
        let (mut ours, mut by_forward, mut apart) = (0.0f64, 0.0f64, 0.0f64);
        for (i, row) in cached.iter().enumerate() {
            let pos = prompt - 1 + i;
            for ((&c, &f), &e) in row.iter().zip(full.row(pos)).zip(exact.row(pos)) {
                ours = ours.max((c as f64 - e).abs());
                by_forward = by_forward.max((f as f64 - e).abs());
                apart = apart.max((c - f).abs() as f64);
            }
        }
        assert!(
            ours <= 2.0 * by_forward + 1e-6,
            "{config:?}, prompt {prompt}: the cache's logits are {ours:.3e} from f64, the \
             full forward's {by_forward:.3e} (the two {apart:.3e} apart)"
        );
    }
}
// ANCHOR_END: same_logits

// ANCHOR: extend_test
/// A text read in turns, each turn by `extend` against the cache the turns before left
/// (the last turn's rows see every earlier position), gives at each turn's end the logits
/// of the full forward over the whole text so far, by the same rule as above, and leaves
/// the keys and values a prefill of the whole text leaves; a turn that would pass the
/// context and an empty one are refused and change nothing.
#[test]
fn a_text_read_in_turns_matches_the_full_forward() {
    for (config, model_seed, turns) in [
        (CONFIG, 5, &[1, 30, 1, 68][..]),
        (CONFIG, 6, &[64, 36]),
        (CONFIG, 7, &[100]),
        (GROUPED[0], 8, &[1, 30, 1, 68]),
        (GROUPED[1], 9, &[64, 36]),
    ] {
        let p = Params::init(config, model_seed).unwrap();
        let tokens = bytes(CONFIG.context, 200 + model_seed);
        let full = full_logits(&p, &tokens);
        let exact = full_logits(&p.cast(f64::from), &tokens);
        let mut cache = ModelCache::new(config);
        let (mut ours, mut by_forward) = (0.0f64, 0.0f64);
        let mut end = 0;
        for &n in turns {
            let row = extend(&p, &mut cache, &tokens[end..end + n]).unwrap();
            end += n;
            assert_eq!(cache.len(), end);
            for ((&c, &f), &e) in row.iter().zip(full.row(end - 1)).zip(exact.row(end - 1))
            {
                ours = ours.max((c as f64 - e).abs());
                by_forward = by_forward.max((f as f64 - e).abs());
            }
        }
        assert!(
            ours <= 2.0 * by_forward + 1e-6,
            "{config:?}, turns {turns:?}: {ours:.3e} from f64, the full forward \
             {by_forward:.3e}"
        );
        // the same keys and values as a prefill of the whole text
        let (whole, _) = prefill(&p, &tokens).unwrap();
        for layer in 0..CONFIG.layers {
            let apart = (&cache.keys(layer) - &whole.keys(layer))
                .mapv(f32::abs)
                .fold(0.0f32, |a, &b| a.max(b));
            assert!(
                apart < 1e-4,
                "turns {turns:?}, layer {layer}: keys {apart:.3e} apart"
            );
        }
    }
    let p = model(5);
    let mut cache = ModelCache::new(CONFIG);
    extend(&p, &mut cache, &[b'a'; 90]).unwrap();
    let e = extend(&p, &mut cache, &[b'a'; 11]).unwrap_err().to_string();
    assert!(
        e.contains("90 tokens and 11 more") && e.contains("context is 100"),
        "{e}"
    );
    let e = extend(&p, &mut cache, &[]).unwrap_err().to_string();
    assert!(e.contains("at least one"), "{e}");
    assert_eq!(cache.len(), 90);
}
// ANCHOR_END: extend_test

#[test]
fn a_text_longer_than_the_context_is_refused() {
    let p = model(1);
    // 60 + 41 = 101 tokens, one more than the context of 100
    let e = generate(&p, &[b'a'; 60], 41, 0.0, 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("101") && e.contains("context is 100") && e.contains("at most 100"),
        "{e}"
    );
    // exactly the context is fine
    assert_eq!(generate(&p, &[b'a'; 60], 40, 0.0, 1).unwrap().len(), 40);
    // a prompt longer than the context
    let e = prefill(&p, &[b'a'; 101]).unwrap_err().to_string();
    assert!(e.contains("101") && e.contains("at most 100"), "{e}");
    // a step into a full cache: an error, and the cache as it was
    let (mut cache, _) = prefill(&p, &[b'a'; 100]).unwrap();
    let before = cache.clone();
    let e = step(&p, &mut cache, b'a').unwrap_err().to_string();
    assert!(
        e.contains("holds 100 tokens") && e.contains("at most 100"),
        "{e}"
    );
    assert_eq!(cache, before);
}

#[test]
fn bad_prompts_and_tokens_are_refused() {
    let p = model(1);
    let e = generate(&p, b"", 5, 0.0, 1).unwrap_err().to_string();
    assert!(e.contains("empty prompt"), "{e}");
    // a model of 200 tokens has no byte 250
    let small = Params::init(
        Config {
            vocab: 200,
            ..CONFIG
        },
        1,
    )
    .unwrap();
    let (mut cache, _) = prefill(&small, b"ab").unwrap();
    let e = step(&small, &mut cache, 250).unwrap_err().to_string();
    assert!(e.contains("token 250") && e.contains("0..200"), "{e}");
    assert_eq!(cache.len(), 2);
    assert!(prefill(&small, &[250]).is_err());
}

#[test]
fn the_cache_grows_a_row_a_token() {
    let p = model(1);
    let empty = ModelCache::new(CONFIG);
    assert!(empty.is_empty());
    assert_eq!(empty.capacity(), 100);
    let (mut cache, _) = prefill(&p, b"abc").unwrap();
    assert_eq!(cache.len(), 3);
    step(&p, &mut cache, b'd').unwrap();
    let (heads, d) = (CONFIG.heads, CONFIG.head_dim());
    assert_eq!(cache.keys(0).dim(), (heads, 4, d));
    assert_eq!(cache.values(1).dim(), (heads, 4, d));
    // 2 layers × (k and v) × 4 heads × 4 tokens × 8 dims × 4 bytes
    assert_eq!(cache.bytes(), 2 * 2 * 4 * 4 * 8 * 4);
    // with a key and value head for each pair of query heads, half of that
    let grouped = Params::init(GROUPED[0], 1).unwrap();
    let (mut cache, _) = prefill(&grouped, b"abc").unwrap();
    step(&grouped, &mut cache, b'd').unwrap();
    assert_eq!(cache.keys(0).dim(), (2, 4, d));
    assert_eq!(cache.bytes(), 2 * 2 * 2 * 4 * 8 * 4);
}

#[test]
fn no_graph_on_the_cpu_is_refused_with_what_to_do() {
    let generate = common::binary(env!("CARGO_BIN_EXE_generate"), "generate");
    let run = std::process::Command::new(generate)
        .args(["--no-graph", "--count", "5"])
        .output()
        .expect("generate runs");
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success(), "{err}");
    assert!(
        err.contains("--no-graph") && err.contains("--device cuda"),
        "{err}"
    );
    assert!(
        !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
        "{err}"
    );
}
