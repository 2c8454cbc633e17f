//! The backward kernels, and the backward by hand on the GPU, against the f64 reference
//! backward, with FlashAttention's rule for each of out, dq, dk and dv: at most twice the
//! error of attention by hand (forward and autograd backward) in the same precision,
//! computed on the CPU. On seeded normal inputs at every head dim, and on inputs whose
//! scores are large (queries or keys scaled up to 100 times, shifted, large values) in f16
//! and bf16. Ignored where there is no GPU.

use flash_core::inputs::{random_normal, random_qkv};
use flash_core::{Attention, AttnError, Shape};
use ndarray::{Array4, ArrayView4};
use step03_cuda_forward::gpu::{DeviceTensor, Dtype, Gpu};
use step04_backward::Grads;
use step04_backward::cuda::forward_backward;
use step04_backward::cuda_by_hand;
use step04_backward::rule::BackwardCheck;

#[path = "common/cases.rs"]
mod cases;

/// A forward and backward on host arrays: [`forward_backward`] (the kernels) or
/// [`cuda_by_hand::forward_backward`].
type ForwardBackward = fn(
    &Gpu,
    ArrayView4<f32>,
    ArrayView4<f32>,
    ArrayView4<f32>,
    ArrayView4<f32>,
    Dtype,
) -> Result<(Attention, Grads), AttnError>;

/// Odd numbers of sequences and heads, partial blocks, one token; head dims 64 and 32.
const SHAPES: [(usize, usize, usize, usize); 6] = [
    (1, 1, 1, 64),
    (3, 5, 77, 64),
    (2, 3, 128, 64),
    (3, 1, 300, 64),
    (1, 3, 1024, 64),
    (2, 3, 190, 32),
];

fn check(
    gpu: &Gpu,
    method: &str,
    run: ForwardBackward,
    shape: Shape,
    dtype: Dtype,
    seed: u64,
) {
    let [q, k, v] = random_qkv(shape, seed);
    let dout = random_normal(shape, seed + 99);
    check_inputs(
        gpu,
        run,
        [&q, &k, &v, &dout],
        dtype,
        &format!("{method} {shape}"),
    );
}

/// The rule for out, dq, dk and dv on one input ([`BackwardCheck`], `src/rule.rs`), `what`
/// naming it in messages.
fn check_inputs(
    gpu: &Gpu,
    run: ForwardBackward,
    inputs: [&Array4<f32>; 4],
    dtype: Dtype,
    what: &str,
) {
    let check = BackwardCheck::run(gpu, run, inputs, dtype, what)
        .unwrap_or_else(|e| panic!("{what} {}: {e}", dtype.name()));
    println!("{check}");
    if let Err(e) = check.verdict() {
        panic!("{e}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn backward_matches_the_reference_within_twice_by_hand_error() {
    let gpu = Gpu::new().expect("a GPU");
    let mut seed = 500;
    for dtype in [Dtype::Bf16, Dtype::F16] {
        for (batch, heads, tokens, head_dim) in SHAPES {
            seed += 1;
            let shape = Shape::new(batch, heads, tokens, head_dim);
            check(&gpu, "kernels", forward_backward, shape, dtype, seed);
        }
    }
}

/// Head dim 128 (eight warps of 16 rows a block): lengths with partial blocks of every size
/// the kernels use, one token, and more than one block of each kind.
#[test]
#[ignore = "needs a CUDA GPU"]
fn backward_head_dim_128_matches_the_reference_within_twice_by_hand_error() {
    let gpu = Gpu::new().expect("a GPU");
    let mut seed = 600;
    for dtype in [Dtype::Bf16, Dtype::F16] {
        for (batch, heads, tokens) in [(1, 1, 1), (3, 2, 77), (2, 3, 200), (1, 2, 1000)] {
            seed += 1;
            let shape = Shape::new(batch, heads, tokens, 128);
            check(&gpu, "kernels", forward_backward, shape, dtype, seed);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn backward_by_hand_matches_the_reference_within_twice_by_hand_error() {
    let gpu = Gpu::new().expect("a GPU");
    let mut seed = 700;
    for dtype in [Dtype::Bf16, Dtype::F16] {
        for (batch, heads, tokens, head_dim) in SHAPES.into_iter().chain([(2, 2, 150, 128)])
        {
            seed += 1;
            let shape = Shape::new(batch, heads, tokens, head_dim);
            let run = cuda_by_hand::forward_backward;
            check(&gpu, "by hand", run, shape, dtype, seed);
        }
    }
}

// ANCHOR: gpu_large_scores
/// The cases of `large_scores.rs` on the GPU: scores in the hundreds and thousands, where a
/// kernel whose probabilities and log-sum-exp disagree by a rounding is far off. In f16,
/// which keeps three more bits than bf16, by hand's error is smaller and the rule tighter.
#[test]
#[ignore = "needs a CUDA GPU"]
fn large_scores_meet_flash_attentions_rule_on_the_gpu() {
    let gpu = Gpu::new().expect("a GPU");
    for head_dim in [64, 128] {
        let shape = Shape::new(1, 2, 300, head_dim);
        let [q, k, v] = random_qkv(shape, 7);
        let dout = random_normal(shape, 8);
        for (case, [q, k, v]) in cases::large_score_cases(&q, &k, &v) {
            for dtype in [Dtype::F16, Dtype::Bf16] {
                check_inputs(
                    &gpu,
                    forward_backward,
                    [&q, &k, &v, &dout],
                    dtype,
                    &format!("{case}, {shape}"),
                );
            }
        }
    }
}
// ANCHOR_END: gpu_large_scores

#[test]
#[ignore = "needs a CUDA GPU"]
fn backward_is_deterministic_and_refuses_bad_input() {
    let gpu = Gpu::new().expect("a GPU");
    for head_dim in [64, 128] {
        deterministic_and_checks_dout(&gpu, "kernels", forward_backward, head_dim);
    }
    // a head dim no kernel is compiled for, refused by the backward itself (the forward
    // would refuse it first), with the head dims it takes
    let odd = Shape::new(1, 1, 16, 96);
    let up = |x: &Array4<f32>| gpu.upload(x.view(), Dtype::Bf16).unwrap();
    let [q, k, v] = random_qkv(odd, 1).map(|x| up(&x));
    let fwd = gpu.alloc_output(odd, Dtype::Bf16).unwrap();
    let err = step04_backward::cuda::backward(&gpu, &q, &k, &v, &fwd, &q)
        .err()
        .expect("head dim 96 refused");
    assert!(
        err.to_string().contains(
            "head_dim 96 is not supported by this method; supported: 32, 64, 128"
        ),
        "{err}"
    );
}

/// Two runs give the same bits (no race, no atomics), and a `dout` of another shape is
/// refused with an error that names it.
fn deterministic_and_checks_dout(
    gpu: &Gpu,
    method: &str,
    run: ForwardBackward,
    head_dim: usize,
) {
    let shape = Shape::new(2, 2, 333, head_dim);
    let [q, k, v] = random_qkv(shape, 5);
    let grads = |dout: &Array4<f32>| {
        run(gpu, q.view(), k.view(), v.view(), dout.view(), Dtype::Bf16).map(|(_, g)| g)
    };
    let dout = random_normal(shape, 6);
    let (a, b) = (grads(&dout).unwrap(), grads(&dout).unwrap());
    assert!(
        a.dq == b.dq && a.dk == b.dk && a.dv == b.dv,
        "{method}, head dim {head_dim}: two runs differ: a race?"
    );
    let err = grads(&random_normal(Shape::new(2, 2, 332, head_dim), 2)).unwrap_err();
    assert!(err.to_string().contains("dout"), "{method}: {err}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn backward_by_hand_is_deterministic_and_refuses_bad_input() {
    let gpu = Gpu::new().expect("a GPU");
    deterministic_and_checks_dout(&gpu, "by hand", cuda_by_hand::forward_backward, 64);
}

/// Zeros of `shape` on the GPU, without making them on the host.
fn device_zeros(gpu: &Gpu, shape: Shape) -> DeviceTensor {
    DeviceTensor {
        data: gpu.stream().alloc_zeros::<u16>(shape.len()).unwrap(),
        shape,
        dtype: Dtype::Bf16,
    }
}

/// compute-sanitizer counts the refused allocation (`cuMemAllocAsync`: out of memory) as
/// one API error: it is what this test asks for (`--report-api-errors no`, or `--skip` this
/// test, for a summary of 0).
#[test]
#[ignore = "needs a CUDA GPU"]
fn backward_by_hand_names_a_table_that_does_not_fit() {
    let gpu = Gpu::new().expect("a GPU");
    // 4M tokens: 256 MiB a tensor, and a table of 2^44 values (32 TiB)
    let shape = Shape::new(1, 1, 1 << 22, 32);
    let [q, k, v, dout] = [(); 4].map(|_| device_zeros(&gpu, shape));
    let fwd = gpu.alloc_output(shape, Dtype::Bf16).unwrap();
    let err = cuda_by_hand::backward(&gpu, &q, &k, &v, &fwd, &dout)
        .err()
        .expect("a table of 32 TiB cannot fit");
    let want = 2u128 << 44;
    match &err {
        AttnError::OutOfMemory { what, bytes } => {
            assert_eq!(*bytes, want, "{err}");
            assert!(
                what.contains("[1, 4194304, 4194304] table of probabilities"),
                "{err}"
            );
        }
        other => panic!("not OutOfMemory: {other}"),
    }
}
