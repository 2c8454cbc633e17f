//! Grouped-query attention in the training kernels (step 03's forward and step 04's
//! backward, step 06's Hopper forward and backward) against the `f64` reference on
//! repeated heads, with FlashAttention's rule: the error of each of out, dq, dk and dv at most twice that of
//! attention by hand in the same precision (on the repeated heads, dk and dv summed over
//! each group as autograd sums a repeat's gradient). Every kernel is checked in the same
//! test, step 06's among them, so the two tests that run them need a Hopper GPU and are
//! ignored elsewhere; the refusals of bad input on the host run everywhere.

use flash_core::inputs::random_normal;
use flash_core::reference::{Error, error};
use flash_core::{AttnError, Shape};
use ndarray::{Array4, ArrayView4};
use step03_cuda_forward::gpu::{Dtype, Gpu};
use step03_cuda_forward::host::{by_hand_low_precision, round, round_array};
use step04_backward::cuda::backward_by_hand_low_precision;
use step05_train::layers::{repeat_kv, sum_groups};
use step08_inference::grouped::{
    Forward, attention, check_grouped, forward_backward, reference, reference_grads,
};

/// Added to twice by hand's error, for the case where both are (nearly) zero.
const MARGIN: f64 = 1e-5;
/// The kernels' log-sum-exp is summed in f32 from the 16-bit inputs' exact products.
const KERNEL_LSE: f64 = 1e-3;

/// (batch, query heads, kv heads, tokens, head dim): groups of 1 (plain), 2, 3, 4 and 8
/// (one kv head: multi-query), odd heads, partial blocks, one token.
const SHAPES: [(usize, usize, usize, usize, usize); 6] = [
    (2, 8, 2, 300, 64),
    (1, 8, 1, 77, 128),
    (3, 6, 3, 130, 64),
    (1, 4, 4, 200, 128),
    (2, 4, 1, 1, 64),
    (1, 12, 4, 1000, 128),
];

fn inputs(shape: Shape, kv_heads: usize, seed: u64) -> [Array4<f32>; 4] {
    let kv = Shape {
        heads: kv_heads,
        ..shape
    };
    [
        random_normal(shape, 4 * seed),
        random_normal(kv, 4 * seed + 1),
        random_normal(kv, 4 * seed + 2),
        random_normal(shape, 4 * seed + 3),
    ]
}

/// `ours ≤ 2 × by hand + MARGIN`, both against the reference, or a panic naming them.
fn rule(what: &str, ours: Error, by_hand: Error) {
    println!("{what}: ours {ours}; by hand {by_hand}");
    assert!(
        ours.max_abs <= 2.0 * by_hand.max_abs + MARGIN,
        "{what}: ours {ours} is more than twice by hand's {by_hand}"
    );
}

// ANCHOR: grouped_forward_test
#[test]
#[ignore = "needs a Hopper GPU (compute capability 9.0)"]
fn grouped_forwards_match_the_reference_within_twice_by_hand_error() {
    let gpu = Gpu::new().expect("a GPU");
    for (i, (b, h, kv, t, d)) in SHAPES.into_iter().enumerate() {
        for dtype in [Dtype::Bf16, Dtype::F16] {
            let shape = Shape::new(b, h, t, d);
            let [q, k, v, _] = inputs(shape, kv, i as u64);
            // the reference sees exactly the values the GPU saw
            let (qr, kr, vr) = (
                round_array(q.view(), dtype),
                round_array(k.view(), dtype),
                round_array(v.view(), dtype),
            );
            let exact = reference(qr.view(), kr.view(), vr.view()).unwrap();
            let g = h / kv;
            let by_hand = by_hand_low_precision(
                q.view(),
                repeat_kv(k.clone(), g).view(),
                repeat_kv(v.clone(), g).view(),
                dtype,
            );
            let by_hand = error(&by_hand, &exact.out);
            for kernel in Forward::ALL {
                let what =
                    format!("{} {shape} kv heads {kv} {}", kernel.name(), dtype.name());
                let got = attention(&gpu, kernel, q.view(), k.view(), v.view(), dtype)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                rule(&what, error(&got.out, &exact.out), by_hand);
                let lse = error(&got.lse, &exact.lse);
                assert!(lse.max_abs <= KERNEL_LSE, "{what}: lse {lse}");
            }
        }
    }
}
// ANCHOR_END: grouped_forward_test

/// Step 04's backward by hand in `dtype` on the repeated heads, dk and dv summed over each
/// group and rounded, as autograd computes the gradient of k repeated.
fn by_hand_grads(
    [q, k, v, dout]: [ArrayView4<f32>; 4],
    g: usize,
    dtype: Dtype,
) -> [Array4<f64>; 3] {
    let grads = backward_by_hand_low_precision(
        q,
        repeat_kv(k.to_owned(), g).view(),
        repeat_kv(v.to_owned(), g).view(),
        dout,
        dtype,
    );
    let summed = |x: &Array4<f32>| {
        sum_groups(x.mapv(f64::from), g).mapv(|s| round(s as f32, dtype) as f64)
    };
    [
        grads.dq.mapv(f64::from),
        summed(&grads.dk),
        summed(&grads.dv),
    ]
}

#[test]
#[ignore = "needs a Hopper GPU (compute capability 9.0)"]
fn the_grouped_backward_matches_the_reference_within_twice_by_hand_error() {
    let gpu = Gpu::new().expect("a GPU");
    for (i, (b, h, kv, t, d)) in SHAPES.into_iter().enumerate() {
        for dtype in [Dtype::Bf16, Dtype::F16] {
            let shape = Shape::new(b, h, t, d);
            let [q, k, v, dout] = inputs(shape, kv, 50 + i as u64);
            let rounded = [&q, &k, &v, &dout].map(|x| round_array(x.view(), dtype));
            let exact = reference_grads(
                rounded[0].view(),
                rounded[1].view(),
                rounded[2].view(),
                rounded[3].view(),
            )
            .unwrap();
            let hand =
                by_hand_grads([q.view(), k.view(), v.view(), dout.view()], h / kv, dtype);
            for kernel in Forward::ALL {
                let what = format!(
                    "{} backward {shape} kv heads {kv} {}",
                    kernel.name(),
                    dtype.name()
                );
                let (_, got) = forward_backward(
                    &gpu,
                    kernel,
                    q.view(),
                    k.view(),
                    v.view(),
                    dout.view(),
                    dtype,
                )
                .unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(got.dk.dim(), (b, kv, t, d), "{what}: dk has k's heads");
                for (name, ours, by_hand, exact) in [
                    ("dq", &got.dq, &hand[0], &exact.dq),
                    ("dk", &got.dk, &hand[1], &exact.dk),
                    ("dv", &got.dv, &hand[2], &exact.dv),
                ] {
                    rule(
                        &format!("{what} {name}"),
                        error(ours, exact),
                        error(by_hand, exact),
                    );
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn kernels_without_grouped_heads_refuse_them() {
    let gpu = Gpu::new().expect("a GPU");
    let shape = Shape::new(1, 4, 64, 64);
    let [q, k, v, dout] = inputs(shape, 2, 7);
    let up = |x: &Array4<f32>| gpu.upload(x.view(), Dtype::Bf16).unwrap();
    let (q, k, v, dout) = (up(&q), up(&k), up(&v), up(&dout));
    let said = |e: AttnError| e.to_string();
    let e = said(gpu.by_hand(&q, &k, &v).err().expect("refused"));
    assert!(e.contains("q has 4 heads and k and v 2"), "{e}");
    let fwd = gpu.forward(&q, &k, &v).unwrap();
    let e = step04_backward::cuda_by_hand::backward(&gpu, &q, &k, &v, &fwd, &dout);
    let e = said(e.err().expect("refused"));
    assert!(e.contains("the backward by hand takes one head"), "{e}");
    let three = gpu
        .upload(Array4::<f32>::zeros((1, 3, 64, 64)).view(), Dtype::Bf16)
        .unwrap();
    let e = said(gpu.forward(&q, &three, &three).err().expect("refused"));
    assert!(e.contains("accepted for 4 query heads: 1, 2, 4"), "{e}");
}

#[test]
fn bad_groups_are_refused_on_the_host() {
    let q = Array4::<f32>::zeros((2, 8, 5, 64));
    let k = Array4::<f32>::zeros((2, 3, 5, 64));
    let e = check_grouped(&q.view(), &k.view(), &k.view()).unwrap_err();
    assert!(
        e.to_string()
            .contains("accepted for 8 query heads: 1, 2, 4, 8"),
        "{e}"
    );
    let k = Array4::<f32>::zeros((2, 2, 5, 64));
    let v = Array4::<f32>::zeros((2, 2, 6, 64));
    let e = check_grouped(&q.view(), &k.view(), &v.view()).unwrap_err();
    assert!(matches!(e, AttnError::ShapeMismatch { .. }), "{e}");
}
