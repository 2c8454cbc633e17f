//! FlashAttention's rule for the masked kernels on the GPU: their error against the `f64`
//! reference ([`attention_f64`](crate::reference::attention_f64),
//! [`backward_f64`](crate::reference::backward_f64)) at most twice that of attention by
//! hand in the same 16-bit precision, with the same mask and score function. By hand here
//! rounds as step 03's `by_hand_low_precision` and step 04's backward do (PyTorch's eager
//! attention on a GPU): inputs in 16 bits, products accumulated in f32 and rounded, the
//! softmax in f32 and rounded; the score function in f32 on the rounded scaled score, and
//! its result rounded.

use flash_core::Shape;
use flash_core::inputs::random_normal;
use flash_core::method::Grads;
use flash_core::reference::{Error, error};
use flash_core::{Attention, AttnError};
use ndarray::{Array2, Array3, Array4, ArrayView2, ArrayView4, s};
use step03_cuda_forward::gpu::{Dtype, Gpu};
use step03_cuda_forward::host::{round, round_array};

use crate::block::{BlockMask, BlockSizes};
use crate::cuda::{self, DeviceMask, GpuMask};
use crate::cuda_ampere::Kernels;
use crate::mask::{Mask, ScoreMod};
use crate::reference::{attention_f64, backward_f64};
use crate::shape::check_masked;

/// One head's probabilities by hand in `dtype`, `[tq, tk]`: the rounded scaled scores, the
/// score function, the mask (−∞), the softmax in f32, rounded. A row that sees no key is
/// all zeros. Also the score function's derivative at each score, for the backward.
#[allow(clippy::too_many_arguments)]
fn probabilities(
    q: ArrayView2<f32>,
    k: ArrayView2<f32>,
    mask: &Mask,
    score: &ScoreMod,
    (b, h): (usize, usize),
    offset: usize,
    scale: f32,
    dtype: Dtype,
) -> (Array2<f32>, Array2<f32>) {
    let (tq, tk) = (q.nrows(), k.nrows());
    let mut p = q.dot(&k.t());
    let mut g = Array2::<f32>::ones((tq, tk));
    for i in 0..tq {
        let qp = i + offset;
        for j in 0..tk {
            let s = round(round(p[[i, j]], dtype) * scale, dtype);
            p[[i, j]] = if mask.allows(b, h, qp, j) {
                g[[i, j]] = score.grad(s as f64, b, h, qp, j) as f32;
                round(score.apply(s as f64, b, h, qp, j) as f32, dtype)
            } else {
                f32::NEG_INFINITY
            };
        }
        let mut row = p.row_mut(i);
        let max = row.fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        if max == f32::NEG_INFINITY {
            row.fill(0.0);
            continue;
        }
        row.mapv_inplace(|x| (x - max).exp());
        let sum = row.sum();
        row.mapv_inplace(|x| round(x / sum, dtype));
    }
    (p, g)
}

/// The forward by hand in `dtype` with a mask and a score function: each query head reads
/// its kv head, the queries are the last tq positions. The output only (the rule compares
/// outputs).
pub fn by_hand_low_precision(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    mask: &Mask,
    score: &ScoreMod,
    dtype: Dtype,
) -> Result<Attention, AttnError> {
    let shape = check_masked(&q, &k, &v, mask, score)?;
    let (q, k, v) = (
        round_array(q, dtype),
        round_array(k, dtype),
        round_array(v, dtype),
    );
    let scale = round(shape.scale() as f32, dtype);
    let mut out = Array4::<f32>::zeros(shape.q_dims());
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            let g = shape.kv_head(h);
            let (p, _) = probabilities(
                q.slice(s![b, h, .., ..]),
                k.slice(s![b, g, .., ..]),
                mask,
                score,
                (b, h),
                shape.offset(),
                scale,
                dtype,
            );
            let o = p.dot(&v.slice(s![b, g, .., ..]));
            out.slice_mut(s![b, h, .., ..])
                .assign(&o.mapv(|x| round(x, dtype)));
        }
    }
    Ok(Attention {
        out,
        lse: Array3::zeros((shape.batch, shape.heads, shape.q_tokens)),
    })
}

/// The backward by hand in `dtype` (step 04's `backward_by_hand_low_precision` with the
/// mask and the score function's derivative): dV = Pᵀ·dO, dP = dO·vᵀ, dS = P ∘ (dP −
/// rowsum(P ∘ dP)) ∘ score′ · scale, dQ = dS·k, dK = dSᵀ·q, each rounded; a kv head's dK
/// and dV summed over its query heads.
pub fn backward_by_hand_low_precision(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dout: ArrayView4<f32>,
    mask: &Mask,
    score: &ScoreMod,
    dtype: Dtype,
) -> Result<Grads, AttnError> {
    let shape = check_masked(&q, &k, &v, mask, score)?;
    let (q, k, v, dout) = (
        round_array(q, dtype),
        round_array(k, dtype),
        round_array(v, dtype),
        round_array(dout, dtype),
    );
    let scale = round(shape.scale() as f32, dtype);
    let mut grads = Grads {
        dq: Array4::zeros(shape.q_dims()),
        dk: Array4::zeros(shape.kv_dims()),
        dv: Array4::zeros(shape.kv_dims()),
    };
    let r = |x: f32| round(x, dtype);
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            let g = shape.kv_head(h);
            let (qh, kh, vh, doh) = (
                q.slice(s![b, h, .., ..]),
                k.slice(s![b, g, .., ..]),
                v.slice(s![b, g, .., ..]),
                dout.slice(s![b, h, .., ..]),
            );
            let (p, grad) =
                probabilities(qh, kh, mask, score, (b, h), shape.offset(), scale, dtype);
            let dv = p.t().dot(&doh).mapv(r);
            let mut dp = doh.dot(&vh.t()).mapv(r);
            for ((mut dprow, prow), grow) in
                dp.rows_mut().into_iter().zip(p.rows()).zip(grad.rows())
            {
                let dot: f32 = dprow.iter().zip(prow.iter()).map(|(a, b)| a * b).sum();
                for ((x, &pv), &gv) in dprow.iter_mut().zip(prow.iter()).zip(grow.iter()) {
                    *x = r(r(r(pv * (*x - dot)) * gv) * scale);
                }
            }
            let dq = dp.dot(&kh).mapv(r);
            let dk = dp.t().dot(&qh).mapv(r);
            grads.dq.slice_mut(s![b, h, .., ..]).assign(&dq);
            let mut dkh = grads.dk.slice_mut(s![b, g, .., ..]);
            dkh += &dk;
            let mut dvh = grads.dv.slice_mut(s![b, g, .., ..]);
            dvh += &dv;
        }
    }
    // a group's sums, rounded as the GPU's sum of the group's heads is
    grads.dk.mapv_inplace(r);
    grads.dv.mapv_inplace(r);
    Ok(grads)
}

/// One row of the output, `(b, h, i)` of q, in `f64` and by hand in `dtype`, from host
/// arrays: what a benchmark checks on a few rows where the whole reference would take too
/// long. `None` for a row that sees no key (its output is 0 both ways).
#[allow(clippy::too_many_arguments)]
pub fn row_both_ways(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    mask: &Mask,
    score: &ScoreMod,
    dtype: Dtype,
    (b, h, i): (usize, usize, usize),
) -> (Vec<f64>, Vec<f32>) {
    let (tq, tk, d) = (q.dim().2, k.dim().2, q.dim().3);
    let g = h / (q.dim().1 / k.dim().1);
    let qp = i + tk - tq;
    let r = |x: f32| round(x, dtype);
    let scale = 1.0 / (d as f64).sqrt();
    let scale16 = r(scale as f32);
    let keys: Vec<usize> = (0..tk).filter(|&j| mask.allows(b, h, qp, j)).collect();
    let (mut s64, mut s16) = (Vec::new(), Vec::new());
    for &j in &keys {
        let (mut a64, mut a32) = (0.0f64, 0.0f32);
        for c in 0..d {
            let (x, y) = (r(q[[b, h, i, c]]), r(k[[b, g, j, c]]));
            a64 += x as f64 * y as f64;
            a32 += x * y;
        }
        s64.push(score.apply(a64 * scale, b, h, qp, j));
        let s = r(r(a32) * scale16);
        s16.push(r(score.apply(s as f64, b, h, qp, j) as f32));
    }
    let softmax64 = |s: &[f64]| {
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let sum: f64 = e.iter().sum();
        e.into_iter().map(|x| x / sum).collect::<Vec<_>>()
    };
    let p64 = softmax64(&s64);
    let m16 = s16.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let e16: Vec<f32> = s16.iter().map(|x| (x - m16).exp()).collect();
    let sum16: f32 = e16.iter().sum();
    let p16: Vec<f32> = e16.iter().map(|x| r(x / sum16)).collect();
    let (mut o64, mut o16) = (vec![0.0f64; d], vec![0.0f32; d]);
    for (n, &j) in keys.iter().enumerate() {
        for c in 0..d {
            let x = r(v[[b, g, j, c]]);
            o64[c] += p64[n] * x as f64;
            o16[c] += p16[n] * x;
        }
    }
    (o64, o16.into_iter().map(r).collect())
}

/// A shape the GPU checks run: q `[batch, heads, tq, d]`, k and v `[batch, kv_heads, tk, d]`.
#[derive(Clone, Copy, Debug)]
pub struct GpuCase {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub tq: usize,
    pub tk: usize,
    pub d: usize,
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

/// The masked kernels on the GPU against the `f64` reference: the block mask the GPU makes
/// against the CPU's (the same count of visible scores), then the forward's output and
/// log-sum-exps and the backward's gradients on seeded inputs, each within twice the error of
/// attention by hand in `dtype`. `Err` says which array of which case is over, and by how
/// much.
pub fn check_on_gpu(
    gpu: &Gpu,
    c: GpuCase,
    mask: &Mask,
    score: &ScoreMod,
    dtype: Dtype,
    seed: u64,
) -> Result<(), String> {
    let kernels = Kernels::for_gpu(gpu).map_err(|e| e.to_string())?;
    check_on_gpu_with(gpu, kernels, c, mask, score, dtype, seed)
}

/// [`check_on_gpu`] with the kernels asked: the Ampere kernels on a Hopper GPU too.
pub fn check_on_gpu_with(
    gpu: &Gpu,
    kernels: Kernels,
    c: GpuCase,
    mask: &Mask,
    score: &ScoreMod,
    dtype: Dtype,
    seed: u64,
) -> Result<(), String> {
    let what = format!(
        "{c:?} {} {} {} {}",
        kernels.name(),
        mask.name(),
        score.name(),
        dtype.name()
    );
    let qs = Shape::new(c.batch, c.heads, c.tq, c.d);
    let ks = Shape::new(c.batch, c.kv_heads, c.tk, c.d);
    let q = random_normal(qs, seed);
    let k = random_normal(ks, seed + 1);
    let v = random_normal(ks, seed + 2);
    let dout = random_normal(qs, seed + 3);
    let gm = GpuMask::new(mask, score).map_err(|e| format!("{what}: {e}"))?;
    let dm = DeviceMask::with_kernels(gpu, &gm, kernels, qs, c.tk)
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
