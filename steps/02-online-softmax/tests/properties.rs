//! Properties of the online softmax that hold for any shape and any block size, checked by
//! proptest on small random shapes and seeded random inputs.

use flash_core::inputs::random_qkv;
use flash_core::reference::error;
use flash_core::{Attention, Shape};
use ndarray::s;
use proptest::prelude::*;
use step02_online_softmax::{Config, Isa, attention, attention_blocked, attention_with};

fn shapes() -> impl Strategy<Value = (Shape, u64)> {
    (1usize..3, 1usize..3, 1usize..70, 1usize..40, any::<u64>())
        .prop_map(|(b, h, t, d, seed)| (Shape::new(b, h, t, d), seed))
}

/// Within f32 rounding of step 01: a few units in the last place of values of order 1.
fn close_to_step_01(got: &Attention, naive: &Attention) -> Result<(), TestCaseError> {
    let (out, lse) = (
        error(&got.out, &naive.out.mapv(f64::from)),
        error(&got.lse, &naive.lse.mapv(f64::from)),
    );
    prop_assert!(
        out.max_abs < 4e-6 && lse.max_abs < 4e-6,
        "out {}; lse {}",
        out,
        lse
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    // ANCHOR: any_block_size
    /// Any block size, 1 to past the sequence's end, partial blocks included, gives step
    /// 01's answer: the correction factor makes the blocking invisible.
    #[test]
    fn any_block_size_gives_the_answer_of_step_01(
        (shape, seed) in shapes(),
        block in 1usize..80,
    ) {
        let [q, k, v] = random_qkv(shape, seed);
        let naive = step01_naive::attention(q.view(), k.view(), v.view()).unwrap();
        let got = attention_blocked(q.view(), k.view(), v.view(), block).unwrap();
        close_to_step_01(&got, &naive)?;
    }
    // ANCHOR_END: any_block_size

    /// The same for the fast version's query and key blocks, in every instruction set.
    #[test]
    fn any_fast_blocking_gives_the_answer_of_step_01(
        (shape, seed) in shapes(),
        block_q in 1usize..80,
        block_k in 1usize..80,
        isa in prop::sample::select(vec![Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon]),
    ) {
        prop_assume!(isa.is_available());
        let [q, k, v] = random_qkv(shape, seed);
        let naive = step01_naive::attention(q.view(), k.view(), v.view()).unwrap();
        let cfg = Config { isa, block_q, block_k, ..Config::default() };
        let got = attention_with(q.view(), k.view(), v.view(), cfg).unwrap();
        close_to_step_01(&got, &naive)?;
    }

    /// Token i's output depends on keys and values 0..=i only: changing later tokens' k and
    /// v leaves it exactly as it was, in both versions.
    #[test]
    fn causality((shape, seed) in shapes(), cut in 0usize..70, block in 1usize..40) {
        let cut = cut % shape.tokens;
        let [q, k, v] = random_qkv(shape, seed);
        let [_, k2, v2] = random_qkv(shape, seed ^ 0x5eed);
        let (mut k_changed, mut v_changed) = (k.clone(), v.clone());
        k_changed.slice_mut(s![.., .., cut + 1.., ..]).assign(&k2.slice(s![.., .., cut + 1.., ..]));
        v_changed.slice_mut(s![.., .., cut + 1.., ..]).assign(&v2.slice(s![.., .., cut + 1.., ..]));
        let fast = |k: &ndarray::Array4<f32>, v: &ndarray::Array4<f32>| {
            attention(q.view(), k.view(), v.view()).unwrap()
        };
        let looped = |k: &ndarray::Array4<f32>, v: &ndarray::Array4<f32>| {
            attention_blocked(q.view(), k.view(), v.view(), block).unwrap()
        };
        for (a, b) in [
            (fast(&k, &v), fast(&k_changed, &v_changed)),
            (looped(&k, &v), looped(&k_changed, &v_changed)),
        ] {
            let before = s![.., .., ..=cut, ..];
            prop_assert_eq!(a.out.slice(before), b.out.slice(before));
            prop_assert_eq!(a.lse.slice(s![.., .., ..=cut]), b.lse.slice(s![.., .., ..=cut]));
        }
    }
}
