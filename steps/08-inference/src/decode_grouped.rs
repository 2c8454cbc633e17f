//! Decoding on the CPU at the memory's speed: rungs 2 to 4 after [`decode`](crate::decode()),
//! rung 1. Same inputs, same checks, same result up to rounding; what changes is how the
//! cache is read.
//!
//! | rung | method | what it adds |
//! | --- | --- | --- |
//! | 1 | [`decode`](crate::decode()) | step 02's loop, one query row at a time, rows in parallel |
//! | 2 | [`decode_grouped`] | a kv head's `g · n` rows together, keys in blocks: each key and value read from memory once for all of them, the finiteness check read from the products' results; plain Rust |
//! | 3 | [`decode_simd`] | rung 2 with its two products in AVX-512 or AVX2 registers, chosen at run time |
//! | 4 | [`decode_threads`] | rung 3 with the keys split over the threads when there are fewer (sequence, kv head) pairs than threads can share, merged through the log-sum-exps |
//!
//! ## Layout
//!
//! - [`group_partial`]: one kv head's rows over a range of its keys, a block of
//!   [`BLOCK_KEYS`] at a time: the block's scores `Q Kᵀ`, the online softmax of each row,
//!   the values `P V` ([`decode_kernels`](crate::decode_kernels) holds the two products);
//! - [`decode_grouped_with`]: every (sequence, kv head) pair in parallel, its keys in
//!   chunks merged by step 07's [`merge_row`]; the three rungs call it;
//! - [`plan_chunk`]: rung 4's split.

use std::f32::consts::LOG2_E;
use std::ops::Range;

use flash_core::{Attention, AttnError, check_finite};
use ndarray::{Array3, Array4, ArrayView1, ArrayView4, ArrayViewMut1};
use rayon::prelude::*;
use step02_online_softmax::kernels::{Isa, Kernels};
use step07_multi_gpu::merge::merge_row;

use crate::decode::{DecodeShape, check_sizes};
use crate::decode_kernels::{DecodeKernels, Tile};

/// Keys per block: a block's keys and values (64 · 128 · 4 bytes each at head dim 128) stay
/// in the L2 cache between the first tile of rows, which reads them from memory, and the
/// others.
pub const BLOCK_KEYS: usize = 64;

/// The fewest keys [`plan_chunk`] gives a chunk: a task's start and its merge cost about
/// what reading a few blocks does.
pub const MIN_CHUNK: usize = 4 * BLOCK_KEYS;

// ANCHOR: group_partial
/// The partial result of one kv head's `R = g · n` query rows over the keys `keys`:
/// `out` (`R × d`) normalised by each row's own sum, `lse` (`R`) its log-sum-exp, `(0,
/// −∞)` for a row that sees none of them. `q` holds the rows (`R × d`), `k` and `v` the kv
/// head's whole cache (`context × d`). Row `r` is query row `r mod n` of its head and sees
/// keys up to [`DecodeShape::last_key`]. False when a key or value read was not finite
/// (or a score or output overflowed: [`DecodeKernels::scores`]).
#[allow(clippy::too_many_arguments)]
pub fn group_partial(
    kernels: DecodeKernels,
    exp: Kernels,
    shape: DecodeShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    keys: Range<usize>,
    out: &mut [f32],
    lse: &mut [f32],
) -> bool {
    let (rows, d, n) = (shape.rows_per_kv_head(), shape.head_dim, shape.q_rows);
    let scale = shape.scale() as f32;
    let mut m = vec![f32::NEG_INFINITY; rows]; // each row's largest score so far
    let mut l = vec![0.0f32; rows]; // each row's Σ e^(s_j − m) so far
    out.fill(0.0); // the rows' Σ e^(s_j − m)·v_j, not yet divided by ℓ
    let mut s = vec![0.0f32; rows * BLOCK_KEYS]; // the block's scores, then probabilities
    let mut finite = true;
    for k0 in keys.clone().step_by(BLOCK_KEYS) {
        let cols = BLOCK_KEYS.min(keys.end - k0);
        let block = k0 * d..(k0 + cols) * d;
        let tile = Tile {
            rows,
            keys: cols,
            bc: BLOCK_KEYS,
            d,
        };
        finite &= kernels.scores(q, &k[block.clone()], &mut s, tile, scale);
        for (r, s_r) in s.chunks_exact_mut(BLOCK_KEYS).enumerate() {
            // the keys of the block row r sees: the causal mask cuts a suffix
            let seen = (shape.last_key(r % n) + 1).saturating_sub(k0).min(cols);
            let (p, masked) = s_r.split_at_mut(seen);
            masked.fill(0.0);
            if seen == 0 {
                continue;
            }
            let m_new = m[r].max(lanes(p, f32::NEG_INFINITY, max));
            exp.exp2_shifted(p, m_new, LOG2_E);
            // what was summed so far moves to the new maximum; e^(−∞) = 0 on the first
            // block
            let correction = (m[r] - m_new).exp();
            l[r] = l[r] * correction + lanes(p, 0.0, |a, b| a + b);
            m[r] = m_new;
            if correction != 1.0 {
                out[r * d..(r + 1) * d]
                    .iter_mut()
                    .for_each(|o| *o *= correction);
            }
        }
        finite &= kernels.values(&s, &v[block], out, tile);
    }
    for ((o, lse), (&m, &l)) in out.chunks_exact_mut(d).zip(lse).zip(m.iter().zip(&l)) {
        if l == 0.0 {
            // no key in the range: the partial result that weighs nothing in a merge
            *lse = f32::NEG_INFINITY;
        } else {
            o.iter_mut().for_each(|o| *o /= l);
            *lse = m + l.ln();
        }
    }
    finite
}
// ANCHOR_END: group_partial

// ANCHOR: decode_grouped
/// Rung 2: each (sequence, kv head) pair's rows together by [`group_partial`], pairs in
/// parallel, in plain Rust (the compiler's vectorisation of the target's baseline).
pub fn decode_grouped(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
) -> Result<Attention, AttnError> {
    decode_grouped_with(q, k, v, Isa::Scalar, None)
}

/// Rung 3: rung 2 in the widest SIMD registers this CPU has (AVX-512F, else AVX2 with FMA,
/// else plain Rust).
pub fn decode_simd(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
) -> Result<Attention, AttnError> {
    decode_grouped_with(q, k, v, Isa::detect(), None)
}

/// Rung 4: rung 3 with the keys cut into chunks of [`plan_chunk`] keys when the (sequence,
/// kv head) pairs are too few to keep rayon's threads busy.
pub fn decode_threads(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
) -> Result<Attention, AttnError> {
    let shape = check_sizes(q.dim().into(), k.dim().into(), v.dim().into())?;
    let chunk = plan_chunk(shape, rayon::current_num_threads());
    decode_grouped_with(q, k, v, Isa::detect(), Some(chunk))
}
// ANCHOR_END: decode_grouped

// ANCHOR: plan_chunk
/// Rung 4's split: keys per chunk for a call on `threads` threads. The whole cache (no
/// split, no merge) when the (sequence, kv head) pairs give every thread two tasks or
/// more; otherwise chunks that make at least that many tasks, a whole number of blocks and
/// at least [`MIN_CHUNK`] keys. Two a thread rather than one: rayon's threads take tasks as
/// they free up, so a thread slowed by something else holds the others up by half its
/// share at most.
pub fn plan_chunk(shape: DecodeShape, threads: usize) -> usize {
    let (pairs, want) = (shape.batch * shape.kv_heads, 2 * threads.max(1));
    if pairs >= want || shape.context == 0 {
        return shape.context.max(1);
    }
    let splits = want.div_ceil(pairs.max(1));
    shape
        .context
        .div_ceil(splits)
        .next_multiple_of(BLOCK_KEYS)
        .max(MIN_CHUNK)
}
// ANCHOR_END: plan_chunk

// ANCHOR: decode_grouped_with
/// The grouped rungs with the instruction set and the split named: `isa` for the two
/// products ([`DecodeKernels`]; an error if this CPU lacks it), `chunk` keys a task (`None`:
/// the whole cache). Every (sequence, kv head, chunk) is one task on rayon's threads; a
/// pair's chunks are merged through their log-sum-exps by step 07's [`merge_row`]. The
/// cache is checked for values that are not finite through what the products wrote (row
/// 0's scores and outputs, [`DecodeKernels`]), with no pass of its own, and only when one
/// was seen is it searched again, for the message that names it.
pub fn decode_grouped_with(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    isa: Isa,
    chunk: Option<usize>,
) -> Result<Attention, AttnError> {
    let shape = check_sizes(q.dim().into(), k.dim().into(), v.dim().into())?;
    check_finite("q", &q)?;
    if chunk == Some(0) {
        return Err(AttnError::Unsupported {
            what: "a chunk of 0 keys: the split cuts the cache into chunks of at least 1 \
                   token (any size from 1 up, longer than the cache included)"
                .into(),
        });
    }
    let kernels = DecodeKernels::new(isa)?;
    let [b_n, h_n, n, d] = shape.q_dims();
    let mut out = Array4::zeros((b_n, h_n, n, d));
    let mut lse = Array3::zeros((b_n, h_n, n));
    if shape.is_empty() {
        // nothing reads the cache, so nothing checked it
        check_finite("k", &k)?;
        check_finite("v", &v)?;
        return Ok(Attention { out, lse });
    }
    let (q, k, v) = (
        q.as_standard_layout(),
        k.as_standard_layout(),
        v.as_standard_layout(),
    );
    let (qs, ks, vs) = (slice(&q), slice(&k), slice(&v));
    let (rows, context) = (shape.rows_per_kv_head(), shape.context);
    let chunk = chunk.unwrap_or(context).min(context.max(1));
    let splits = context.div_ceil(chunk).max(1);
    let exp = kernels.exp();
    // pair p = (b, kv head) owns q's and the output's rows p·R .. (p + 1)·R, the heads of
    // its group being consecutive, and the cache's tokens p·context .. (p + 1)·context
    let task = |pair: usize, keys: Range<usize>, o: &mut [f32], l: &mut [f32]| {
        let cache = pair * context * d..(pair + 1) * context * d;
        group_partial(
            kernels,
            exp,
            shape,
            &qs[pair * rows * d..(pair + 1) * rows * d],
            &ks[cache.clone()],
            &vs[cache],
            keys,
            o,
            l,
        )
    };
    let out_rows = out.as_slice_mut().expect("a new array is one slice");
    let lse_rows = lse.as_slice_mut().expect("a new array is one slice");
    let finite = if splits == 1 {
        out_rows
            .par_chunks_mut(rows * d)
            .zip(lse_rows.par_chunks_mut(rows))
            .enumerate()
            .map(|(pair, (o, l))| task(pair, 0..context, o, l))
            .reduce(|| true, |a, b| a && b)
    } else {
        let parts: Vec<(Vec<f32>, Vec<f32>, bool)> = (0..out_rows.len() / (rows * d)
            * splits)
            .into_par_iter()
            .map(|t| {
                let (pair, k0) = (t / splits, t % splits * chunk);
                let (mut o, mut l) = (vec![0.0; rows * d], vec![0.0; rows]);
                let finite = task(pair, k0..(k0 + chunk).min(context), &mut o, &mut l);
                (o, l, finite)
            })
            .collect();
        out_rows
            .par_chunks_mut(rows * d)
            .zip(lse_rows.par_chunks_mut(rows))
            .zip(parts.par_chunks(splits))
            .for_each(|((o, l), parts)| {
                l.fill(f32::NEG_INFINITY);
                for (part_o, part_l, _) in parts {
                    for (r, (o, l)) in o.chunks_exact_mut(d).zip(l.iter_mut()).enumerate() {
                        let part = ArrayView1::from(&part_o[r * d..(r + 1) * d]);
                        merge_row(ArrayViewMut1::from(o), l, part, part_l[r]);
                    }
                }
            });
        parts.iter().all(|p| p.2)
    };
    if !finite {
        check_finite("k", &k.view())?;
        check_finite("v", &v.view())?;
    }
    Ok(Attention { out, lse })
}
// ANCHOR_END: decode_grouped_with

/// `x` folded by `f` (a maximum, a sum) in 16 independent lanes, then the lanes folded in
/// halves: sixteen chains the compiler can put in SIMD registers, where one fold over `x`
/// would wait on each step's result before the next, and four steps to fold them rather
/// than sixteen in a row.
fn lanes(x: &[f32], init: f32, f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut acc = [init; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = f(*a, x);
        }
    }
    for (a, &x) in acc.iter_mut().zip(tail) {
        *a = f(*a, x);
    }
    for half in [8, 4, 2, 1] {
        for i in 0..half {
            acc[i] = f(acc[i], acc[i + half]);
        }
    }
    acc[0]
}

/// The larger of `a` and `b`, as one SIMD instruction computes it (`f32::max` also
/// chooses the number when the other is NaN, which costs the compiler a comparison and a
/// blend on every lane).
fn max(a: f32, b: f32) -> f32 {
    if a > b { a } else { b }
}

/// The numbers of a standard-layout array, in order.
fn slice<'a>(x: &'a ndarray::CowArray<'_, f32, ndarray::Ix4>) -> &'a [f32] {
    x.as_slice().expect("a standard-layout array is one slice")
}
