//! Decoding on the CPU against the `f64` reference on the expanded heads: every rung, every
//! instruction set this CPU has, every split of the keys; and their refusals of bad input.

use flash_core::inputs::random_normal;
use flash_core::reference::{Reference, error};
use flash_core::{Attention, AttnError, Shape};
use ndarray::{Array4, ArrayView4, s};
use proptest::prelude::*;
use step02_online_softmax::kernels::Isa;
use step03_cuda_forward::gpu::Dtype;
use step03_cuda_forward::host::{by_hand_low_precision, round_array};
use step08_inference::decode_grouped::{
    BLOCK_KEYS, MIN_CHUNK, decode_grouped_with, plan_chunk,
};
use step08_inference::reference::{
    by_expanded_heads, by_hand_rows_low_precision, decode_f64, expand_heads,
};
use step08_inference::{
    DecodeShape, decode, decode_grouped, decode_simd, decode_split, decode_threads,
};

type Decoder =
    fn(ArrayView4<f32>, ArrayView4<f32>, ArrayView4<f32>) -> Result<Attention, AttnError>;

/// The rungs of CPU decoding, as `decode-cpu --methods` names them.
const RUNGS: [(&str, Decoder); 4] = [
    ("decode", decode),
    ("decode_grouped", decode_grouped),
    ("decode_simd", decode_simd),
    ("decode_threads", decode_threads),
];

/// The instruction sets of the grouped rungs' kernels that this CPU has: plain Rust always,
/// so that the portable path is tested on every machine, and each SIMD one it can run.
fn isas() -> Vec<Isa> {
    [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon]
        .into_iter()
        .filter(|isa| isa.is_available())
        .collect()
}

/// q, k and v of a decoding call, normal values from one seed.
fn inputs(shape: DecodeShape, seed: u64) -> [Array4<f32>; 3] {
    let [b, h, n, d] = shape.q_dims();
    let kv = Shape::new(b, shape.kv_heads, shape.context, d);
    [
        random_normal(Shape::new(b, h, n, d), 3 * seed),
        random_normal(kv, 3 * seed + 1),
        random_normal(kv, 3 * seed + 2),
    ]
}

/// f32 sums over at most a few hundred keys, against `f64`.
const F32_MAX_ABS: f64 = 2e-5;

fn assert_close(name: &str, shape: DecodeShape, got: &Attention, want: &Reference) {
    let (out, lse) = (error(&got.out, &want.out), error(&got.lse, &want.lse));
    assert!(
        out.max_abs <= F32_MAX_ABS && lse.max_abs <= F32_MAX_ABS,
        "{name} {shape}: out {out}, lse {lse}"
    );
}

/// (batch, q heads, kv heads, q rows, context, head dim): plain heads, grouped, one kv
/// head, a cache no longer than the rows, lengths that leave partial blocks of 64 keys,
/// head dims that leave a partial SIMD register (20 and 36: 4 lanes past the last whole
/// one of 8 or 16).
const SHAPES: [(usize, usize, usize, usize, usize, usize); 9] = [
    (1, 1, 1, 1, 1, 8),
    (2, 4, 4, 1, 77, 16),
    (2, 4, 2, 1, 77, 16),
    (1, 8, 2, 4, 300, 64),
    (2, 6, 3, 3, 129, 32),
    (1, 8, 1, 2, 200, 16),
    (1, 4, 1, 4, 4, 8),
    (1, 8, 2, 1, 130, 36),
    (2, 4, 1, 2, 77, 20),
];

// ANCHOR: cpu_test
#[test]
fn decoding_matches_the_reference_on_the_expanded_heads() {
    for (seed, &(b, h, kv, n, t, d)) in SHAPES.iter().enumerate() {
        let shape = DecodeShape::new(b, h, kv, n, t, d);
        let [q, k, v] = inputs(shape, seed as u64);
        let want = by_expanded_heads(q.view(), k.view(), v.view()).unwrap();
        for (name, rung) in RUNGS {
            let got = rung(q.view(), k.view(), v.view()).unwrap();
            assert_close(name, shape, &got, &want);
        }
        for chunk in [1, 16, 64, 100, t, t + 7] {
            let got = decode_split(q.view(), k.view(), v.view(), chunk).unwrap();
            assert_close(&format!("decode_split({chunk})"), shape, &got, &want);
        }
    }
}
// ANCHOR_END: cpu_test

// ANCHOR: isa_test
#[test]
fn every_instruction_set_and_split_of_the_grouped_rungs_matches_the_reference() {
    let isas = isas();
    eprintln!("instruction sets tested on this CPU: {isas:?}");
    for (seed, &(b, h, kv, n, t, d)) in SHAPES.iter().enumerate() {
        let shape = DecodeShape::new(b, h, kv, n, t, d);
        let [q, k, v] = inputs(shape, seed as u64);
        // the row-by-row reference, held to the expanded one by the test below
        let want = decode_f64(q.view(), k.view(), v.view()).unwrap();
        for &isa in &isas {
            for chunk in [None, Some(1), Some(16), Some(64), Some(100), Some(t + 7)] {
                let got =
                    decode_grouped_with(q.view(), k.view(), v.view(), isa, chunk).unwrap();
                let name = format!("decode_grouped_with({isa:?}, {chunk:?})");
                assert_close(&name, shape, &got, &want);
            }
        }
    }
}
// ANCHOR_END: isa_test

#[test]
fn the_simd_kernels_give_the_plain_rust_answer() {
    // the same sums in another order: equal up to a few units in the last place; head dims
    // of 5 registers, the last partial (72), of 8 with 5 rows a kv head (tiles of two rows
    // and one left), of 7 with 7 rows (three left), past the 8 registers in which the
    // AVX-512 kernels hold a row (144), and 1 to 3 rows a kv head, a key at a time, at head
    // dims 64, 72 and 128
    for shape in [
        DecodeShape::new(1, 8, 2, 3, 1000, 72),
        DecodeShape::new(1, 5, 1, 1, 300, 128),
        DecodeShape::new(1, 7, 1, 1, 200, 100),
        DecodeShape::new(1, 6, 1, 1, 200, 144),
        DecodeShape::new(1, 4, 4, 1, 300, 64),
        DecodeShape::new(1, 3, 1, 1, 300, 72),
        DecodeShape::new(1, 4, 2, 1, 200, 128),
    ] {
        let [q, k, v] = inputs(shape, 11);
        let plain =
            decode_grouped_with(q.view(), k.view(), v.view(), Isa::Scalar, None).unwrap();
        for isa in isas() {
            let got = decode_grouped_with(q.view(), k.view(), v.view(), isa, None).unwrap();
            let wide = |x: &Attention| (x.out.mapv(f64::from), x.lse.mapv(f64::from));
            let ((got_out, got_lse), (want_out, want_lse)) = (wide(&got), wide(&plain));
            let (out, lse) = (error(&got_out, &want_out), error(&got_lse, &want_lse));
            assert!(
                out.max_abs <= 1e-6 && lse.max_abs <= 1e-6,
                "{isa:?} {shape}: out {out}, lse {lse}"
            );
        }
    }
}

// ANCHOR: plan_test
#[test]
fn the_split_is_made_only_when_the_pairs_are_too_few_for_the_threads() {
    let shape =
        |batch, kv_heads, context| DecodeShape::new(batch, 32, kv_heads, 1, context, 64);
    // 8 pairs keep 2 threads busy, or 4: the whole cache, one task a pair
    assert_eq!(plan_chunk(shape(1, 8, 16384), 2), 16384);
    assert_eq!(plan_chunk(shape(1, 8, 16384), 4), 16384);
    // 1 pair on 2 threads: 4 chunks of 4096 keys; 2 pairs on 16 threads: 16 of 1024
    assert_eq!(plan_chunk(shape(1, 1, 16384), 2), 4096);
    assert_eq!(plan_chunk(shape(2, 1, 16384), 16), 1024);
    // whole blocks, and never fewer than MIN_CHUNK keys
    assert_eq!(plan_chunk(shape(1, 1, 1000), 2), MIN_CHUNK);
    assert_eq!(plan_chunk(shape(1, 2, 10_000), 2) % BLOCK_KEYS, 0);
    assert_eq!(plan_chunk(shape(1, 1, 1), 2), MIN_CHUNK);
}
// ANCHOR_END: plan_test

#[test]
fn the_grouped_rungs_refuse_what_decode_refuses_with_the_same_words() {
    // the cache's finiteness is checked without a pass of its own: a value that is not
    // finite in the first block, in the last partial one, in k or in v, in the second kv
    // head, is still named by its place
    let shape = DecodeShape::new(1, 4, 2, 2, 150, 20);
    let [q, k, v] = inputs(shape, 5);
    let mut cases = Vec::new();
    for (at, x) in [
        ([0, 1, 0, 3], f32::NAN),
        ([0, 0, 149, 19], f32::INFINITY),
        ([0, 1, 130, 0], f32::NEG_INFINITY),
    ] {
        let mut bad = k.clone();
        bad[at] = x;
        cases.push((q.clone(), bad.clone(), v.clone()));
        cases.push((q.clone(), k.clone(), bad));
    }
    let mut bad_q = q.clone();
    bad_q[[0, 3, 1, 7]] = f32::NAN;
    cases.push((bad_q, k.clone(), v.clone()));
    cases.push((
        q.clone(),
        k.slice(s![.., .., ..1, ..]).to_owned(),
        v.clone(),
    ));
    cases.push((Array4::zeros((1, 3, 1, 20)), k.clone(), v.clone()));
    for (q, k, v) in &cases {
        let want = err_of(decode(q.view(), k.view(), v.view()));
        for (name, rung) in RUNGS {
            assert_eq!(err_of(rung(q.view(), k.view(), v.view())), want, "{name}");
        }
        for isa in isas() {
            for chunk in [None, Some(64)] {
                let got = decode_grouped_with(q.view(), k.view(), v.view(), isa, chunk);
                assert_eq!(err_of(got), want, "{isa:?} {chunk:?}");
            }
        }
    }
    let e = err_of(decode_grouped_with(
        q.view(),
        k.view(),
        v.view(),
        Isa::Scalar,
        Some(0),
    ));
    assert!(e.contains("a chunk of 0 keys"), "{e}");
}

#[test]
fn the_products_see_a_value_that_is_not_finite_at_every_tile_of_rows() {
    // the products check what they wrote (row 0's scores and outputs), whichever kernel
    // wrote them: a tile of four rows, of two (values past 4 registers a row), a row a key
    // (fewer than four rows); 1, 3 and 5 rows a kv head; head dims of 2, 5 and 8
    // registers; the value in a key's or a value's last register, in the last partial
    // block; −∞ in a key, which gives some rows a score of −∞, a probability of 0 and no
    // trace in the output
    for d in [20, 72, 128] {
        for (heads, kv) in [(2, 2), (3, 1), (5, 1)] {
            let shape = DecodeShape::new(1, heads, kv, 1, 150, d);
            let [q, k, v] = inputs(shape, 7);
            for x in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut bad = k.clone();
                bad[[0, kv - 1, 149, d - 1]] = x;
                for (k, v) in [(&bad, &v), (&k, &bad)] {
                    let want = err_of(decode(q.view(), k.view(), v.view()));
                    for isa in isas() {
                        let got =
                            decode_grouped_with(q.view(), k.view(), v.view(), isa, None);
                        assert_eq!(err_of(got), want, "{isa:?} {shape}");
                    }
                }
            }
        }
    }
}

#[test]
fn the_row_by_row_reference_is_the_expanded_one() {
    for (seed, &(b, h, kv, n, t, d)) in SHAPES.iter().enumerate() {
        let shape = DecodeShape::new(b, h, kv, n, t, d);
        let [q, k, v] = inputs(shape, seed as u64);
        let rows = decode_f64(q.view(), k.view(), v.view()).unwrap();
        let whole = by_expanded_heads(q.view(), k.view(), v.view()).unwrap();
        let (out, lse) = (error(&rows.out, &whole.out), error(&rows.lse, &whole.lse));
        assert!(
            out.max_abs < 1e-12 && lse.max_abs < 1e-12,
            "{shape}: {out}, {lse}"
        );
    }
}

#[test]
fn grouped_heads_read_the_same_as_repeated_heads() {
    // g query heads on one kv head give exactly what g copies of it give
    let shape = DecodeShape::new(2, 6, 2, 2, 90, 16);
    let [q, k, v] = inputs(shape, 9);
    let [_, kx, vx] = expand_heads(q.view(), k.view(), v.view()).unwrap();
    let grouped = decode(q.view(), k.view(), v.view()).unwrap();
    let repeated = decode(q.view(), kx.view(), vx.view()).unwrap();
    assert_eq!(grouped.out, repeated.out);
    assert_eq!(grouped.lse, repeated.lse);
}

#[test]
fn the_diagonal_is_aligned_to_the_cache_end() {
    // row i of n sees keys up to context − n + i: changing the last key changes the last
    // row alone, and changing the keys and values before the rows changes them all
    let shape = DecodeShape::new(1, 2, 1, 3, 50, 8);
    let [q, k, v] = inputs(shape, 4);
    let a = decode(q.view(), k.view(), v.view()).unwrap();
    let (mut k2, mut v2) = (k.clone(), v.clone());
    k2.slice_mut(s![.., .., 49, ..]).mapv_inplace(|x| -2.0 * x);
    v2.slice_mut(s![.., .., 49, ..]).mapv_inplace(|x| x + 1.0);
    let b = decode(q.view(), k2.view(), v2.view()).unwrap();
    assert_eq!(
        a.out.slice(s![.., .., ..2, ..]),
        b.out.slice(s![.., .., ..2, ..])
    );
    assert_ne!(
        a.out.slice(s![.., .., 2, ..]),
        b.out.slice(s![.., .., 2, ..])
    );
    v2.slice_mut(s![.., .., 10, ..]).mapv_inplace(|x| x - 1.0);
    let c = decode(q.view(), k2.view(), v2.view()).unwrap();
    assert_ne!(
        b.out.slice(s![.., .., 0, ..]),
        c.out.slice(s![.., .., 0, ..])
    );
}

#[test]
fn by_hand_rows_round_as_step_03_by_hand_does() {
    // the last rows of step 03's attention by hand on the expanded heads: the same rounding
    // steps, summed in another order, so equal up to a unit in the last place of bf16
    let shape = DecodeShape::new(1, 4, 2, 2, 130, 64);
    let [q, k, v] = inputs(shape, 6);
    let dtype = Dtype::Bf16;
    let (q, k, v) = (
        round_array(q.view(), dtype),
        round_array(k.view(), dtype),
        round_array(v.view(), dtype),
    );
    let rows = by_hand_rows_low_precision(q.view(), k.view(), v.view(), dtype).unwrap();
    let [qx, kx, vx] = expand_heads(q.view(), k.view(), v.view()).unwrap();
    let whole = by_hand_low_precision(qx.view(), kx.view(), vx.view(), dtype);
    let last = whole.slice(s![.., .., 128.., ..]).mapv(f64::from);
    let e = error(&rows, &last);
    assert!(e.max_abs <= 2f64.powi(-7), "{e}");
}

fn err_of(r: Result<Attention, AttnError>) -> String {
    r.map(|_| ()).unwrap_err().to_string()
}

// ANCHOR: bad_input
#[test]
fn bad_input_is_refused_with_what_is_accepted() {
    let q = Array4::<f32>::zeros((1, 6, 1, 8));
    let kv = Array4::<f32>::zeros((1, 4, 10, 8));
    let e = err_of(decode(q.view(), kv.view(), kv.view()));
    assert!(
        e.contains("6 heads and the cache 4 kv heads") && e.contains("1, 2, 3, 6"),
        "{e}"
    );
    let q = Array4::<f32>::zeros((1, 4, 5, 8));
    let short = Array4::<f32>::zeros((1, 2, 3, 8));
    let e = err_of(decode(q.view(), short.view(), short.view()));
    assert!(
        e.contains("holds 3 tokens but q has 5 rows") && e.contains("at least q_rows"),
        "{e}"
    );
    let kv = Array4::<f32>::zeros((2, 2, 10, 8));
    let e = err_of(decode(q.view(), kv.view(), kv.view()));
    assert!(e.contains("the cache's batch (2)"), "{e}");
    let v = Array4::<f32>::zeros((2, 2, 11, 8));
    let e = err_of(decode(q.view(), kv.view(), v.view()));
    assert!(
        e.contains("k is [2, 2, 10, 8] and v is [2, 2, 11, 8]"),
        "{e}"
    );
    let kv = Array4::<f32>::zeros((1, 2, 10, 8));
    let e = err_of(decode_split(q.view(), kv.view(), kv.view(), 0));
    assert!(e.contains("a chunk of 0 keys"), "{e}");
    let mut bad = kv.clone();
    bad[[0, 1, 7, 2]] = f32::NAN;
    let e = err_of(decode(q.view(), bad.view(), kv.view()));
    assert!(e.contains("k[0, 1, 7, 2] is NaN"), "{e}");
    let empty = Array4::<f32>::zeros((1, 0, 1, 8));
    let none = decode(empty.view(), kv.view(), kv.view()).unwrap();
    assert_eq!(none.out.dim(), (1, 0, 1, 8));
}
// ANCHOR_END: bad_input

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    // ANCHOR: any_split
    /// Any cut of the keys into chunks, merged through the log-sum-exps, gives what the
    /// row's loop over all of them gives.
    #[test]
    fn any_split_gives_the_same_answer(
        batch in 1usize..3,
        kv_heads in 1usize..3,
        group in 1usize..4,
        q_rows in 1usize..5,
        extra in 0usize..150,
        head_dim in 1usize..20,
        chunk in 1usize..200,
        isa in 0usize..3,
        seed in any::<u64>(),
    ) {
        let context = q_rows + extra;
        let heads = group * kv_heads;
        let shape = DecodeShape::new(batch, heads, kv_heads, q_rows, context, head_dim);
        let [q, k, v] = inputs(shape, seed % 1000);
        let whole = decode(q.view(), k.view(), v.view()).unwrap();
        let split = decode_split(q.view(), k.view(), v.view(), chunk).unwrap();
        let isas = isas();
        let isa = isas[isa % isas.len()];
        let (q, k, v) = (q.view(), k.view(), v.view());
        let grouped = decode_grouped_with(q, k, v, isa, Some(chunk)).unwrap();
        let want = by_expanded_heads(q.view(), k.view(), v.view()).unwrap();
        for (name, got) in [("decode", &whole), ("split", &split), ("grouped", &grouped)] {
            let (out, lse) = (error(&got.out, &want.out), error(&got.lse, &want.lse));
            prop_assert!(
                out.max_abs <= F32_MAX_ABS && lse.max_abs <= F32_MAX_ABS,
                "{} {} chunk {}: out {}, lse {}", name, shape, chunk, out, lse
            );
        }
    }
    // ANCHOR_END: any_split
}
