//! The f64 reference every method is checked against, and the one way we measure error.
//!
//! The same computation as [`crate::attention`], in `f64` and written as plainly as
//! possible: one row of scores at a time, its maximum, its exponentials, its sum. Inputs
//! are the `f32` (or rounded bf16/f16) values a method saw, widened exactly to `f64`, so
//! the only error left in a comparison is the method's own.

use ndarray::{Array3, Array4, ArrayView4, Zip};

use crate::{AttnError, Shape, check_qkv};

/// What the reference computes: the output and each row's natural log-sum-exp of scaled
/// scores.
#[derive(Clone, Debug)]
pub struct Reference {
    /// `[batch, heads, tokens, head_dim]`
    pub out: Array4<f64>,
    /// `[batch, heads, tokens]`: `ln Σ_j exp(s_ij)` over the keys row i may see.
    pub lse: Array3<f64>,
}

/// Causal attention in `f64`.
pub fn attention_f64<A: Copy + Into<f64>>(
    q: ArrayView4<A>,
    k: ArrayView4<A>,
    v: ArrayView4<A>,
) -> Result<Reference, AttnError> {
    let shape = check_qkv(&q, &k, &v)?;
    // widened once here, so that the loops below are not generic: they are compiled in
    // this crate, where the workspace's `[profile.dev.package.flash-core]` optimizes them in
    // test builds too, rather than in each test at its own level
    let widen = |x: ArrayView4<A>| x.mapv(Into::<f64>::into);
    Ok(causal_f64(
        shape,
        widen(q).view(),
        widen(k).view(),
        widen(v).view(),
    ))
}

fn causal_f64(
    shape: Shape,
    q: ArrayView4<f64>,
    k: ArrayView4<f64>,
    v: ArrayView4<f64>,
) -> Reference {
    let [b_n, h_n, t_n, d_n] = shape.dims();
    let scale = shape.scale();
    let mut out = Array4::<f64>::zeros(shape.dims());
    let mut lse = Array3::<f64>::zeros((b_n, h_n, t_n));
    let mut s = vec![0.0f64; t_n];
    for b in 0..b_n {
        for h in 0..h_n {
            for i in 0..t_n {
                // row i sees keys 0..=i
                let mut max = f64::NEG_INFINITY;
                for (j, sj) in s.iter_mut().enumerate().take(i + 1) {
                    let mut dot = 0.0;
                    for d in 0..d_n {
                        dot += q[[b, h, i, d]] * k[[b, h, j, d]];
                    }
                    *sj = dot * scale;
                    max = max.max(*sj);
                }
                let mut sum = 0.0;
                for sj in s.iter_mut().take(i + 1) {
                    *sj = (*sj - max).exp();
                    sum += *sj;
                }
                for d in 0..d_n {
                    let mut acc = 0.0;
                    for (j, p) in s.iter().enumerate().take(i + 1) {
                        acc += p * v[[b, h, j, d]];
                    }
                    out[[b, h, i, d]] = acc / sum;
                }
                lse[[b, h, i]] = max + sum.ln();
            }
        }
    }
    Reference { out, lse }
}

/// The reference for a few rows only, `(batch, head, token)` each: that row's output and
/// log-sum-exp in `f64`. A row of causal attention needs only its own query and the keys
/// and values up to it, so checking a sample of rows costs `O(T·D)` each, where the whole
/// reference costs `O(T²·D)` per head: what lets a long run be checked before it is timed.
pub fn rows_f64<A: Copy + Into<f64>>(
    q: ArrayView4<A>,
    k: ArrayView4<A>,
    v: ArrayView4<A>,
    rows: &[(usize, usize, usize)],
) -> Result<Vec<(Vec<f64>, f64)>, AttnError> {
    let shape = check_qkv(&q, &k, &v)?;
    let scale = shape.scale();
    let mut out = Vec::with_capacity(rows.len());
    for &(b, h, i) in rows {
        let s: Vec<f64> = (0..=i)
            .map(|j| {
                let dot: f64 = (0..shape.head_dim)
                    .map(|d| q[[b, h, i, d]].into() * k[[b, h, j, d]].into())
                    .sum();
                dot * scale
            })
            .collect();
        let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let p: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
        let sum: f64 = p.iter().sum();
        let o = (0..shape.head_dim)
            .map(|d| {
                p.iter()
                    .enumerate()
                    .map(|(j, p)| p * v[[b, h, j, d]].into())
                    .sum::<f64>()
                    / sum
            })
            .collect();
        out.push((o, max + sum.ln()));
    }
    Ok(out)
}

/// How far a result is from the reference.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Error {
    /// `max |x − ref|` over every value.
    pub max_abs: f64,
    /// `‖x − ref‖₂ / ‖ref‖₂` (0 when both are empty).
    pub rel_norm: f64,
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "max abs {:.3e}, relative norm {:.3e}",
            self.max_abs, self.rel_norm
        )
    }
}

/// The error of `x` against `reference`; they must have one shape.
pub fn error<A, D>(
    x: &ndarray::ArrayBase<A, D>,
    reference: &ndarray::ArrayBase<impl ndarray::Data<Elem = f64>, D>,
) -> Error
where
    A: ndarray::Data,
    A::Elem: Copy + Into<f64>,
    D: ndarray::Dimension,
{
    assert_eq!(
        x.shape(),
        reference.shape(),
        "error(): compared arrays differ in shape"
    );
    let (mut max_abs, mut diff2, mut ref2) = (0.0f64, 0.0f64, 0.0f64);
    Zip::from(x).and(reference).for_each(|&a, &r| {
        let d = a.into() - r;
        // a NaN anywhere is an infinite error, not one that `max` quietly skips
        max_abs = if d.is_nan() {
            f64::INFINITY
        } else {
            max_abs.max(d.abs())
        };
        diff2 += d * d;
        ref2 += r * r;
    });
    let rel_norm = if ref2 > 0.0 {
        (diff2 / ref2).sqrt()
    } else {
        diff2.sqrt()
    };
    Error { max_abs, rel_norm }
}
