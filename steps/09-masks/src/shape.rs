//! The shape of a masked attention call: q against a k and v that may be longer (chunked
//! prefill) and have fewer heads (grouped-query attention), checked before any work.

use std::fmt;

use flash_core::{AttnError, check_finite};
use ndarray::ArrayView4;

use crate::mask::{Mask, ScoreMod};

/// q `[batch, heads, q_tokens, head_dim]`, k and v `[batch, kv_heads, kv_tokens,
/// head_dim]`, with `q_tokens ≤ kv_tokens` and `kv_heads` dividing `heads`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QkvShape {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub q_tokens: usize,
    pub kv_tokens: usize,
    pub head_dim: usize,
}

impl QkvShape {
    /// The absolute position of query row 0: the queries are the last `q_tokens` tokens.
    pub fn offset(&self) -> usize {
        self.kv_tokens - self.q_tokens
    }

    /// The kv head that query head `h` reads: `h / (heads / kv_heads)`.
    pub fn kv_head(&self, h: usize) -> usize {
        h / self.group()
    }

    /// Query heads per kv head (0 when there is no head).
    pub fn group(&self) -> usize {
        self.heads.checked_div(self.kv_heads).unwrap_or(0)
    }

    /// The scale of the scores, `1/√d`.
    pub fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }

    /// q's (and the output's) dims.
    pub fn q_dims(&self) -> [usize; 4] {
        [self.batch, self.heads, self.q_tokens, self.head_dim]
    }

    /// k's and v's dims.
    pub fn kv_dims(&self) -> [usize; 4] {
        [self.batch, self.kv_heads, self.kv_tokens, self.head_dim]
    }

    /// True when there is no score to compute.
    pub fn is_empty(&self) -> bool {
        self.batch == 0 || self.heads == 0 || self.q_tokens == 0
    }
}

impl fmt::Display for QkvShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[batch {}, heads {} on {} kv heads, {} queries on {} keys, head_dim {}]",
            self.batch,
            self.heads,
            self.kv_heads,
            self.q_tokens,
            self.kv_tokens,
            self.head_dim
        )
    }
}

// ANCHOR: check_masked
/// Checks q, k, v, the mask and the score function before any work, and returns the shape.
///
/// Accepted: q `[batch, heads, tq, d]`, k and v `[batch, kv_heads, tk, d]` of one shape,
/// `d ≥ 1`, `tq ≤ tk`, `kv_heads` dividing `heads`, finite values; a mask and a score
/// function whose parameters are valid, that fit the shape and that have Rust functions.
pub fn check_masked<A: Copy + Into<f64>>(
    q: &ArrayView4<A>,
    k: &ArrayView4<A>,
    v: &ArrayView4<A>,
    mask: &Mask,
    score: &ScoreMod,
) -> Result<QkvShape, AttnError> {
    let (qd, kd, vd) = (q.dim(), k.dim(), v.dim());
    let mismatch = |why: &str| AttnError::ShapeMismatch {
        what: format!(
            "q is {:?}, k is {:?}, v is {:?}: {why}; accepted: q [batch, heads, tq, d], \
             k and v [batch, kv_heads, tk, d] with tq ≤ tk and kv_heads dividing heads",
            <[usize; 4]>::from(qd),
            <[usize; 4]>::from(kd),
            <[usize; 4]>::from(vd)
        ),
    };
    if kd != vd {
        return Err(mismatch("k and v differ"));
    }
    let (batch, heads, q_tokens, head_dim) = qd;
    let (kb, kv_heads, kv_tokens, kvd) = kd;
    if kb != batch || kvd != head_dim {
        return Err(mismatch("the batch or the head dim differs"));
    }
    if q_tokens > kv_tokens {
        return Err(mismatch("more queries than keys"));
    }
    if !(kv_heads == 0 && heads == 0) && (kv_heads == 0 || !heads.is_multiple_of(kv_heads))
    {
        return Err(mismatch("the kv heads do not divide the query heads"));
    }
    if head_dim == 0 {
        return Err(AttnError::ZeroHeadDim);
    }
    check_finite("q", q)?;
    check_finite("k", k)?;
    check_finite("v", v)?;
    mask.check(batch, kv_tokens)?;
    score.check(heads)?;
    Ok(QkvShape {
        batch,
        heads,
        kv_heads,
        q_tokens,
        kv_tokens,
        head_dim,
    })
}
// ANCHOR_END: check_masked

/// Checks a backward's further inputs: `dout` and the forward's output of q's shape, its
/// log-sum-exp `[batch, heads, tq]`.
pub fn check_grads_inputs<A: Copy + Into<f64>>(
    shape: QkvShape,
    dout: &ArrayView4<A>,
    out: &ArrayView4<f32>,
    lse: [usize; 3],
) -> Result<(), AttnError> {
    for (name, d) in [
        ("dout", <[usize; 4]>::from(dout.dim())),
        ("the forward's out", <[usize; 4]>::from(out.dim())),
    ] {
        if d != shape.q_dims() {
            return Err(AttnError::ShapeMismatch {
                what: format!("{name} is {d:?} but q is {:?}", shape.q_dims()),
            });
        }
    }
    let want = [shape.batch, shape.heads, shape.q_tokens];
    if lse != want {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "the forward's lse is {lse:?} but must be [batch, heads, tq] = {want:?}"
            ),
        });
    }
    check_finite("dout", dout)
}
