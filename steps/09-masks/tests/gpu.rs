//! The masked Hopper kernels against the `f64` reference with FlashAttention's rule: every
//! built-in mask and score function, a user's mask given as CUDA, grouped-query attention,
//! fewer queries than keys, rows that see no key, bf16 and f16, forward and backward; and
//! the block mask the GPU computes against the one the CPU computes.
//!
//! Ignored without a GPU: `cargo test -p step09-masks --test gpu -- --include-ignored` on a
//! Hopper.

use flash_core::Shape;
use flash_core::inputs::random_normal;
use flash_core::reference::{Error, error};
use ndarray::{Array3, Array4};
use step03_cuda_forward::host::round_array;
use step03_cuda_forward::{Dtype, Gpu};
use step09_masks::cuda::{self, DeviceMask, GpuMask};
use step09_masks::reference::{attention_f64, backward_f64};
use step09_masks::rule::{backward_by_hand_low_precision, by_hand_low_precision};
use step09_masks::{BlockMask, BlockSizes, CustomMask, Documents, Mask, ScoreMod, Varies};

/// q's shape, k's heads and length.
#[derive(Clone, Copy, Debug)]
struct Case {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    tq: usize,
    tk: usize,
    d: usize,
}

const CASES: [Case; 4] = [
    Case {
        batch: 2,
        heads: 4,
        kv_heads: 2,
        tq: 300,
        tk: 300,
        d: 64,
    },
    Case {
        batch: 1,
        heads: 2,
        kv_heads: 1,
        tq: 77,
        tk: 333,
        d: 128,
    },
    Case {
        batch: 2,
        heads: 3,
        kv_heads: 3,
        tq: 129,
        tk: 257,
        d: 64,
    },
    Case {
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

fn masks(c: Case) -> Vec<(Mask, ScoreMod)> {
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

/// Ours within twice by hand's error, plus 10⁻⁵ of the reference's size.
fn within(what: &str, ours: Error, hand: Error, want: &Array4<f64>) -> Result<(), String> {
    let size = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    if ours.max_abs.is_nan() || ours.max_abs > 2.0 * hand.max_abs + 1e-5 * size {
        return Err(format!(
            "{what}: max abs error {:.3e} > 2 × by hand's {:.3e}",
            ours.max_abs, hand.max_abs
        ));
    }
    Ok(())
}

/// The log-sum-exps: −∞ exactly where the reference's are, close elsewhere.
fn lse_matches(what: &str, ours: &Array3<f32>, want: &Array3<f64>) -> Result<(), String> {
    for ((idx, &o), &w) in ours.indexed_iter().zip(want.iter()) {
        let ok = if w == f64::NEG_INFINITY {
            o == f32::NEG_INFINITY
        } else {
            (o as f64 - w).abs() <= 2e-2 * (1.0 + w.abs())
        };
        if !ok {
            return Err(format!(
                "{what}: lse at {idx:?} is {o}, the reference's {w}"
            ));
        }
    }
    Ok(())
}

fn run_case(
    gpu: &Gpu,
    c: Case,
    mask: &Mask,
    score: &ScoreMod,
    dtype: Dtype,
    seed: u64,
) -> Result<(), String> {
    let what = format!("{c:?} {} {} {}", mask.name(), score.name(), dtype.name());
    let qs = Shape::new(c.batch, c.heads, c.tq, c.d);
    let ks = Shape::new(c.batch, c.kv_heads, c.tk, c.d);
    let q = random_normal(qs, seed);
    let k = random_normal(ks, seed + 1);
    let v = random_normal(ks, seed + 2);
    let dout = random_normal(qs, seed + 3);
    let gm = GpuMask::new(mask, score).map_err(|e| format!("{what}: {e}"))?;
    let dm = DeviceMask::new(gpu, &gm, c.batch, c.heads, c.tq, c.tk, c.d)
        .map_err(|e| format!("{what}: {e}"))?;
    // the GPU's block mask lets through as many scores as the CPU's
    let cpu_blocks = BlockMask::new(
        mask,
        (c.batch, c.heads, c.tq, c.tk),
        BlockSizes {
            queries: cuda::TILE_Q,
            keys: cuda::TILE_K,
        },
    )
    .map_err(|e| format!("{what}: {e}"))?;
    if dm.computed_scores() != cpu_blocks.visible() {
        return Err(format!(
            "{what}: the GPU's block mask counts {} visible scores, the CPU's {}",
            dm.computed_scores(),
            cpu_blocks.visible()
        ));
    }
    let up = |x: &Array4<f32>| gpu.upload(x.view(), dtype).map_err(|e| e.to_string());
    let (dq_, dk_, dv_, ddo) = (up(&q)?, up(&k)?, up(&v)?, up(&dout)?);
    let fwd =
        cuda::forward(gpu, &dq_, &dk_, &dv_, &dm).map_err(|e| format!("{what}: {e}"))?;
    let grads = cuda::backward(gpu, &dq_, &dk_, &dv_, &fwd, &ddo, &dm)
        .map_err(|e| format!("{what}: {e}"))?;
    let down = |x| gpu.download(x).map_err(|e| e.to_string());
    let out = down(&fwd.out)?;
    let lse = gpu
        .stream()
        .clone_dtoh(&fwd.lse)
        .map_err(|e| e.to_string())?;
    let lse = Array3::from_shape_vec((c.batch, c.heads, c.tq), lse).unwrap();
    let (dq, dk, dv) = (down(&grads.dq)?, down(&grads.dk)?, down(&grads.dv)?);

    let r = |x: &Array4<f32>| round_array(x.view(), dtype);
    let (qr, kr, vr, dr) = (r(&q), r(&k), r(&v), r(&dout));
    let want = attention_f64(qr.view(), kr.view(), vr.view(), mask, score)
        .map_err(|e| e.to_string())?;
    let want_g = backward_f64(qr.view(), kr.view(), vr.view(), dr.view(), mask, score)
        .map_err(|e| e.to_string())?;
    let hand = by_hand_low_precision(q.view(), k.view(), v.view(), mask, score, dtype)
        .map_err(|e| e.to_string())?;
    let hand_g = backward_by_hand_low_precision(
        q.view(),
        k.view(),
        v.view(),
        dout.view(),
        mask,
        score,
        dtype,
    )
    .map_err(|e| e.to_string())?;
    within(
        &format!("{what} out"),
        error(&out, &want.out),
        error(&hand.out, &want.out),
        &want.out,
    )?;
    lse_matches(&what, &lse, &want.lse)?;
    for (name, ours, hand, want) in [
        ("dq", &dq, &hand_g.dq, &want_g.dq),
        ("dk", &dk, &hand_g.dk, &want_g.dk),
        ("dv", &dv, &hand_g.dv, &want_g.dv),
    ] {
        within(
            &format!("{what} {name}"),
            error(ours, want),
            error(hand, want),
            want,
        )?;
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU (a Hopper)"]
fn every_mask_and_score_function_keeps_the_rule_forward_and_backward() {
    let gpu = Gpu::shared().expect("a GPU");
    let mut failures = Vec::new();
    let mut checked = 0;
    for (i, c) in CASES.into_iter().enumerate() {
        for (j, (mask, score)) in masks(c).into_iter().enumerate() {
            let dtype = if (i + j) % 4 == 3 {
                Dtype::F16
            } else {
                Dtype::Bf16
            };
            match run_case(gpu, c, &mask, &score, dtype, 100 * i as u64 + j as u64) {
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
