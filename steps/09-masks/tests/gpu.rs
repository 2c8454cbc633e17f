//! The masked Hopper kernels against the `f64` reference with FlashAttention's rule: every
//! built-in mask and score function, a user's mask given as CUDA, grouped-query attention,
//! fewer queries than keys, rows that see no key, bf16 and f16, forward and backward; and
//! the block mask the GPU computes against the one the CPU computes. The same for the
//! Ampere kernels (steps 03's and 04's), asked for by name so that a Hopper runs them too.
//!
//! Ignored without a GPU: `cargo test -p step09-masks --test gpu -- --include-ignored` on a
//! Hopper (the Ampere kernels' tests alone, on any GPU from Ampere: `-- --include-ignored
//! ampere`).

use flash_core::Shape;
use flash_core::inputs::random_normal;
use step03_cuda_forward::gpu::{Dtype, Gpu};
use step09_masks::cuda::{self, DeviceMask, GpuMask};
use step09_masks::cuda_ampere::Kernels;
use step09_masks::rule::{GpuCase, check_on_gpu, check_on_gpu_with};
use step09_masks::{CustomMask, Documents, Mask, ScoreMod, Varies};

const CASES: [GpuCase; 4] = [
    GpuCase {
        batch: 2,
        heads: 4,
        kv_heads: 2,
        tq: 300,
        tk: 300,
        d: 64,
    },
    GpuCase {
        batch: 1,
        heads: 2,
        kv_heads: 1,
        tq: 77,
        tk: 333,
        d: 128,
    },
    GpuCase {
        batch: 2,
        heads: 3,
        kv_heads: 3,
        tq: 129,
        tk: 257,
        d: 64,
    },
    GpuCase {
        batch: 1,
        heads: 2,
        kv_heads: 2,
        tq: 1,
        tk: 200,
        d: 128,
    },
];

/// Documents of a few lengths, different in each sequence, covering `tk` tokens.
fn documents(batch: usize, tk: usize) -> Documents {
    let mut ids = Vec::with_capacity(batch * tk);
    for b in 0..batch {
        let (mut doc, mut left) = (0, 17 + 40 * b);
        for _ in 0..tk {
            if left == 0 {
                doc += 1;
                left = 23 + 31 * ((doc as usize + b) % 4);
            }
            ids.push(doc);
            left -= 1;
        }
    }
    Documents::from_ids(batch, tk, ids).unwrap()
}

/// A user's mask with rows that see nothing: a third of the queries see no key at all.
fn holes() -> Mask {
    Mask::Custom(
        CustomMask::new("holes", |_, _, q, k| q % 3 != 0 && k <= q)
            .with_cuda(
                "__device__ __forceinline__ bool mask_mod(int b, int h, int q, int k, \
                 const int* __restrict__ data) {\n    return q % 3 != 0 && k <= q;\n}\n",
            )
            .varying(Varies {
                batch: false,
                head: false,
            }),
    )
}

fn masks(c: GpuCase) -> Vec<(Mask, ScoreMod)> {
    vec![
        (Mask::Causal, ScoreMod::None),
        (Mask::Full, ScoreMod::None),
        (Mask::Sliding { window: 70 }, ScoreMod::None),
        (Mask::PrefixLm { prefix: 100 }, ScoreMod::None),
        (Mask::Documents(documents(c.batch, c.tk)), ScoreMod::None),
        (Mask::Causal, ScoreMod::SoftCap { cap: 1.5 }),
        (
            Mask::Sliding { window: 130 },
            ScoreMod::Alibi { heads: c.heads },
        ),
        (holes(), ScoreMod::None),
    ]
}

/// Every case of [`CASES`] with every mask of [`masks`], mostly in bf16 and a quarter in
/// f16, on the kernels `kernels` (`None`: the ones this GPU runs by default).
fn check_every_mask(gpu: &Gpu, kernels: Option<Kernels>) {
    let mut failures = Vec::new();
    let mut checked = 0;
    for (i, c) in CASES.into_iter().enumerate() {
        for (j, (mask, score)) in masks(c).into_iter().enumerate() {
            let dtype = if (i + j) % 4 == 3 {
                Dtype::F16
            } else {
                Dtype::Bf16
            };
            let seed = 100 * i as u64 + j as u64;
            let checked_one = match kernels {
                Some(k) => check_on_gpu_with(gpu, k, c, &mask, &score, dtype, seed),
                None => check_on_gpu(gpu, c, &mask, &score, dtype, seed),
            };
            match checked_one {
                Ok(()) => checked += 1,
                Err(e) => failures.push(e),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        checked + failures.len(),
        failures.join("\n")
    );
    assert_eq!(checked, CASES.len() * 8);
}

#[test]
#[ignore = "needs a CUDA GPU (a Hopper)"]
fn every_mask_and_score_function_keeps_the_rule_forward_and_backward() {
    check_every_mask(Gpu::shared().expect("a GPU"), None);
}

// ANCHOR: ampere_test
/// Steps 03's and 04's kernels with the masks, asked for by name: on a Hopper they run
/// instead of step 06's, with the same cases and the same rule.
#[test]
#[ignore = "needs a CUDA GPU (Ampere or newer)"]
fn the_ampere_kernels_keep_the_rule_for_every_mask_and_score_function() {
    check_every_mask(Gpu::shared().expect("a GPU"), Some(Kernels::Ampere));
}
// ANCHOR_END: ampere_test

/// A GPU of compute capability 9.0 runs step 06's kernels unless asked, any other steps
/// 03's and 04's; a block mask says which it was made for, and the call runs those.
#[test]
#[ignore = "needs a CUDA GPU (Ampere or newer)"]
fn the_kernels_follow_the_compute_capability_unless_asked() {
    let gpu = Gpu::shared().expect("a GPU");
    let cc = gpu.context().compute_capability().unwrap();
    let default = Kernels::for_gpu(gpu).unwrap();
    assert_eq!(
        default == Kernels::Hopper,
        cc == (9, 0),
        "{cc:?}: {default:?}"
    );
    let gm = GpuMask::new(&Mask::Causal, &ScoreMod::None).unwrap();
    let q = Shape::new(1, 2, 128, 64);
    let dm = DeviceMask::with_kernels(gpu, &gm, Kernels::Ampere, q, 128).unwrap();
    assert_eq!(dm.kernels(), Kernels::Ampere);
    let hopper = DeviceMask::with_kernels(gpu, &gm, Kernels::Hopper, q, 128);
    match hopper {
        Ok(dm) => assert_eq!((dm.kernels(), cc), (Kernels::Hopper, (9, 0))),
        Err(e) => assert!(e.to_string().contains("compute capability 9.0"), "{e}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU (a Hopper)"]
fn a_block_mask_made_for_another_shape_is_refused() {
    let gpu = Gpu::shared().expect("a GPU");
    let gm = GpuMask::new(&Mask::Causal, &ScoreMod::None).unwrap();
    let dm = DeviceMask::new(gpu, &gm, 1, 2, 128, 128, 64).unwrap();
    let s = Shape::new(1, 2, 256, 64);
    let x = random_normal(s, 1);
    let t = gpu.upload(x.view(), Dtype::Bf16).unwrap();
    let e = cuda::forward(gpu, &t, &t, &t, &dm).err().expect("refused");
    assert!(e.to_string().contains("make one for this shape"), "{e}");
}

#[test]
#[ignore = "needs a CUDA GPU (a Hopper)"]
fn a_mask_that_does_not_compile_names_its_line() {
    let gpu = Gpu::shared().expect("a GPU");
    let bad = Mask::Custom(CustomMask::new("typo", |_, _, q, k| k <= q).with_cuda(
        "__device__ __forceinline__ bool mask_mod(int b, int h, int q, int k, \
         const int* __restrict__ data) {\n    return k <= q\n}\n",
    ));
    let gm = GpuMask::new(&bad, &ScoreMod::None).unwrap();
    let e = DeviceMask::new(gpu, &gm, 1, 1, 64, 64, 64)
        .err()
        .expect("refused");
    assert!(e.to_string().contains("NVRTC"), "{e}");
}

#[test]
#[ignore = "needs a CUDA GPU (a Hopper)"]
fn the_gpu_exercise_checker_accepts_the_solution_and_refuses_the_template() {
    use step09_masks::exercise::{DILATED_CU, GPU_WINDOWS, check_dilated_cuda};
    let gpu = Gpu::shared().expect("a GPU");
    assert_eq!(check_dilated_cuda(gpu, DILATED_CU), Ok(GPU_WINDOWS.len()));
    // the template as shipped sees no key at all; a window that forgets the dilation sees
    // too many (neither reads exercises/, which a reader fills in)
    let none = "__device__ __forceinline__ bool mask_mod(int b, int h, int q, int k, \
                const int* __restrict__ data) { return false; }";
    let undilated = "__device__ __forceinline__ bool mask_mod(int b, int h, int q, int k, \
                     const int* __restrict__ data) { return k <= q && q - k < WINDOW; }";
    for template in [none, undilated] {
        assert!(check_dilated_cuda(gpu, template).is_err(), "{template}");
    }
}
