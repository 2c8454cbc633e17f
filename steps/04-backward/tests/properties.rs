//! What holds for the blockwise backwards (one pass and two) on any shape and any block
//! sizes, by proptest.

mod common;

use flash_core::Shape;
use flash_core::inputs::{random_normal, random_qkv};
use ndarray::{Array4, s};
use proptest::prelude::*;
use step04_backward::{
    BlockSizes, Grads, backward, backward_by_hand, backward_two_pass, backward_with_blocks,
    forward,
};

fn shapes() -> impl Strategy<Value = (Shape, u64)> {
    (1usize..3, 1usize..3, 1usize..90, 1usize..17, any::<u64>())
        .prop_map(|(b, h, t, d, seed)| (Shape::new(b, h, t, d), seed))
}

fn blocks() -> impl Strategy<Value = BlockSizes> {
    (1usize..40, 1usize..40).prop_map(|(queries, keys)| BlockSizes { queries, keys })
}

/// `shapes()` from head dim 4 on. With fewer dims, by hand's errors and the floor's are so
/// small that the order in which the blockwise products sum (which neither models) can
/// reach twice them: a case in a few thousand at head dim 1, about one in 50,000 at 2 and
/// 3, none in 150,000 from 4.
fn large_score_shapes() -> impl Strategy<Value = (Shape, u64)> {
    (1usize..3, 1usize..3, 1usize..90, 4usize..17, any::<u64>())
        .prop_map(|(b, h, t, d, seed)| (Shape::new(b, h, t, d), seed))
}

/// A factor for q or k, 1 to 16, as often below 4 as above: two of them put the largest
/// scores of these shapes anywhere from a few units to about a thousand.
fn scale() -> impl Strategy<Value = f32> {
    (0.0f32..16f32.ln()).prop_map(f32::exp)
}

/// The largest |a − b| over dq, dk and dv, relative to the largest |b| (at least 1).
fn max_rel_diff(a: &Grads, b: &Grads) -> f32 {
    let diff = |x: &Array4<f32>, y: &Array4<f32>| {
        let top = y.iter().fold(1.0f32, |m, v| m.max(v.abs()));
        x.iter()
            .zip(y)
            .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
            / top
    };
    diff(&a.dq, &b.dq)
        .max(diff(&a.dk, &b.dk))
        .max(diff(&a.dv, &b.dv))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Any block sizes give the gradients of the backward by hand, up to f32 rounding (the
    /// blocks only change the order of the sums).
    #[test]
    fn any_block_sizes_give_the_same_gradients((shape, seed) in shapes(), blocks in blocks()) {
        let [q, k, v] = random_qkv(shape, seed);
        let dout = random_normal(shape, seed ^ 0xd0);
        let fwd = forward(q.view(), k.view(), v.view()).unwrap();
        let by_hand = backward_by_hand(q.view(), k.view(), v.view(), &fwd, dout.view()).unwrap();
        let one = backward_with_blocks(q.view(), k.view(), v.view(), &fwd, dout.view(), blocks).unwrap();
        let two = backward_two_pass(q.view(), k.view(), v.view(), &fwd, dout.view(), blocks).unwrap();
        for (name, got) in [("one pass", one), ("two passes", two)] {
            let d = max_rel_diff(&got, &by_hand);
            prop_assert!(d <= 1e-5, "{} {:?} on {}: differs from by hand by {:e} of the largest value", name, blocks, shape, d);
        }
    }

    /// dq of tokens 0..=cut depends on tokens 0..=cut only: changing every later token's q,
    /// k, v and dO leaves it bit for bit as it was.
    #[test]
    fn dq_is_causal((shape, seed) in shapes(), cut in 0usize..90, blocks in blocks()) {
        let cut = cut % shape.tokens;
        let [q, k, v] = random_qkv(shape, seed);
        let dout = random_normal(shape, seed ^ 0xd0);
        let mut changed = [q.clone(), k.clone(), v.clone(), dout.clone()];
        let [q2, k2, v2] = random_qkv(shape, seed ^ 0x5eed);
        let later = s![.., .., cut + 1.., ..];
        for (x, new) in changed.iter_mut().zip([&q2, &k2, &v2, &q2]) {
            x.slice_mut(later).assign(&new.slice(later));
        }
        let run = |[q, k, v, dout]: &[Array4<f32>; 4]| {
            let fwd = forward(q.view(), k.view(), v.view()).unwrap();
            backward_with_blocks(q.view(), k.view(), v.view(), &fwd, dout.view(), blocks).unwrap()
        };
        let (a, b) = (run(&[q, k, v, dout]), run(&changed));
        let upto = s![.., .., ..=cut, ..];
        prop_assert_eq!(a.dq.slice(upto), b.dq.slice(upto));
    }

    /// With q and k scaled so that the scores reach hundreds, the blockwise backwards
    /// (default blocks, and 16 × 24 in one pass and in two), after the forward of step 01
    /// and after that of step 02, keep FlashAttention's rule for dq, dk and dv: at most
    /// twice the error of the larger of the backward by hand and the floor of an `f32`
    /// log-sum-exp (`common`), plus 10⁻⁶. A forward that rounds its scores otherwise than
    /// the backward does (step 02 with `log2 e/√d` folded into its queries) fails it in
    /// every run of 32 cases.
    #[test]
    fn large_scores_meet_flash_attentions_rule(
        (shape, seed) in large_score_shapes(),
        (sq, sk) in (scale(), scale()),
    ) {
        let [q, k, v] = random_qkv(shape, seed);
        let (q, k) = (q * sq, k * sk);
        let dout = random_normal(shape, seed ^ 0xd0);
        let check = common::Check::new(&q, &k, &v, &dout);
        let forwards = [
            ("step 01", forward(q.view(), k.view(), v.view()).unwrap()),
            ("step 02", step02_online_softmax::attention(q.view(), k.view(), v.view()).unwrap()),
        ];
        let small = BlockSizes { queries: 16, keys: 24 };
        for (fname, fwd) in &forwards {
            let floor = check.floor(&fwd.out);
            let (qv, kv, vv, dv) = (q.view(), k.view(), v.view(), dout.view());
            for (name, got) in [
                ("one pass", backward(qv, kv, vv, fwd, dv)),
                ("one pass, small blocks", backward_with_blocks(qv, kv, vv, fwd, dv, small)),
                ("two passes, small blocks", backward_two_pass(qv, kv, vv, fwd, dv, small)),
            ] {
                let result = check.rule(&got.unwrap(), floor);
                prop_assert!(
                    result.is_ok(),
                    "{} after {}, q × {}, k × {}, {}: {}",
                    name, fname, sq, sk, shape, result.unwrap_err()
                );
            }
        }
    }
}

/// Every task writes only its own rows and sums in one fixed order: the gradients are the
/// same bit for bit on one thread and on several.
#[test]
fn the_result_does_not_depend_on_the_number_of_threads() {
    let shape = Shape::new(2, 3, 300, 32);
    let [q, k, v] = random_qkv(shape, 5);
    let dout = random_normal(shape, 6);
    let fwd = forward(q.view(), k.view(), v.view()).unwrap();
    let run = |threads| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let blocks = BlockSizes::default();
            let one = backward(q.view(), k.view(), v.view(), &fwd, dout.view()).unwrap();
            let two =
                backward_two_pass(q.view(), k.view(), v.view(), &fwd, dout.view(), blocks);
            (one, two.unwrap())
        })
    };
    let one = run(1);
    assert_eq!(one, run(4));
    assert_eq!(one, run(3));
}
