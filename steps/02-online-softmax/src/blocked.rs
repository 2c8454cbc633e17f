//! The online softmax written to be read next to its derivation: one block of queries
//! against one block of keys at a time, single-threaded, in plain loops over `ndarray`
//! views.

use flash_core::{Attention, AttnError, check_qkv};
use ndarray::{Array3, Array4, ArrayView2, ArrayView4, s};

/// The block size of [`attention_loop`]: 64 queries against 64 keys, the blocks of the fast
/// version too. Any size gives the same answer; on the GPU, FlashAttention-2's forward
/// kernel for head dim 64 takes 128 × 128 tiles (without dropout), and so does chapter 3's.
pub const DEFAULT_BLOCK: usize = 64;

/// [`attention_blocked`] with blocks of [`DEFAULT_BLOCK`] tokens.
pub fn attention_loop(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
) -> Result<Attention, AttnError> {
    attention_blocked(q, k, v, DEFAULT_BLOCK)
}

// ANCHOR: blocked
/// Causal attention by the online softmax (Milakov & Gimelshein 2018; FlashAttention,
/// Dao et al. 2022, Algorithm 1): queries and keys in blocks of `block` tokens, and per
/// query row three running values instead of a row of the score table.
///
/// Any `block ≥ 1` works, a block longer than the sequence included; `block = 0` is an
/// [`AttnError::Unsupported`]. The largest buffer is one block of scores, `block²` values.
pub fn attention_blocked(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    block: usize,
) -> Result<Attention, AttnError> {
    let shape = check_qkv(&q, &k, &v)?;
    if block == 0 {
        return Err(AttnError::Unsupported {
            what: "block size 0: the online softmax walks the keys a block at a time, so \
                   a block must hold at least 1 token (any size from 1 up works, longer \
                   than the sequence included)"
                .to_string(),
        });
    }
    if shape.is_empty() {
        return Ok(Attention::empty(shape));
    }
    let [b_n, h_n, t_n, d_n] = shape.dims();
    let scale = shape.scale() as f32;
    let block = block.min(t_n); // a block longer than the sequence is the whole sequence
    let mut out = Array4::zeros(shape.dims());
    let mut lse = Array3::zeros((b_n, h_n, t_n));
    // The only buffers: one block of scores, and each query row's three running values.
    let mut scores = vec![0.0f32; block * block];
    let mut m = vec![0.0f32; block]; // m_i: the largest score row i has seen so far
    let mut l = vec![0.0f32; block]; // ℓ_i: Σ e^(s_ij − m_i) over the keys seen so far
    let mut acc = vec![0.0f32; block * d_n]; // Σ e^(s_ij − m_i)·v_j, not yet divided by ℓ_i
    for b in 0..b_n {
        for h in 0..h_n {
            let (q, k, v) = (
                q.slice(s![b, h, .., ..]),
                k.slice(s![b, h, .., ..]),
                v.slice(s![b, h, .., ..]),
            );
            for q0 in (0..t_n).step_by(block) {
                let rows = block.min(t_n - q0); // the last block may be partial
                m.fill(f32::NEG_INFINITY);
                l.fill(0.0);
                acc.fill(0.0);
                for k0 in (0..t_n).step_by(block) {
                    // ANCHOR: causal_skip
                    // Every key from k0 on comes after every query of this block (the last
                    // is q0 + rows − 1): the mask would zero all of them, so they are never
                    // read.
                    if k0 >= q0 + rows {
                        break;
                    }
                    // Blocks are aligned and of one size, so the only block holding keys
                    // later than some of its queries is the diagonal one: only there is the
                    // mask applied.
                    let diagonal = k0 == q0;
                    // ANCHOR_END: causal_skip
                    let cols = block.min(t_n - k0);
                    // ANCHOR: block_scores
                    // s_ij = q_i·k_j/√d for this block's rows and columns; −∞ where j > i.
                    for i in 0..rows {
                        for j in 0..cols {
                            scores[i * cols + j] = if diagonal && j > i {
                                f32::NEG_INFINITY
                            } else {
                                q.row(q0 + i).dot(&k.row(k0 + j)) * scale
                            };
                        }
                    }
                    // ANCHOR_END: block_scores
                    for i in 0..rows {
                        online_update(
                            &mut m[i],
                            &mut l[i],
                            &mut acc[i * d_n..(i + 1) * d_n],
                            &scores[i * cols..(i + 1) * cols],
                            v.slice(s![k0..k0 + cols, ..]),
                        );
                    }
                }
                // ANCHOR: finalise
                // After the last block, ℓ_i is the whole row's sum: o_i = acc_i/ℓ_i, and
                // the log-sum-exp is ln Σ_j e^(s_ij) = m_i + ln ℓ_i.
                for i in 0..rows {
                    let mut o = out.slice_mut(s![b, h, q0 + i, ..]);
                    for (o, &a) in o.iter_mut().zip(&acc[i * d_n..(i + 1) * d_n]) {
                        *o = a / l[i];
                    }
                    lse[[b, h, q0 + i]] = m[i] + l[i].ln();
                }
                // ANCHOR_END: finalise
            }
        }
    }
    Ok(Attention { out, lse })
}
// ANCHOR_END: blocked

// ANCHOR: online_update
/// One block of keys into one query row's running values: `scores` are the row's scores
/// for the block's keys (−∞ for a masked key), `v` the block's values, a key a row; `m`,
/// `l` and `acc` are the row's largest score so far, `ℓ = Σ e^(s − m)` and
/// `Σ e^(s − m)·v` over the keys before the block, and the same over the keys up to its end
/// afterwards. The row must have seen a key by the block's end, so that `m` is finite.
pub fn online_update(
    m: &mut f32,
    l: &mut f32,
    acc: &mut [f32],
    scores: &[f32],
    v: ArrayView2<f32>,
) {
    // The new maximum. Finite: block 0 holds key 0, which every row sees.
    let m_new = scores.iter().fold(*m, |a, &s| a.max(s));
    // Everything summed so far is relative to the old maximum; e^(s − m_old)·e^(m_old −
    // m_new) = e^(s − m_new) moves it to the new one. On the first block m_old = −∞ and the
    // correction is e^(−∞) = 0.
    let correction = (*m - m_new).exp();
    *l *= correction;
    acc.iter_mut().for_each(|a| *a *= correction);
    for (&s, v) in scores.iter().zip(v.rows()) {
        let p = (s - m_new).exp(); // e^(−∞) = 0 for a masked key
        *l += p;
        for (a, &v) in acc.iter_mut().zip(v) {
            *a += p * v;
        }
    }
    *m = m_new;
}
// ANCHOR_END: online_update
