//! Decoding on the CPU: a few query rows of each sequence against its cache of keys and
//! values, with grouped-query attention, by step 02's loop one row at a time, and the same
//! with the keys cut into chunks whose partial results are merged by step 07's merge.
//!
//! Shapes, as PyTorch lays them out:
//!
//! ```text
//! q      [batch, q_heads,  q_rows,  head_dim]   the newest q_rows tokens' queries
//! k, v   [batch, kv_heads, context, head_dim]   the cache, those tokens included
//! out    [batch, q_heads,  q_rows,  head_dim]   and lse [batch, q_heads, q_rows]
//! ```
//!
//! Query head `h` reads kv head `h / g`, `g = q_heads / kv_heads` (grouped-query attention;
//! `g = 1` is plain multi-head attention, `kv_heads = 1` multi-query attention). The query
//! rows are the cache's last `q_rows` tokens, so the causal diagonal is aligned to the
//! cache's end: row `i` of `n` sees keys `0 ..= context − n + i`.

use std::fmt;

use flash_core::{Attention, AttnError, check_finite};
use ndarray::{Array3, Array4, ArrayView1, ArrayView2, ArrayView4, Axis, s};
use rayon::prelude::*;
use step02_online_softmax::DEFAULT_BLOCK;
use step02_online_softmax::kernels::{Isa, Kernels};
use step07_multi_gpu::merge::merge_row;

/// The sizes of one decoding call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeShape {
    pub batch: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    /// Query rows of each sequence: 1 for one new token, a few for speculative decoding or
    /// the end of a prompt.
    pub q_rows: usize,
    /// Tokens in the cache, the query rows' own included.
    pub context: usize,
    pub head_dim: usize,
}

impl DecodeShape {
    pub fn new(
        batch: usize,
        q_heads: usize,
        kv_heads: usize,
        q_rows: usize,
        context: usize,
        head_dim: usize,
    ) -> Self {
        DecodeShape {
            batch,
            q_heads,
            kv_heads,
            q_rows,
            context,
            head_dim,
        }
    }

    /// Query heads per kv head, `g`.
    pub fn group(&self) -> usize {
        self.q_heads / self.kv_heads.max(1)
    }

    /// `[batch, q_heads, q_rows, head_dim]`: q and the output.
    pub fn q_dims(&self) -> [usize; 4] {
        [self.batch, self.q_heads, self.q_rows, self.head_dim]
    }

    /// `[batch, kv_heads, context, head_dim]`: k and v.
    pub fn kv_dims(&self) -> [usize; 4] {
        [self.batch, self.kv_heads, self.context, self.head_dim]
    }

    /// The query rows that share one kv head, `g · q_rows`: what one pass over that head's
    /// cache serves.
    pub fn rows_per_kv_head(&self) -> usize {
        self.group() * self.q_rows
    }

    /// The last key row `i` may see: `context − q_rows + i`.
    pub fn last_key(&self, i: usize) -> usize {
        self.context - self.q_rows + i
    }

    /// Bytes of k and v together at `bytes_per_value`: what a decoding step must read.
    pub fn cache_bytes(&self, bytes_per_value: usize) -> u64 {
        2 * (self.batch * self.kv_heads * self.context * self.head_dim) as u64
            * bytes_per_value as u64
    }

    /// `1/√d`.
    pub fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }

    /// True when there is nothing to compute.
    pub fn is_empty(&self) -> bool {
        self.batch == 0 || self.q_heads == 0 || self.q_rows == 0
    }
}

impl fmt::Display for DecodeShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[batch {}, q heads {}, kv heads {}, q rows {}, context {}, head_dim {}]",
            self.batch,
            self.q_heads,
            self.kv_heads,
            self.q_rows,
            self.context,
            self.head_dim
        )
    }
}

// ANCHOR: check_decode
/// Checks q against a cache before any work and returns the call's sizes.
///
/// Accepted: q `[batch, q_heads, q_rows, head_dim]`, k and v of one shape `[batch,
/// kv_heads, context, head_dim]` with the same batch and head dim, `head_dim ≥ 1`, kv heads
/// that divide the query heads, at least as many cached tokens as query rows (the rows are
/// the cache's last tokens), finite values. Zero sequences, query heads or rows give an
/// empty output.
pub fn check_decode<A: Copy + Into<f64>>(
    q: &ArrayView4<A>,
    k: &ArrayView4<A>,
    v: &ArrayView4<A>,
) -> Result<DecodeShape, AttnError> {
    let shape = check_sizes(q.dim().into(), k.dim().into(), v.dim().into())?;
    check_finite("q", q)?;
    check_finite("k", k)?;
    check_finite("v", v)?;
    Ok(shape)
}
// ANCHOR_END: check_decode

/// The size checks of [`check_decode`], on the dimensions alone (the GPU's tensors have no
/// host values to look at).
pub fn check_sizes(
    q: [usize; 4],
    k: [usize; 4],
    v: [usize; 4],
) -> Result<DecodeShape, AttnError> {
    if k != v {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "the cache's k is {k:?} and v is {v:?}; both must be [batch, kv_heads, \
                 context, head_dim] with the same four sizes"
            ),
        });
    }
    let [batch, q_heads, q_rows, head_dim] = q;
    let [kb, kv_heads, context, kd] = k;
    if kb != batch || kd != head_dim {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "q is {q:?} and the cache's k and v are {k:?}; q must be [batch, q_heads, \
                 q_rows, head_dim] with the cache's batch ({kb}) and head_dim ({kd})"
            ),
        });
    }
    if head_dim == 0 {
        return Err(AttnError::ZeroHeadDim);
    }
    if kv_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
        return Err(AttnError::Unsupported {
            what: format!(
                "q has {q_heads} heads and the cache {kv_heads} kv heads: grouped-query \
                 attention shares each kv head among g query heads, so the kv heads must \
                 divide the query heads; accepted for {q_heads} query heads: {}",
                flash_core::check::divisors(q_heads)
            ),
        });
    }
    if context < q_rows {
        return Err(AttnError::Unsupported {
            what: format!(
                "the cache holds {context} tokens but q has {q_rows} rows: the query rows \
                 are the cache's last tokens, so the context must be at least q_rows \
                 ({q_rows})"
            ),
        });
    }
    Ok(DecodeShape::new(
        batch, q_heads, kv_heads, q_rows, context, head_dim,
    ))
}

/// One row's partial result over a range of keys: its output, normalised by its own sum,
/// and the natural log-sum-exp of its scaled scores; `(0, −∞)` over no key.
pub struct Partial {
    pub out: Vec<f32>,
    pub lse: f32,
}

// ANCHOR: decode_row
/// Step 02's online softmax for one query row against keys `keys` of one kv head's cache
/// (`k`, `v`: `[context, head_dim]`): blocks of [`DEFAULT_BLOCK`] keys, a running maximum
/// `m`, sum `ℓ` and unnormalised output, rescaled by `e^(m_old − m_new)` when a block
/// brings a larger score.
pub fn decode_row(
    q: ArrayView1<f32>,
    k: ArrayView2<f32>,
    v: ArrayView2<f32>,
    keys: std::ops::Range<usize>,
    scale: f32,
) -> Partial {
    let d_n = q.len();
    // each key and value a slice of head_dim numbers, which the loops below go through in
    // SIMD registers (the arrays decode passes are contiguous, and copied if not)
    let (q, k, v) = (
        q.as_standard_layout(),
        k.as_standard_layout(),
        v.as_standard_layout(),
    );
    let (q, k, v) = (slice(&q), slice(&k), slice(&v));
    let at = |j: usize| j * d_n..(j + 1) * d_n; // where key j's numbers are
    let exp = Kernels::new(Isa::detect()).expect("Isa::detect names what this CPU has");
    let mut m = f32::NEG_INFINITY; // the largest score seen so far
    let mut l = 0.0f32; // Σ e^(s_j − m) over the keys seen so far
    let mut acc = vec![0.0f32; d_n]; // Σ e^(s_j − m)·v_j, not yet divided by ℓ
    let mut scores = [0.0f32; DEFAULT_BLOCK];
    for k0 in keys.clone().step_by(DEFAULT_BLOCK) {
        let cols = DEFAULT_BLOCK.min(keys.end - k0);
        for (j, s) in scores[..cols].iter_mut().enumerate() {
            *s = dot(q, &k[at(k0 + j)]) * scale;
        }
        let m_new = scores[..cols].iter().fold(m, |a, &s| a.max(s));
        // what was summed so far moves to the new maximum; e^(−∞) = 0 on the first block
        let correction = (m - m_new).exp();
        l *= correction;
        acc.iter_mut().for_each(|a| *a *= correction);
        // p_j = e^(s_j − m_new) = 2^((s_j − m_new)·log2 e), the block at once, in SIMD
        // registers: step 02's exponential
        exp.exp2_shifted(&mut scores[..cols], m_new, std::f32::consts::LOG2_E);
        for (j, &p) in scores[..cols].iter().enumerate() {
            l += p;
            for (a, &vj) in acc.iter_mut().zip(&v[at(k0 + j)]) {
                *a += p * vj;
            }
        }
        m = m_new;
    }
    if l == 0.0 {
        // no key in the range: the partial result that weighs nothing in a merge
        return Partial {
            out: acc,
            lse: f32::NEG_INFINITY,
        };
    }
    acc.iter_mut().for_each(|a| *a /= l);
    Partial {
        out: acc,
        lse: m + l.ln(),
    }
}
// ANCHOR_END: decode_row

/// The numbers of a standard-layout array, in order.
fn slice<'a, D: ndarray::Dimension>(x: &'a ndarray::CowArray<'_, f32, D>) -> &'a [f32] {
    x.as_slice().expect("a standard-layout array is one slice")
}

/// `a · b` with eight running sums, one SIMD register's worth, so that the compiler need
/// not add the products one after the other (floating-point sums are not reordered for it).
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut sums = [0.0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8
        .remainder()
        .iter()
        .zip(b8.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (a, b) in a8.zip(b8) {
        for ((s, x), y) in sums.iter_mut().zip(a).zip(b) {
            *s += x * y;
        }
    }
    sums.iter().sum::<f32>() + tail
}

// ANCHOR: decode
/// Decoding attention on the CPU: each query row of each head against the keys it may see
/// in its kv head's cache, by [`decode_row`], rows in parallel.
pub fn decode(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
) -> Result<Attention, AttnError> {
    let shape = check_decode(&q, &k, &v)?;
    Ok(by_rows(shape, |b, h, i| {
        let kv = h / shape.group();
        let (k, v) = (k.slice(s![b, kv, .., ..]), v.slice(s![b, kv, .., ..]));
        let keys = 0..shape.last_key(i) + 1;
        decode_row(q.slice(s![b, h, i, ..]), k, v, keys, shape.scale() as f32)
    }))
}
// ANCHOR_END: decode

// ANCHOR: decode_split
/// [`decode`] with the keys cut into chunks of `chunk` tokens, `[0, chunk)`, `[chunk,
/// 2·chunk)`, …: each chunk's partial result of a row computed on its own, as one thread
/// block of the GPU kernel computes it, then merged into the row's result through the
/// log-sum-exps by step 07's [`merge_row`]. A chunk past what a row sees gives `(0, −∞)`,
/// which the merge leaves out. Any `chunk ≥ 1` gives the same answer up to rounding.
pub fn decode_split(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    chunk: usize,
) -> Result<Attention, AttnError> {
    let shape = check_decode(&q, &k, &v)?;
    if chunk == 0 {
        return Err(AttnError::Unsupported {
            what: "a chunk of 0 keys: the split cuts the cache into chunks of at least 1 \
                   token (any size from 1 up, longer than the cache included)"
                .into(),
        });
    }
    Ok(by_rows(shape, |b, h, i| {
        let kv = h / shape.group();
        let (k, v) = (k.slice(s![b, kv, .., ..]), v.slice(s![b, kv, .., ..]));
        let seen = shape.last_key(i) + 1;
        let mut row = Partial {
            out: vec![0.0; shape.head_dim],
            lse: f32::NEG_INFINITY,
        };
        for k0 in (0..shape.context).step_by(chunk) {
            let keys = k0.min(seen)..(k0 + chunk).min(seen);
            let part =
                decode_row(q.slice(s![b, h, i, ..]), k, v, keys, shape.scale() as f32);
            merge_row(
                ndarray::ArrayViewMut1::from(&mut row.out[..]),
                &mut row.lse,
                ArrayView1::from(&part.out[..]),
                part.lse,
            );
        }
        row
    }))
}
// ANCHOR_END: decode_split

/// Runs `row(b, h, i)` for every query row of `shape` in parallel and gathers the results.
fn by_rows(
    shape: DecodeShape,
    row: impl Fn(usize, usize, usize) -> Partial + Sync,
) -> Attention {
    let [b_n, h_n, n, d_n] = shape.q_dims();
    let mut out = Array4::zeros((b_n, h_n, n, d_n));
    let mut lse = Array3::zeros((b_n, h_n, n));
    if shape.is_empty() {
        return Attention { out, lse };
    }
    let rows: Vec<Partial> = (0..b_n * h_n * n)
        .into_par_iter()
        .map(|r| row(r / (h_n * n), r / n % h_n, r % n))
        .collect();
    for ((mut o, l), p) in out
        .lanes_mut(Axis(3))
        .into_iter()
        .zip(lse.iter_mut())
        .zip(rows)
    {
        o.assign(&ArrayView1::from(&p.out[..]));
        *l = p.lse;
    }
    Attention { out, lse }
}
