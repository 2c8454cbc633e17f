//! The ring on GPUs against the f64 reference. First the kernels without the causal mask
//! (`CAUSAL=0`) alone, against unmasked attention in f64; then the ring's forward and
//! backward with 1 to 4 ranks simulated on GPU 0, and with NCCL over every GPU when there
//! are two or more, under FlashAttention's rule as steps 03 and 04 apply it: each of out,
//! dq, dk and dv at most twice the error of attention by hand in the same precision.
//!
//! Every test here is ignored by default, with what it needs as its reason: `needs a CUDA
//! GPU`, or for the one over NCCL, whose name starts with `two_gpus`, `needs two CUDA GPUs
//! and NCCL`. `cargo test -- --include-ignored` runs them; a test run without what it needs
//! fails, saying what it found. On a machine with one GPU: `-- --include-ignored --skip
//! two_gpus`.

use flash_core::inputs::{random_normal, random_qkv};
use flash_core::method::Grads;
use flash_core::reference::{Reference, attention_f64, error};
use flash_core::{Attention, AttnError, Shape};
use ndarray::{Array2, Array3, Array4, ArrayView2, s};
use step03_cuda_forward::gpu::{Dtype, Gpu};
use step03_cuda_forward::host::{by_hand_low_precision, round_array};
use step04_backward::cuda::{backward_by_hand_low_precision, backward_full};
use step04_backward::reference::{ReferenceGrads, backward_f64};
use step07_multi_gpu::comm::nccl_present;
use step07_multi_gpu::gpu::{Ranks, ring_forward, ring_forward_backward};

/// Unmasked attention in f64 for one head: out, lse, and the gradients for `dout`.
fn unmasked_head(
    q: ArrayView2<f64>,
    k: ArrayView2<f64>,
    v: ArrayView2<f64>,
    dout: ArrayView2<f64>,
) -> (Array2<f64>, Vec<f64>, [Array2<f64>; 3]) {
    let scale = 1.0 / (q.ncols() as f64).sqrt();
    let s = q.dot(&k.t()) * scale;
    let mut p = s.clone();
    let mut lse = Vec::new();
    for mut row in p.rows_mut() {
        let m = row.fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        row.mapv_inplace(|x| (x - m).exp());
        let sum = row.sum();
        lse.push(m + sum.ln());
        row.mapv_inplace(|x| x / sum);
    }
    let out = p.dot(&v);
    let dv = p.t().dot(&dout);
    let dp = dout.dot(&v.t());
    let mut ds = Array2::zeros(p.dim());
    for i in 0..p.nrows() {
        let delta: f64 = (0..p.ncols()).map(|j| p[[i, j]] * dp[[i, j]]).sum();
        for j in 0..p.ncols() {
            ds[[i, j]] = p[[i, j]] * (dp[[i, j]] - delta);
        }
    }
    let dq = ds.dot(&k) * scale;
    let dk = ds.t().dot(&q) * scale;
    (out, lse, [dq, dk, dv])
}

/// The largest value of a reference, at least 1 (the scale of a tolerance).
fn size(x: &Array4<f64>) -> f64 {
    x.iter().fold(1.0f64, |m, v| m.max(v.abs()))
}

/// A unit in the last place at 1 for `dtype`.
fn ulp(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::Bf16 => 2f64.powi(-8),
        _ => 2f64.powi(-11),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn unmasked_kernels_match_unmasked_attention_in_f64() {
    let gpu = Gpu::new().expect("a GPU");
    let mut seed = 700;
    for dtype in [Dtype::Bf16, Dtype::F16] {
        for (batch, heads, tokens, head_dim) in [
            (2, 3, 200, 64),
            (1, 2, 128, 64),
            (1, 1, 1, 64),
            (2, 1, 77, 32),
            (1, 2, 300, 128),
        ] {
            seed += 1;
            let shape = Shape::new(batch, heads, tokens, head_dim);
            let [q, k, v] = random_qkv(shape, seed);
            let dout = random_normal(shape, seed + 1);
            let up = |x: &Array4<f32>| gpu.upload(x.view(), dtype).unwrap();
            let (qd, kd, vd, dd) = (up(&q), up(&k), up(&v), up(&dout));
            let mut fwd = gpu.alloc_output(shape, dtype).unwrap();
            gpu.forward_full_into(&qd, &kd, &vd, &mut fwd).unwrap();
            let g = backward_full(&gpu, &qd, &kd, &vd, &fwd, &dd).unwrap();
            let got = gpu.download_attention(&fwd).unwrap();
            let got_grads = [&g.dq, &g.dk, &g.dv].map(|x| gpu.download(x).unwrap());
            // the reference sees exactly the values the GPU saw
            let [qr, kr, vr, dr] =
                [&q, &k, &v, &dout].map(|x| round_array(x.view(), dtype).mapv(f64::from));
            let mut want_out = Array4::zeros(shape.dims());
            let mut want_lse = Array3::zeros((batch, heads, tokens));
            let mut want = [(); 3].map(|_| Array4::<f64>::zeros(shape.dims()));
            for b in 0..batch {
                for h in 0..heads {
                    let head = |x: &Array4<f64>| x.slice(s![b, h, .., ..]).to_owned();
                    let (o, l, grads) = unmasked_head(
                        head(&qr).view(),
                        head(&kr).view(),
                        head(&vr).view(),
                        head(&dr).view(),
                    );
                    want_out.slice_mut(s![b, h, .., ..]).assign(&o);
                    for (i, x) in l.into_iter().enumerate() {
                        want_lse[[b, h, i]] = x;
                    }
                    for (w, g) in want.iter_mut().zip(grads) {
                        w.slice_mut(s![b, h, .., ..]).assign(&g);
                    }
                }
            }
            let what = format!("unmasked {shape} {}", dtype.name());
            let out = error(&got.out, &want_out);
            let lse = error(&got.lse, &want_lse);
            println!("{what}: out {out}; lse {lse}");
            assert!(out.max_abs <= 8.0 * ulp(dtype), "{what}: out {out}");
            assert!(lse.max_abs < 1e-3, "{what}: lse {lse}");
            for ((name, got), want) in ["dq", "dk", "dv"].iter().zip(&got_grads).zip(&want)
            {
                let e = error(got, want);
                println!("{what}: {name} {e} (size {:.2})", size(want));
                assert!(
                    e.max_abs <= 16.0 * ulp(dtype) * size(want),
                    "{what}: {name} {e}, allowed {:.2e}",
                    16.0 * ulp(dtype) * size(want)
                );
            }
        }
    }
}

/// The f64 reference and attention by hand in `dtype` for one input: what the rule compares
/// a ring's result with.
struct Expected {
    out: Reference,
    grads: ReferenceGrads,
    hand_out: Array4<f32>,
    hand: Grads,
}

fn expected([q, k, v, dout]: [&Array4<f32>; 4], dtype: Dtype) -> Expected {
    let [qr, kr, vr, dr] = [q, k, v, dout].map(|x| round_array(x.view(), dtype));
    Expected {
        out: attention_f64(qr.view(), kr.view(), vr.view()).unwrap(),
        grads: backward_f64(qr.view(), kr.view(), vr.view(), dr.view()).unwrap(),
        hand_out: by_hand_low_precision(q.view(), k.view(), v.view(), dtype),
        hand: backward_by_hand_low_precision(
            q.view(),
            k.view(),
            v.view(),
            dout.view(),
            dtype,
        ),
    }
}

/// FlashAttention's rule for out, dq, dk and dv, as step 04's GPU tests apply it, and the
/// log-sum-exp within step 03's bound for the kernel.
fn check(what: &str, got: &(Attention, Grads), want: &Expected) {
    let (fwd, grads) = got;
    let checks = [
        (
            "out",
            error(&fwd.out, &want.out.out),
            error(&want.hand_out, &want.out.out),
            size(&want.out.out),
        ),
        (
            "dq",
            error(&grads.dq, &want.grads.dq),
            error(&want.hand.dq, &want.grads.dq),
            size(&want.grads.dq),
        ),
        (
            "dk",
            error(&grads.dk, &want.grads.dk),
            error(&want.hand.dk, &want.grads.dk),
            size(&want.grads.dk),
        ),
        (
            "dv",
            error(&grads.dv, &want.grads.dv),
            error(&want.hand.dv, &want.grads.dv),
            size(&want.grads.dv),
        ),
    ];
    for (name, ours, by_hand, size) in checks {
        println!("{what} {name}: ours {ours}; by hand {by_hand}");
        let margin = 1e-5 * size;
        assert!(
            ours.max_abs <= 2.0 * by_hand.max_abs + margin,
            "{what}: {name} max abs error {:.3e} > 2 × by hand's {:.3e} (+{margin:.1e})",
            ours.max_abs,
            by_hand.max_abs
        );
    }
    let lse = error(&fwd.lse, &want.out.lse);
    println!("{what} lse: {lse}");
    assert!(lse.max_abs < 1e-3, "{what}: lse {lse}");
}

/// Every rank count of `ranks` on one input: those that cannot split T evenly must say so.
fn check_ranks(shape: Shape, dtype: Dtype, seed: u64, ranks: &[Ranks]) {
    let [q, k, v] = random_qkv(shape, seed);
    let dout = random_normal(shape, seed + 99);
    let want = expected([&q, &k, &v, &dout], dtype);
    for &r in ranks {
        let what = format!("{r:?} {shape} {}", dtype.name());
        match ring_forward_backward(q.view(), k.view(), v.view(), dout.view(), dtype, r) {
            Ok(got) => {
                check(&what, &got, &want);
                // the forward alone gives the same output
                let fwd = ring_forward(q.view(), k.view(), v.view(), dtype, r).unwrap();
                assert_eq!(fwd.out, got.0.out, "{what}: forward alone");
            }
            Err(AttnError::Unsupported { what: why })
                if !shape.tokens.is_multiple_of(2 * r.count()) =>
            {
                assert!(
                    why.contains(&format!("multiple of {}", 2 * r.count())),
                    "{why}"
                );
                println!("{what}: {why}");
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_ring_on_simulated_ranks_matches_the_reference_within_twice_by_hand_error() {
    let simulated: Vec<Ranks> = (1..=4)
        .map(|ranks| Ranks::Simulated { gpu: 0, ranks })
        .collect();
    let mut seed = 800;
    for (dtype, cases) in [
        (
            Dtype::Bf16,
            &[
                (1, 2, 128, 64),
                (2, 1, 300, 64),
                (1, 2, 1024, 64),
                (1, 1, 4096, 64),
                (1, 2, 256, 128),
                (2, 1, 192, 32),
            ][..],
        ),
        (
            Dtype::F16,
            &[(1, 2, 128, 64), (2, 1, 300, 64), (1, 2, 1024, 64)][..],
        ),
    ] {
        for &(b, h, t, d) in cases {
            seed += 1;
            check_ranks(Shape::new(b, h, t, d), dtype, seed, &simulated);
        }
    }
}

#[test]
#[ignore = "needs two CUDA GPUs and NCCL"]
fn two_gpus_the_ring_over_nccl_matches_the_reference_within_twice_by_hand_error() {
    let (gpus, nccl) = (Gpu::count(), nccl_present());
    assert!(
        gpus >= 2 && nccl,
        "the NCCL ring needs two GPUs and libnccl.so; this machine has {gpus} GPU(s), NCCL {}",
        if nccl { "found" } else { "not found" }
    );
    let ranks: Vec<Ranks> = (2..=gpus.min(4)).map(Ranks::Gpus).collect();
    let mut seed = 900;
    for (dtype, shape) in [
        (Dtype::Bf16, Shape::new(1, 2, 1024, 64)),
        (Dtype::Bf16, Shape::new(1, 1, 4096, 64)),
        (Dtype::F16, Shape::new(2, 1, 300, 64)),
        (Dtype::Bf16, Shape::new(1, 2, 256, 128)),
    ] {
        seed += 1;
        check_ranks(shape, dtype, seed, &ranks);
    }
}

/// `cuda_ring` as the registry runs it (two ranks simulated on GPU 0, any length: a length
/// the split cannot take is padded at the end, which causal attention ignores).
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_registry_method_takes_any_length() {
    let m = step07_multi_gpu::methods::methods()[0];
    for (tokens, seed) in [(1, 1000), (77, 1001), (130, 1002)] {
        let shape = Shape::new(2, 3, tokens, 64);
        let [q, k, v] = random_qkv(shape, seed);
        let dout = random_normal(shape, seed + 1);
        let fwd = m
            .forward(q.view(), k.view(), v.view(), Dtype::Bf16)
            .unwrap();
        let grads = m
            .backward(q.view(), k.view(), v.view(), &fwd, dout.view(), Dtype::Bf16)
            .unwrap();
        let want = expected([&q, &k, &v, &dout], Dtype::Bf16);
        check(&format!("cuda_ring {shape}"), &(fwd, grads), &want);
    }
}
