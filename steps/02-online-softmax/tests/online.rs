//! Both versions of the online softmax against the f64 reference and against step 01, every
//! instruction set against the scalar path, and their errors for bad input.

use flash_core::inputs::{random_normal, random_qkv};
use flash_core::reference::{attention_f64, error};
use flash_core::{Attention, AttnError, Shape};
use ndarray::{Array4, ArrayView4};
use step02_online_softmax::{
    Config, Isa, attention, attention_blocked, attention_loop, attention_with,
};

type Forward = dyn Fn(
    ArrayView4<f32>,
    ArrayView4<f32>,
    ArrayView4<f32>,
) -> Result<Attention, AttnError>;

fn methods() -> Vec<(&'static str, Box<Forward>)> {
    vec![
        ("online", Box::new(attention)),
        ("online_loop", Box::new(attention_loop)),
    ]
}

/// Every method's output and log-sum-exp within `tol` (max abs) of the f64 reference, which
/// is computed once per case.
fn check_against_reference(
    methods: &[(&str, Box<Forward>)],
    shape: Shape,
    seed: u64,
    tol: f64,
) {
    let [q, k, v] = random_qkv(shape, seed);
    let want = attention_f64(q.view(), k.view(), v.view()).unwrap();
    for (name, f) in methods {
        let got = f(q.view(), k.view(), v.view()).unwrap();
        let (out, lse) = (error(&got.out, &want.out), error(&got.lse, &want.lse));
        println!("{name:>12} {shape}: out {out}; lse {lse}");
        assert!(
            out.max_abs < tol && lse.max_abs < tol,
            "{name} on {shape}: out {out}; lse {lse}; allowed {tol:e}"
        );
    }
}

#[test]
fn matches_the_f64_reference() {
    for tokens in [1, 100, 256, 1000] {
        check_against_reference(
            &methods(),
            Shape::new(2, 3, tokens, 64),
            tokens as u64,
            1e-5,
        );
    }
}

#[test]
fn any_head_dim_matches_the_f64_reference() {
    // the fast version pads dims to 16 and masks the tail: dims below, at and past a
    // multiple
    for d in [1, 3, 16, 17, 33, 80, 100, 128] {
        check_against_reference(&methods(), Shape::new(1, 2, 77, d), d as u64, 1e-5);
    }
}

#[test]
fn agrees_with_step_01() {
    for tokens in [1, 63, 64, 65, 300] {
        let shape = Shape::new(2, 3, tokens, 64);
        let [q, k, v] = random_qkv(shape, 7 + tokens as u64);
        let naive = step01_naive::attention(q.view(), k.view(), v.view()).unwrap();
        for (name, f) in methods() {
            let got = f(q.view(), k.view(), v.view()).unwrap();
            let (out, lse) = (
                error(&got.out, &naive.out.mapv(f64::from)),
                error(&got.lse, &naive.lse.mapv(f64::from)),
            );
            assert!(
                out.max_abs < 5e-6 && lse.max_abs < 5e-6,
                "{name} vs step 01 on {shape}: out {out}; lse {lse}"
            );
        }
    }
}

/// Every instruction set this CPU has gives the scalar path's answer, up to f32 rounding,
/// on shapes with partial blocks and head dims with a tail.
#[test]
fn every_instruction_set_agrees_with_the_scalar_path() {
    let scalar = Config {
        isa: Isa::Scalar,
        ..Config::default()
    };
    let simd: Vec<Isa> = [Isa::Avx512, Isa::Avx2, Isa::Neon]
        .into_iter()
        .filter(|isa| isa.is_available())
        .collect();
    println!("instruction sets checked against the scalar path: {simd:?}");
    for (tokens, d) in [(1, 64), (77, 64), (130, 17), (200, 128), (65, 1)] {
        let shape = Shape::new(1, 3, tokens, d);
        let [q, k, v] = random_qkv(shape, tokens as u64 + d as u64);
        let want = attention_with(q.view(), k.view(), v.view(), scalar).unwrap();
        for &isa in &simd {
            for (block_q, block_k) in [(64, 64), (16, 24), (32, 128)] {
                let cfg = Config {
                    isa,
                    block_q,
                    block_k,
                    ..Config::default()
                };
                let got = attention_with(q.view(), k.view(), v.view(), cfg).unwrap();
                let (out, lse) = (
                    error(&got.out, &want.out.mapv(f64::from)),
                    error(&got.lse, &want.lse.mapv(f64::from)),
                );
                assert!(
                    out.max_abs < 2e-6 && lse.max_abs < 2e-6,
                    "{isa:?} {block_q}x{block_k} vs scalar on {shape}: out {out}; lse {lse}"
                );
            }
        }
    }
}

/// The alternatives the speed example measures stay correct: natural units instead of
/// log2(e) folded into the scale, the standard library's exp2, odd block sizes.
#[test]
fn every_configuration_matches_the_f64_reference() {
    let base = Config::default();
    let configs = [
        Config {
            fold_log2e: false,
            ..base
        },
        Config {
            fast_exp: false,
            ..base
        },
        Config {
            fold_log2e: false,
            fast_exp: false,
            ..base
        },
        Config {
            block_q: 1, // rounded up to 16
            block_k: 1,
            ..base
        },
        Config {
            block_q: 128,
            block_k: 7,
            ..base
        },
        Config {
            block_q: 16,
            block_k: 300, // longer than the sequence
            ..base
        },
    ];
    let methods: Vec<(&str, Box<Forward>)> = configs
        .into_iter()
        .map(|cfg| {
            let f: Box<Forward> = Box::new(move |q, k, v| attention_with(q, k, v, cfg));
            (&*Box::leak(format!("{cfg:?}").into_boxed_str()), f)
        })
        .collect();
    check_against_reference(&methods, Shape::new(1, 2, 150, 64), 3, 1e-5);
}

#[test]
fn strided_views_give_the_same_answer_as_contiguous_input() {
    // q, k, v laid out [batch, tokens, heads, d] and viewed as [batch, heads, tokens, d]
    let shape = Shape::new(2, 3, 50, 24);
    let [q, k, v] = random_qkv(shape, 11);
    let tokens_major = |x: &Array4<f32>| {
        x.view()
            .permuted_axes([0, 2, 1, 3])
            .as_standard_layout()
            .into_owned()
    };
    let (qt, kt, vt) = (tokens_major(&q), tokens_major(&k), tokens_major(&v));
    fn view(x: &Array4<f32>) -> ArrayView4<'_, f32> {
        x.view().permuted_axes([0, 2, 1, 3])
    }
    let (qv, kv, vv) = (view(&qt), view(&kt), view(&vt));
    assert!(!qv.is_standard_layout());
    for (name, f) in methods() {
        let a = f(q.view(), k.view(), v.view()).unwrap();
        let b = f(qv, kv, vv).unwrap();
        assert_eq!(a.out, b.out, "{name}");
        assert_eq!(a.lse, b.lse, "{name}");
    }
}

#[test]
fn empty_input_gives_an_empty_output() {
    for dims in [(1, 2, 0, 16), (0, 2, 5, 16), (1, 0, 5, 16)] {
        let x = Array4::<f32>::zeros(dims);
        for (name, f) in methods() {
            let got = f(x.view(), x.view(), x.view()).unwrap();
            assert_eq!(got.out.dim(), dims, "{name}");
            assert_eq!(got.lse.dim(), (dims.0, dims.1, dims.2), "{name}");
        }
    }
}

#[test]
fn bad_input_is_an_error_that_says_what_is_accepted() {
    let a = random_normal(Shape::new(1, 2, 8, 16), 1);
    let b = random_normal(Shape::new(1, 2, 9, 16), 2);
    let z = Array4::<f32>::zeros((1, 2, 8, 0));
    for (name, f) in methods() {
        let err = f(a.view(), b.view(), a.view()).unwrap_err();
        assert!(
            matches!(err, AttnError::ShapeMismatch { .. }),
            "{name}: {err}"
        );
        assert!(
            err.to_string().contains("k is [1, 2, 9, 16]"),
            "{name}: {err}"
        );
        let err = f(z.view(), z.view(), z.view()).unwrap_err();
        assert_eq!(err, AttnError::ZeroHeadDim, "{name}");
    }
    let err = attention_blocked(a.view(), a.view(), a.view(), 0).unwrap_err();
    assert!(
        err.to_string().contains("block size 0") && err.to_string().contains("at least 1"),
        "{err}"
    );
    for (block_q, block_k) in [(0, 64), (64, 0)] {
        let cfg = Config {
            block_q,
            block_k,
            ..Config::default()
        };
        let err = attention_with(a.view(), a.view(), a.view(), cfg).unwrap_err();
        assert!(err.to_string().contains("at least 1"), "{err}");
    }
    for isa in [Isa::Avx2, Isa::Avx512, Isa::Neon] {
        let cfg = Config {
            isa,
            ..Config::default()
        };
        let got = attention_with(a.view(), a.view(), a.view(), cfg);
        assert_eq!(got.is_ok(), isa.is_available(), "{isa:?}");
        if let Err(err) = got {
            assert!(
                err.to_string().contains("no ") && err.to_string().contains("available")
            );
        }
    }
}

#[test]
fn any_block_size_from_one_to_past_the_end_works_for_the_loop() {
    let shape = Shape::new(1, 2, 37, 8);
    let [q, k, v] = random_qkv(shape, 5);
    let want = attention_f64(q.view(), k.view(), v.view()).unwrap();
    for block in [1, 2, 5, 36, 37, 38, 1000] {
        let got = attention_blocked(q.view(), k.view(), v.view(), block).unwrap();
        let out = error(&got.out, &want.out);
        assert!(out.max_abs < 1e-5, "block {block}: {out}");
    }
}
