//! The Hopper forward kernels on the GPU against the f64 reference with FlashAttention's
//! rule (the error at most twice that of attention by hand in the same precision): every
//! rung, in every block shape a method launches it in. Those tests are `#[ignore = "needs a
//! Hopper GPU …"]`: a machine without one lists them as ignored; `-- --include-ignored`
//! runs them, and run where there is no Hopper GPU they fail, saying so. The last two check
//! on every machine: what the method and the compiler say without a Hopper GPU or without
//! NVRTC, and that they work with.

use flash_core::inputs::random_qkv;
use flash_core::reference::{attention_f64, error};
use flash_core::{AttnError, Shape};
use step03_cuda_forward::gpu::{Dtype, Gpu, compile};
use step03_cuda_forward::host::{by_hand_low_precision, round_array};
use step06_hopper::forward;
use step06_hopper::kernel::{ForwardKernel, ForwardRung, HEAD_DIMS};
use step06_hopper::layout::TmaRank;
use step06_hopper::methods::Forward;

/// The kernel's log-sum-exp is accumulated in f32 from the 16-bit inputs' exact products.
const KERNEL_LSE: f64 = 1e-3;

/// Lengths with partial blocks, one block, several, and the diagonal in every position.
const SHAPES: [(usize, usize, usize); 6] = [
    (1, 2, 1),
    (1, 2, 64),
    (1, 2, 200),
    (2, 3, 1000),
    (1, 2, 2048),
    (1, 1, 4097),
];

/// Every kernel a method launches at head dim `d`, whatever the shape: each rung in its
/// shapes on both sides of the lengths where a shape changes, in both block orders.
fn every_kernel(d: usize) -> Vec<ForwardKernel> {
    let mut all = Vec::new();
    for t in [1, 1 << 14] {
        for k in ForwardRung::ALL.map(|r| r.shape(Shape::new(1, 1, t, d), 1)) {
            for k in [k, k.other_order()] {
                if !all.contains(&k) {
                    all.push(k);
                }
            }
        }
    }
    all
}

/// `cuda_hopper`'s forward on host arrays.
fn hopper_forward(
    q: ndarray::ArrayView4<f32>,
    k: ndarray::ArrayView4<f32>,
    v: ndarray::ArrayView4<f32>,
    dtype: Dtype,
) -> Result<flash_core::Attention, AttnError> {
    Forward::Library.on_host(q, k, v, dtype)
}

// ANCHOR: check_hopper
#[test]
#[ignore = "needs a Hopper GPU (compute capability 9.0)"]
fn hopper_forward_is_within_twice_by_hand_error_in_every_rung_and_shape() {
    let gpu = Gpu::shared().expect("a GPU");
    for (dtype, d) in [Dtype::Bf16, Dtype::F16]
        .into_iter()
        .flat_map(|dtype| HEAD_DIMS.map(|d| (dtype, d)))
    {
        for (i, &(b, h, t)) in SHAPES.iter().enumerate() {
            let shape = Shape::new(b, h, t, d);
            let [q, k, v] = random_qkv(shape, 40 + i as u64);
            let rounded = [&q, &k, &v].map(|x| round_array(x.view(), dtype));
            let reference =
                attention_f64(rounded[0].view(), rounded[1].view(), rounded[2].view())
                    .unwrap();
            let by_hand = error(
                &by_hand_low_precision(q.view(), k.view(), v.view(), dtype),
                &reference.out,
            );
            let up = |x: &ndarray::Array4<f32>| gpu.upload(x.view(), dtype).unwrap();
            let (dq, dk, dv) = (up(&q), up(&k), up(&v));
            for kernel in every_kernel(d) {
                let mut result = gpu.alloc_output(shape, dtype).unwrap();
                forward::forward_with(gpu, kernel, &dq, &dk, &dv, &mut result).unwrap();
                let got = gpu.download_attention(&result).unwrap();
                let out = error(&got.out, &reference.out);
                let lse = error(&got.lse, &reference.lse);
                println!(
                    "{} {shape} {}: out {out}, lse {lse}; by hand {by_hand}",
                    dtype.name(),
                    kernel.name()
                );
                assert!(
                    out.max_abs <= 2.0 * by_hand.max_abs + 1e-5,
                    "{} {shape} {}: out {out}; by hand {by_hand}",
                    dtype.name(),
                    kernel.name()
                );
                assert!(
                    lse.max_abs <= KERNEL_LSE,
                    "{} {shape} {}: lse {lse}",
                    dtype.name(),
                    kernel.name()
                );
            }
        }
    }
}
// ANCHOR_END: check_hopper

#[test]
#[ignore = "needs a Hopper GPU (compute capability 9.0)"]
fn hopper_forward_is_causal_and_deterministic() {
    for d in HEAD_DIMS {
        causal_and_deterministic(Shape::new(1, 2, 300, d));
    }
}

fn causal_and_deterministic(shape: Shape) {
    let [q, k, v] = random_qkv(shape, 5);
    let first = hopper_forward(q.view(), k.view(), v.view(), Dtype::Bf16).unwrap();
    let again = hopper_forward(q.view(), k.view(), v.view(), Dtype::Bf16).unwrap();
    assert_eq!(first.out, again.out, "{shape}: two runs differ");
    assert_eq!(first.lse, again.lse, "{shape}: two runs differ");
    // a change to the keys and values after row 150 leaves rows 0..=150 exactly as they
    // were
    let (mut k2, mut v2) = (k.clone(), v.clone());
    k2.slice_mut(ndarray::s![.., .., 151.., ..]).fill(3.0);
    v2.slice_mut(ndarray::s![.., .., 151.., ..]).fill(-7.0);
    let changed = hopper_forward(q.view(), k2.view(), v2.view(), Dtype::Bf16).unwrap();
    let rows = ndarray::s![.., .., ..151, ..];
    assert_eq!(
        first.out.slice(rows),
        changed.out.slice(rows),
        "{shape}: a later key changed an earlier row"
    );
}

#[test]
#[ignore = "needs a Hopper GPU (compute capability 9.0)"]
fn hopper_forward_refuses_head_dims_it_lacks_naming_the_ones_it_takes() {
    for d in [32, 96] {
        let [q, k, v] = random_qkv(Shape::new(1, 1, 16, d), 1);
        match hopper_forward(q.view(), k.view(), v.view(), Dtype::Bf16) {
            Err(e @ AttnError::UnsupportedHeadDim { .. }) => {
                assert!(e.to_string().contains("64, 128"), "{e}")
            }
            other => panic!("head dim {d}: {:?}", other.map(|_| ())),
        }
    }
}

/// Without a GPU (or without a Hopper one), the method is an error that says what it needs,
/// not a panic; with a Hopper GPU it runs. Checked on every machine: the method on this
/// one, and what a GPU of compute capability 8.0 is told.
#[test]
fn no_gpu_is_an_error_not_a_panic() {
    let hopper = Gpu::shared().is_ok_and(|gpu| forward::check_hopper(gpu).is_ok());
    let [q, k, v] = random_qkv(Shape::new(1, 1, 8, 64), 1);
    match hopper_forward(q.view(), k.view(), v.view(), Dtype::Bf16) {
        Ok(_) => assert!(hopper, "the Hopper forward ran without a Hopper GPU"),
        Err(e) => {
            assert!(!hopper, "on a Hopper GPU: {e}");
            assert!(
                e.to_string().contains("GPU") || e.to_string().contains("CUDA"),
                "{e}"
            );
        }
    }
    let e = forward::check_capability(8, 0).unwrap_err().to_string();
    assert!(e.contains("9.0") && e.contains("this one is 8.0"), "{e}");
}

/// Without NVRTC, compiling is an error that says what is missing, not a panic inside
/// cudarc; with it, each kernel compiles for `sm_90a` (no GPU needed). Checked on every
/// machine: the one this machine gets, and the error's message.
#[test]
fn without_nvrtc_compiling_is_an_error_not_a_panic() {
    let present = step03_cuda_forward::gpu::nvrtc_present();
    let missing = step03_cuda_forward::gpu::missing_nvrtc().to_string();
    assert!(
        missing.contains("NVRTC") && missing.contains("LD_LIBRARY_PATH"),
        "{missing}"
    );
    let forward = ForwardKernel::for_shape(Shape::new(1, 1, 1, 64), 1);
    let forward = compile(&forward.build(Dtype::Bf16, 64, TmaRank::Three), "sm_90");
    let kernel =
        step06_hopper::kernel::BackwardKernels::for_shape(Shape::new(1, 1, 1 << 14, 64))
            .dkdv;
    let backward = compile(&kernel.build(Dtype::Bf16, 64, TmaRank::Four), "sm_90");
    for (what, compiled) in [("forward", forward), ("backward", backward)] {
        match compiled {
            Ok(_) => assert!(present, "the {what} compiled without NVRTC"),
            Err(e) if present => panic!("the {what}: {e}"),
            Err(e) => {
                assert!(e.to_string().contains("NVRTC"), "{e}");
                assert_eq!(e.to_string(), missing, "the {what}");
            }
        }
    }
}
