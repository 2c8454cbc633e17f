//! Decoding on the CPU against the `f64` reference on the expanded heads, for every split
//! of the keys, and its refusals of bad input.

use flash_core::inputs::random_normal;
use flash_core::reference::error;
use flash_core::{Attention, AttnError, Shape};
use ndarray::{Array4, s};
use proptest::prelude::*;
use step03_cuda_forward::Dtype;
use step03_cuda_forward::host::{by_hand_low_precision, round_array};
use step08_inference::reference::{
    by_expanded_heads, by_hand_rows_low_precision, decode_f64, expand_heads,
};
use step08_inference::{DecodeShape, decode, decode_split};

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

fn assert_close(
    name: &str,
    shape: DecodeShape,
    got: &Attention,
    q: &Array4<f32>,
    k: &Array4<f32>,
    v: &Array4<f32>,
) {
    let want = by_expanded_heads(q.view(), k.view(), v.view()).unwrap();
    let (out, lse) = (error(&got.out, &want.out), error(&got.lse, &want.lse));
    assert!(
        out.max_abs <= F32_MAX_ABS && lse.max_abs <= F32_MAX_ABS,
        "{name} {shape}: out {out}, lse {lse}"
    );
}

/// (batch, q heads, kv heads, q rows, context, head dim): plain heads, grouped, one kv
/// head, a cache no longer than the rows, lengths that leave partial blocks of 64 keys.
const SHAPES: [(usize, usize, usize, usize, usize, usize); 7] = [
    (1, 1, 1, 1, 1, 8),
    (2, 4, 4, 1, 77, 16),
    (2, 4, 2, 1, 77, 16),
    (1, 8, 2, 4, 300, 64),
    (2, 6, 3, 3, 129, 32),
    (1, 8, 1, 2, 200, 16),
    (1, 4, 1, 4, 4, 8),
];

// ANCHOR: cpu_test
#[test]
fn decoding_matches_the_reference_on_the_expanded_heads() {
    for (seed, &(b, h, kv, n, t, d)) in SHAPES.iter().enumerate() {
        let shape = DecodeShape::new(b, h, kv, n, t, d);
        let [q, k, v] = inputs(shape, seed as u64);
        let got = decode(q.view(), k.view(), v.view()).unwrap();
        assert_close("decode", shape, &got, &q, &k, &v);
        for chunk in [1, 16, 64, 100, t, t + 7] {
            let got = decode_split(q.view(), k.view(), v.view(), chunk).unwrap();
            assert_close(&format!("decode_split({chunk})"), shape, &got, &q, &k, &v);
        }
    }
}
// ANCHOR_END: cpu_test

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
        seed in any::<u64>(),
    ) {
        let context = q_rows + extra;
        let heads = group * kv_heads;
        let shape = DecodeShape::new(batch, heads, kv_heads, q_rows, context, head_dim);
        let [q, k, v] = inputs(shape, seed % 1000);
        let whole = decode(q.view(), k.view(), v.view()).unwrap();
        let split = decode_split(q.view(), k.view(), v.view(), chunk).unwrap();
        let want = by_expanded_heads(q.view(), k.view(), v.view()).unwrap();
        for (name, got) in [("decode", &whole), ("split", &split)] {
            let (out, lse) = (error(&got.out, &want.out), error(&got.lse, &want.lse));
            prop_assert!(
                out.max_abs <= F32_MAX_ABS && lse.max_abs <= F32_MAX_ABS,
                "{} {} chunk {}: out {}, lse {}", name, shape, chunk, out, lse
            );
        }
    }
    // ANCHOR_END: any_split
}
