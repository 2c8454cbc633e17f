//! Properties of attention by hand that hold for any shape, checked by proptest on random
//! shapes and seeded random inputs.

use flash_core::Shape;
use flash_core::inputs::random_qkv;
use ndarray::{Array4, Axis, s};
use proptest::prelude::*;
use step01_naive::{attention, probabilities};

fn shapes() -> impl Strategy<Value = (Shape, u64)> {
    (1usize..3, 1usize..4, 1usize..40, 1usize..33, any::<u64>())
        .prop_map(|(b, h, t, d, seed)| (Shape::new(b, h, t, d), seed))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Token i's output depends on keys and values 0..=i only: changing later tokens' k and
    /// v leaves it exactly as it was.
    #[test]
    fn causality((shape, seed) in shapes(), cut in 0usize..40) {
        let cut = cut % shape.tokens;
        let [q, k, v] = random_qkv(shape, seed);
        let [_, k2, v2] = random_qkv(shape, seed ^ 0x5eed);
        let (mut k_changed, mut v_changed) = (k.clone(), v.clone());
        k_changed.slice_mut(s![.., .., cut + 1.., ..]).assign(&k2.slice(s![.., .., cut + 1.., ..]));
        v_changed.slice_mut(s![.., .., cut + 1.., ..]).assign(&v2.slice(s![.., .., cut + 1.., ..]));
        let a = attention(q.view(), k.view(), v.view()).unwrap();
        let b = attention(q.view(), k_changed.view(), v_changed.view()).unwrap();
        prop_assert_eq!(a.out.slice(s![.., .., ..=cut, ..]), b.out.slice(s![.., .., ..=cut, ..]));
        prop_assert_eq!(a.lse.slice(s![.., .., ..=cut]), b.lse.slice(s![.., .., ..=cut]));
    }

    /// With one token, the only key it can see is itself: its probability is 1 and the
    /// output is v.
    #[test]
    fn one_token_gives_v((shape, seed) in shapes()) {
        let shape = Shape { tokens: 1, ..shape };
        let [q, k, v] = random_qkv(shape, seed);
        prop_assert_eq!(attention(q.view(), k.view(), v.view()).unwrap().out, v);
    }

    /// The output is linear in v: scaling v by c scales the output by c.
    #[test]
    fn scaling_v_scales_the_output((shape, seed) in shapes(), c in -4.0f32..4.0) {
        let [q, k, v] = random_qkv(shape, seed);
        let a = attention(q.view(), k.view(), v.view()).unwrap().out;
        let b = attention(q.view(), k.view(), (&v * c).view()).unwrap().out;
        for (x, y) in a.iter().zip(b.iter()) {
            prop_assert!((x * c - y).abs() <= 1e-5 * (1.0 + y.abs()), "{} * {} vs {}", x, c, y);
        }
    }

    /// Every row of the probability table sums to 1, and is 0 above the diagonal.
    #[test]
    fn probability_rows_sum_to_one((shape, seed) in shapes()) {
        let [q, k, _] = random_qkv(shape, seed);
        let p: Array4<f32> = probabilities(q.view(), k.view()).unwrap();
        for (i, rows) in p.axis_iter(Axis(2)).enumerate() {
            for row in rows.lanes(Axis(2)) {
                let sum: f64 = row.iter().map(|&x| x as f64).sum();
                prop_assert!((sum - 1.0).abs() < 1e-5, "row {} sums to {}", i, sum);
                prop_assert!(row.iter().skip(i + 1).all(|&x| x == 0.0));
            }
        }
    }
}
