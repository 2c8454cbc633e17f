//! The forward kernel, and every rung of the ladder that leads to it, on a GPU against the
//! f64 reference, with FlashAttention's rule: its error is at most twice that of attention
//! by hand computed in the same precision. Ignored where there is no GPU (`cargo test --
//! --include-ignored` runs them on one).

use flash_core::inputs::random_qkv;
use flash_core::{AttnError, Shape};
use ndarray::s;
use step03_cuda_forward::Rung;
use step03_cuda_forward::gpu::{Dtype, Gpu};
use step03_cuda_forward::rule::{BY_HAND_LSE, ForwardCheck, HostFn, KERNEL_LSE};

fn check(gpu: &Gpu, shape: Shape, dtype: Dtype, seed: u64) {
    check_method(
        gpu,
        shape,
        dtype,
        seed,
        "flash_forward",
        Gpu::attention,
        KERNEL_LSE,
    );
}

/// A rung of the ladder as a [`HostFn`].
fn rung_method(rung: Rung) -> impl HostFn {
    move |gpu: &Gpu, q, k, v, dtype| gpu.ladder_attention(rung, q, k, v, dtype)
}

// ANCHOR: check_method
/// FlashAttention's rule for `method` on one input ([`ForwardCheck`], `src/rule.rs`), both
/// errors printed, and in the failure message.
fn check_method(
    gpu: &Gpu,
    shape: Shape,
    dtype: Dtype,
    seed: u64,
    name: &str,
    method: impl HostFn,
    lse_bound: f64,
) {
    let check = ForwardCheck::run(gpu, shape, dtype, seed, name, method, lse_bound)
        .unwrap_or_else(|e| panic!("{name} {shape} {}: {e}", dtype.name()));
    println!("{check}");
    if let Err(e) = check.verdict() {
        panic!("{e}");
    }
}
// ANCHOR_END: check_method

#[test]
#[ignore = "needs a CUDA GPU"]
fn by_hand_on_the_gpu_matches_the_reference() {
    let gpu = Gpu::new().expect("a GPU");
    for dtype in [Dtype::Bf16, Dtype::F16] {
        for (batch, heads, tokens, head_dim) in [
            (1, 1, 1, 64),
            (3, 5, 77, 64),
            (2, 3, 300, 32),
            (1, 2, 1024, 128),
        ] {
            check_method(
                &gpu,
                Shape::new(batch, heads, tokens, head_dim),
                dtype,
                tokens as u64,
                "by_hand",
                Gpu::attention_by_hand,
                BY_HAND_LSE,
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn forward_matches_the_reference_within_twice_by_hand_error() {
    let gpu = Gpu::new().expect("a GPU");
    println!("{}", gpu.describe());
    let mut seed = 100;
    for dtype in [Dtype::Bf16, Dtype::F16] {
        for (batch, heads, tokens) in [
            (1, 1, 1),
            (3, 5, 77),
            (2, 3, 128),
            (3, 1, 300),
            (1, 3, 1024),
            (1, 2, 4097),
        ] {
            seed += 1;
            check(&gpu, Shape::new(batch, heads, tokens, 64), dtype, seed);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn forward_supports_head_dims_32_and_128() {
    let gpu = Gpu::new().expect("a GPU");
    for head_dim in [32, 128] {
        for tokens in [1, 190, 513] {
            check(
                &gpu,
                Shape::new(2, 3, tokens, head_dim),
                Dtype::Bf16,
                tokens as u64 + head_dim as u64,
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn forward_is_causal_and_deterministic() {
    let gpu = Gpu::new().expect("a GPU");
    causal_and_deterministic(&gpu, "flash_forward", Gpu::attention);
}

/// Two runs give the same bits (no race), and changing the keys and values of tokens 200 on
/// leaves the outputs of tokens before 200 alone (and changes the others).
fn causal_and_deterministic(gpu: &Gpu, name: &str, method: impl HostFn) {
    let shape = Shape::new(2, 2, 333, 64);
    let [q, k, v] = random_qkv(shape, 5);
    let a = method(gpu, q.view(), k.view(), v.view(), Dtype::Bf16).unwrap();
    let again = method(gpu, q.view(), k.view(), v.view(), Dtype::Bf16).unwrap();
    assert_eq!(
        a.out, again.out,
        "{name}: two runs on the same input differ: a race?"
    );
    let (mut k2, mut v2) = (k.clone(), v.clone());
    k2.slice_mut(s![.., .., 200.., ..])
        .mapv_inplace(|x| -3.0 * x);
    v2.slice_mut(s![.., .., 200.., ..])
        .mapv_inplace(|x| x + 1.0);
    let b = method(gpu, q.view(), k2.view(), v2.view(), Dtype::Bf16).unwrap();
    assert_eq!(
        a.out.slice(s![.., .., ..200, ..]),
        b.out.slice(s![.., .., ..200, ..]),
        "{name}: later tokens changed earlier outputs"
    );
    assert_ne!(
        a.out.slice(s![.., .., 200.., ..]),
        b.out.slice(s![.., .., 200.., ..]),
        "{name}"
    );
}

// ANCHOR: check_rung
/// One rung of the ladder on the lengths of the step's table (1, 77, 128, 300, 1024:
/// partial and whole blocks) in bf16 and f16 at head dim 64, then at its other head dims.
fn check_rung(rung: Rung) {
    let gpu = Gpu::new().expect("a GPU");
    let mut seed = 1000 * rung.number() as u64;
    for dtype in [Dtype::Bf16, Dtype::F16] {
        for (batch, heads, tokens) in [
            (1, 1, 1),
            (3, 5, 77),
            (2, 3, 128),
            (3, 1, 300),
            (1, 3, 1024),
        ] {
            seed += 1;
            check_method(
                &gpu,
                Shape::new(batch, heads, tokens, 64),
                dtype,
                seed,
                rung.name(),
                rung_method(rung),
                KERNEL_LSE,
            );
        }
        for &head_dim in rung.head_dims().iter().filter(|&&d| d != 64) {
            for tokens in [77, 300] {
                seed += 1;
                check_method(
                    &gpu,
                    Shape::new(2, 3, tokens, head_dim),
                    dtype,
                    seed,
                    rung.name(),
                    rung_method(rung),
                    KERNEL_LSE,
                );
            }
        }
    }
}
// ANCHOR_END: check_rung

#[test]
#[ignore = "needs a CUDA GPU"]
fn ladder_rung_1_rows_matches_the_reference_within_twice_by_hand_error() {
    check_rung(Rung::Rows);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn ladder_rung_2_shared_matches_the_reference_within_twice_by_hand_error() {
    check_rung(Rung::Shared);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn ladder_rung_3_mma_matches_the_reference_within_twice_by_hand_error() {
    check_rung(Rung::Mma);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn ladder_rung_4_ldmatrix_matches_the_reference_within_twice_by_hand_error() {
    check_rung(Rung::Ldmatrix);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn ladder_rung_5_flash_matches_the_reference_within_twice_by_hand_error() {
    check_rung(Rung::Flash);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn ladder_rungs_are_causal_deterministic_and_refuse_head_dims_they_lack() {
    let gpu = Gpu::new().expect("a GPU");
    for rung in Rung::ALL {
        causal_and_deterministic(&gpu, rung.name(), rung_method(rung));
    }
    let [q, k, v] = random_qkv(Shape::new(1, 2, 10, 128), 1);
    for rung in [Rung::Rows, Rung::Shared] {
        let err = gpu
            .ladder_attention(rung, q.view(), k.view(), v.view(), Dtype::Bf16)
            .unwrap_err();
        assert!(
            matches!(err, AttnError::UnsupportedHeadDim { head_dim: 128, .. })
                && err.to_string().contains("32, 64"),
            "{}: {err}",
            rung.name()
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_input_is_refused_before_launch() {
    let gpu = Gpu::new().expect("a GPU");
    let [q, k, _] = random_qkv(Shape::new(1, 2, 10, 64), 1);
    let [_, _, v_short] = random_qkv(Shape::new(1, 2, 9, 64), 1);
    let err = gpu
        .attention(q.view(), k.view(), v_short.view(), Dtype::Bf16)
        .unwrap_err();
    assert!(matches!(err, AttnError::ShapeMismatch { .. }), "{err}");
    let [q, k, v] = random_qkv(Shape::new(1, 2, 10, 48), 1);
    let err = gpu
        .attention(q.view(), k.view(), v.view(), Dtype::Bf16)
        .unwrap_err();
    assert!(
        err.to_string().contains("head_dim 48 is not supported")
            && err.to_string().contains("32, 64, 128"),
        "{err}"
    );
    // device tensors of different dtypes
    let [q, k, v] = random_qkv(Shape::new(1, 1, 8, 64), 2);
    let (q, k, v) = (
        gpu.upload(q.view(), Dtype::Bf16).unwrap(),
        gpu.upload(k.view(), Dtype::F16).unwrap(),
        gpu.upload(v.view(), Dtype::Bf16).unwrap(),
    );
    let err = gpu.forward(&q, &k, &v).err().expect("mixed dtypes refused");
    assert!(err.to_string().contains("must have one dtype"), "{err}");
    // empty input: an empty output, no launch
    let [q, k, v] = random_qkv(Shape::new(1, 2, 0, 64), 1);
    let got = gpu
        .attention(q.view(), k.view(), v.view(), Dtype::Bf16)
        .unwrap();
    assert_eq!(got.out.dim(), (1, 2, 0, 64));
}

/// Runs everywhere: without a CUDA driver, opening the GPU is an error that says so.
#[test]
fn no_gpu_is_an_error_not_a_panic() {
    // SAFETY: only tries to open the shared library
    let driver = unsafe { cudarc::driver::sys::is_culib_present() };
    match Gpu::new() {
        Ok(gpu) => assert!(
            driver,
            "opened {} without a driver library?",
            gpu.describe()
        ),
        Err(e) => {
            let msg = e.to_string();
            assert!(matches!(e, AttnError::Device { .. }), "{msg}");
            if !driver {
                assert!(msg.contains("no CUDA driver"), "{msg}");
            }
        }
    }
}
