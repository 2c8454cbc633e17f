//! What decoding is checked against: the shared `f64` reference on the heads expanded
//! (each kv head repeated `g` times, the query rows placed at the end of the sequence), the
//! same in `f64` row by row for caches too long to expand, and attention by hand in 16 bits
//! for the low-precision rule.

use flash_core::AttnError;
use flash_core::reference::{Reference, attention_f64};
use ndarray::{Array3, Array4, ArrayView4, s};
use rayon::prelude::*;
use step03_cuda_forward::gpu::Dtype;
use step03_cuda_forward::host::round;
use step05_train::layers::repeat_kv;

use crate::decode::{DecodeShape, check_decode};

// ANCHOR: expand
/// The decoding call as a causal self-attention step 01 can compute: k and v with each kv
/// head repeated `g` times (`[batch, q_heads, context, head_dim]`), and q placed in the
/// last `q_rows` rows of a sequence of `context` rows (the rows before are zeros; causal
/// attention never lets them change the last ones).
pub fn expand_heads(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
) -> Result<[Array4<f32>; 3], AttnError> {
    let shape = check_decode(&q, &k, &v)?;
    let (g, n, t) = (shape.group(), shape.q_rows, shape.context);
    let dims = [shape.batch, shape.q_heads, t, shape.head_dim];
    let mut qx = Array4::zeros(dims);
    qx.slice_mut(s![.., .., t - n.., ..]).assign(&q);
    // step 05's repeat_kv: query head h meets kv head h / g
    Ok([qx, repeat_kv(k.to_owned(), g), repeat_kv(v.to_owned(), g)])
}

/// The `f64` reference of a decoding call: the shared causal attention in `f64` on the
/// expanded heads ([`expand_heads`]), its last `q_rows` rows. Costs `O(context²)` a head:
/// for the tests' short caches.
pub fn by_expanded_heads(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
) -> Result<Reference, AttnError> {
    let [qx, kx, vx] = expand_heads(q, k, v)?;
    let whole = attention_f64(qx.view(), kx.view(), vx.view())?;
    let n = q.dim().2;
    let t = qx.dim().2;
    Ok(Reference {
        out: whole.out.slice(s![.., .., t - n.., ..]).to_owned(),
        lse: whole.lse.slice(s![.., .., t - n..]).to_owned(),
    })
}
// ANCHOR_END: expand

/// The same reference computed row by row in `f64`, `O(context)` a row: for long caches
/// (the benchmark checks 128k tokens with it). A test holds it to [`by_expanded_heads`].
pub fn decode_f64(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
) -> Result<Reference, AttnError> {
    let shape = check_decode(&q, &k, &v)?;
    let [b_n, h_n, n, d_n] = shape.q_dims();
    let rows: Vec<(Vec<f64>, f64)> = (0..b_n * h_n * n)
        .into_par_iter()
        .map(|r| {
            let (b, h, i) = (r / (h_n * n), r / n % h_n, r % n);
            let kv = h / shape.group();
            let seen = shape.last_key(i) + 1;
            let s: Vec<f64> = (0..seen)
                .map(|j| {
                    let dot: f64 = (0..d_n)
                        .map(|d| f64::from(q[[b, h, i, d]]) * f64::from(k[[b, kv, j, d]]))
                        .sum();
                    dot * shape.scale()
                })
                .collect();
            let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
            let sum: f64 = p.iter().sum();
            let mut o = vec![0.0f64; d_n];
            for (j, p) in p.iter().enumerate() {
                for (d, o) in o.iter_mut().enumerate() {
                    *o += p * f64::from(v[[b, kv, j, d]]);
                }
            }
            o.iter_mut().for_each(|o| *o /= sum);
            (o, max + sum.ln())
        })
        .collect();
    Ok(gather(shape, rows))
}

/// Attention by hand in `dtype` for the query rows only, rounded where step 03's
/// `by_hand_low_precision` rounds (the scores, the scaled scores, the probabilities and
/// the output in `dtype`, every sum in `f32`): the yardstick of FlashAttention's rule for a
/// cache too long for the whole table. Inputs are expected already rounded to `dtype`.
pub fn by_hand_rows_low_precision(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dtype: Dtype,
) -> Result<Array4<f32>, AttnError> {
    let shape = check_decode(&q, &k, &v)?;
    let [b_n, h_n, n, d_n] = shape.q_dims();
    let scale = round(1.0 / (d_n as f32).sqrt(), dtype);
    let rows: Vec<(Vec<f64>, f64)> = (0..b_n * h_n * n)
        .into_par_iter()
        .map(|r| {
            let (b, h, i) = (r / (h_n * n), r / n % h_n, r % n);
            let kv = h / shape.group();
            let seen = shape.last_key(i) + 1;
            let mut p: Vec<f32> = (0..seen)
                .map(|j| {
                    let dot = q.slice(s![b, h, i, ..]).dot(&k.slice(s![b, kv, j, ..]));
                    round(round(dot, dtype) * scale, dtype)
                })
                .collect();
            let max = p.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            p.iter_mut().for_each(|x| *x = (*x - max).exp());
            let sum: f32 = p.iter().sum();
            p.iter_mut().for_each(|x| *x = round(*x / sum, dtype));
            let mut o = vec![0.0f32; d_n];
            for (j, p) in p.iter().enumerate() {
                for (o, &vj) in o.iter_mut().zip(v.slice(s![b, kv, j, ..])) {
                    *o += p * vj;
                }
            }
            (o.iter().map(|&x| f64::from(round(x, dtype))).collect(), 0.0)
        })
        .collect();
    Ok(gather(shape, rows).out.mapv(|x| x as f32))
}

fn gather(shape: DecodeShape, rows: Vec<(Vec<f64>, f64)>) -> Reference {
    let [b_n, h_n, n, d_n] = shape.q_dims();
    let mut out = Array4::zeros((b_n, h_n, n, d_n));
    let mut lse = Array3::zeros((b_n, h_n, n));
    for (r, (o, l)) in rows.into_iter().enumerate() {
        let (b, h, i) = (r / (h_n * n), r / n % h_n, r % n);
        out.slice_mut(s![b, h, i, ..])
            .assign(&ndarray::ArrayView1::from(&o[..]));
        lse[[b, h, i]] = l;
    }
    Reference { out, lse }
}
