//! The reference every masked method is checked against: attention by hand with a mask and
//! a score function, forward and backward, one row of scores at a time, with grouped heads
//! and fewer queries than keys.
//!
//! Written once over the precision: in `f64` it is the reference ([`attention_f64`],
//! [`backward_f64`]); in `f32` it is the baseline of FlashAttention's rule, attention by
//! hand in the tested method's own precision ([`attention_by_hand`], [`backward_by_hand`]).
//! A method's error against `f64` may be at most twice the baseline's.
//!
//! A row that sees no key is defined: its output is 0 and its log-sum-exp −∞ (as step 07's
//! merge treats it), and it passes no gradient back.

use flash_core::method::Grads;
use flash_core::{Attention, AttnError};
use ndarray::{Array3, Array4, ArrayView4};

use crate::mask::{Mask, ScoreMod};
use crate::shape::{QkvShape, check_grads_inputs, check_masked};

/// The precision the reference is written over: `f64` for the reference, `f32` for the
/// baseline.
pub trait Real: Copy + Default + std::ops::AddAssign + 'static {
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
}

impl Real for f64 {
    fn from_f64(x: f64) -> f64 {
        x
    }
    fn to_f64(self) -> f64 {
        self
    }
}

impl Real for f32 {
    fn from_f64(x: f64) -> f32 {
        x as f32
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}

/// The output `[batch, heads, tq, d]` and each row's natural log-sum-exp of its modified
/// scores `[batch, heads, tq]`, in the precision `T`.
#[derive(Clone, Debug)]
pub struct MaskedReference<T> {
    pub out: Array4<T>,
    pub lse: Array3<T>,
}

/// The gradients: dq of q's shape, dk and dv of k's.
#[derive(Clone, Debug)]
pub struct MaskedGrads<T> {
    pub dq: Array4<T>,
    pub dk: Array4<T>,
    pub dv: Array4<T>,
}

/// One row of attention in precision `T`: the modified scores of the keys the row sees
/// (`None` for the others) and the probabilities.
struct Row<T> {
    /// `(key, s, s')`: the key, its scaled score and the score after the function.
    seen: Vec<(usize, T, T)>,
    /// The probabilities of `seen`, in order.
    p: Vec<T>,
    lse: f64,
}

/// Rounds what it computes to `T` at every step, so that `T = f32` is attention by hand in
/// `f32`.
#[allow(clippy::too_many_arguments)]
fn row<A: Copy + Into<f64>, T: Real>(
    q: &ArrayView4<A>,
    k: &ArrayView4<A>,
    shape: QkvShape,
    mask: &Mask,
    score: &ScoreMod,
    (b, h, i): (usize, usize, usize),
) -> Row<T> {
    let (g, qp) = (shape.kv_head(h), i + shape.offset());
    let scale = T::from_f64(shape.scale()).to_f64();
    let mut seen = Vec::new();
    for j in 0..shape.kv_tokens {
        if !mask.allows(b, h, qp, j) {
            continue;
        }
        let mut dot = T::default();
        for d in 0..shape.head_dim {
            let x = T::from_f64(q[[b, h, i, d]].into()).to_f64();
            let y = T::from_f64(k[[b, g, j, d]].into()).to_f64();
            dot += T::from_f64(x * y);
        }
        let s = T::from_f64(dot.to_f64() * scale);
        let modified = T::from_f64(score.apply(s.to_f64(), b, h, qp, j));
        seen.push((j, s, modified));
    }
    if seen.is_empty() {
        return Row {
            seen,
            p: Vec::new(),
            lse: f64::NEG_INFINITY,
        };
    }
    let max = seen
        .iter()
        .map(|x| x.2.to_f64())
        .fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<T> = seen
        .iter()
        .map(|x| T::from_f64((x.2.to_f64() - max).exp()))
        .collect();
    let mut sum = T::default();
    e.iter().for_each(|&x| sum += x);
    let p = e
        .iter()
        .map(|&x| T::from_f64(x.to_f64() / sum.to_f64()))
        .collect();
    Row {
        seen,
        p,
        lse: T::from_f64(max + sum.to_f64().ln()).to_f64(),
    }
}

// ANCHOR: reference_forward
/// Attention with a mask and a score function in precision `T`, by hand: for each row, the
/// scores of the keys the mask lets it see, the score function, the softmax, `Σ p·v`.
pub fn attention_in<A: Copy + Into<f64>, T: Real>(
    q: ArrayView4<A>,
    k: ArrayView4<A>,
    v: ArrayView4<A>,
    mask: &Mask,
    score: &ScoreMod,
) -> Result<MaskedReference<T>, AttnError> {
    let shape = check_masked(&q, &k, &v, mask, score)?;
    let mut out = Array4::<T>::default(shape.q_dims());
    let mut lse = Array3::<T>::default((shape.batch, shape.heads, shape.q_tokens));
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            let g = shape.kv_head(h);
            for i in 0..shape.q_tokens {
                let r: Row<T> = row(&q, &k, shape, mask, score, (b, h, i));
                // a row that sees no key: output 0 (left as it is), log-sum-exp −∞
                lse[[b, h, i]] = T::from_f64(r.lse);
                for d in 0..shape.head_dim {
                    let mut acc = T::default();
                    for (&(j, _, _), &p) in r.seen.iter().zip(&r.p) {
                        acc += T::from_f64(
                            p.to_f64() * T::from_f64(v[[b, g, j, d]].into()).to_f64(),
                        );
                    }
                    out[[b, h, i, d]] = acc;
                }
            }
        }
    }
    Ok(MaskedReference { out, lse })
}
// ANCHOR_END: reference_forward

/// The reference: [`attention_in`] in `f64`, on inputs widened exactly.
pub fn attention_f64<A: Copy + Into<f64>>(
    q: ArrayView4<A>,
    k: ArrayView4<A>,
    v: ArrayView4<A>,
    mask: &Mask,
    score: &ScoreMod,
) -> Result<MaskedReference<f64>, AttnError> {
    attention_in(q, k, v, mask, score)
}

/// The baseline of FlashAttention's rule: [`attention_in`] in `f32`, as an [`Attention`].
pub fn attention_by_hand(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    mask: &Mask,
    score: &ScoreMod,
) -> Result<Attention, AttnError> {
    let r = attention_in::<f32, f32>(q, k, v, mask, score)?;
    Ok(Attention {
        out: r.out,
        lse: r.lse,
    })
}

// ANCHOR: reference_backward
/// The gradients of `L = Σ dO ∘ O` with respect to q, k and v in precision `T`, by hand
/// through each row's probabilities. With `s' = score(s)`, `P = softmax(s')`:
/// `dV_j += P_ij·dO_i`, `dP_ij = dO_i·v_j`, `dS'_ij = P_ij·(dP_ij − Σ_j P_ij·dP_ij)`,
/// `dS_ij = dS'_ij·score'(s_ij)`, `dQ_i += dS_ij·k_j·scale`, `dK_j += dS_ij·q_i·scale`. A
/// kv head's dK and dV sum over the query heads that share it.
pub fn backward_in<A: Copy + Into<f64>, T: Real>(
    q: ArrayView4<A>,
    k: ArrayView4<A>,
    v: ArrayView4<A>,
    dout: ArrayView4<A>,
    mask: &Mask,
    score: &ScoreMod,
) -> Result<MaskedGrads<T>, AttnError> {
    let shape = check_masked(&q, &k, &v, mask, score)?;
    let lse_dims = [shape.batch, shape.heads, shape.q_tokens];
    let out_dims = Array4::<f32>::zeros(shape.q_dims());
    check_grads_inputs(shape, &dout, &out_dims.view(), lse_dims)?;
    let mut grads = MaskedGrads {
        dq: Array4::<T>::default(shape.q_dims()),
        dk: Array4::<T>::default(shape.kv_dims()),
        dv: Array4::<T>::default(shape.kv_dims()),
    };
    let (d_n, scale) = (shape.head_dim, T::from_f64(shape.scale()).to_f64());
    let t = |x: A| T::from_f64(x.into()).to_f64();
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            let g = shape.kv_head(h);
            for i in 0..shape.q_tokens {
                let r: Row<T> = row(&q, &k, shape, mask, score, (b, h, i));
                let qp = i + shape.offset();
                // dP_ij = dO_i·v_j for the keys the row sees, and their mean under P
                let dp: Vec<f64> = r
                    .seen
                    .iter()
                    .map(|&(j, _, _)| {
                        let mut acc = T::default();
                        for d in 0..d_n {
                            acc += T::from_f64(t(dout[[b, h, i, d]]) * t(v[[b, g, j, d]]));
                        }
                        acc.to_f64()
                    })
                    .collect();
                let mut mean = T::default();
                for (p, dp) in r.p.iter().zip(&dp) {
                    mean += T::from_f64(p.to_f64() * dp);
                }
                for ((&(j, s, _), p), dp) in r.seen.iter().zip(&r.p).zip(&dp) {
                    let p = p.to_f64();
                    let ds_mod = T::from_f64(p * (dp - mean.to_f64())).to_f64();
                    let chain = T::from_f64(score.grad(s.to_f64(), b, h, qp, j)).to_f64();
                    let ds = T::from_f64(ds_mod * chain).to_f64();
                    for d in 0..d_n {
                        grads.dv[[b, g, j, d]] += T::from_f64(p * t(dout[[b, h, i, d]]));
                        grads.dq[[b, h, i, d]] +=
                            T::from_f64(ds * t(k[[b, g, j, d]]) * scale);
                        grads.dk[[b, g, j, d]] +=
                            T::from_f64(ds * t(q[[b, h, i, d]]) * scale);
                    }
                }
            }
        }
    }
    Ok(grads)
}
// ANCHOR_END: reference_backward

/// The reference gradients: [`backward_in`] in `f64`.
pub fn backward_f64<A: Copy + Into<f64>>(
    q: ArrayView4<A>,
    k: ArrayView4<A>,
    v: ArrayView4<A>,
    dout: ArrayView4<A>,
    mask: &Mask,
    score: &ScoreMod,
) -> Result<MaskedGrads<f64>, AttnError> {
    backward_in(q, k, v, dout, mask, score)
}

/// The baseline gradients: [`backward_in`] in `f32`, as [`Grads`].
pub fn backward_by_hand(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dout: ArrayView4<f32>,
    mask: &Mask,
    score: &ScoreMod,
) -> Result<Grads, AttnError> {
    let g = backward_in::<f32, f32>(q, k, v, dout, mask, score)?;
    Ok(Grads {
        dq: g.dq,
        dk: g.dk,
        dv: g.dv,
    })
}
