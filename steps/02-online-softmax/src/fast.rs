//! The fast version: the same online softmax, parallel over (sequence, head, query block),
//! with register-blocked SIMD micro-kernels for the two products and a polynomial `2^x`.

use std::f32::consts::LN_2;

use flash_core::{Attention, AttnError, check_qkv, try_zeros};
use ndarray::{Array3, Array4, ArrayView4};
use rayon::prelude::*;

use crate::kernels::{Dims, Isa, Kernels, LANES, log2e_rounding};

/// How [`attention_with`] runs. [`Config::default`] is what [`attention`] uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// The micro-kernels' instruction set; [`Isa::detect`] by default.
    pub isa: Isa,
    /// Queries per block, rounded up to a multiple of [`LANES`] (16): the SIMD lanes run
    /// along the queries.
    pub block_q: usize,
    /// Keys per block, any size ≥ 1.
    pub block_k: usize,
    /// `2^x` by the SIMD polynomial (true) or by the standard library one value at a time.
    pub fast_exp: bool,
    /// Fold the multiply by `log2(e)` into the subtraction of the maximum, `2^(s·log2 e −
    /// M)` with one fused multiply-add per score (true), or subtract first and multiply
    /// every `s − m` by `log2(e)` before `2^x` (false).
    pub fold_log2e: bool,
}

impl Default for Config {
    /// 64 queries × 64 keys, the widest instructions, the polynomial, log2(e) folded: the
    /// fastest, or within 1% of it, on the 2-core AVX-512 machine of the book's CPU numbers
    /// (the crate docs list what else was measured).
    fn default() -> Self {
        Config {
            isa: Isa::detect(),
            block_q: 64,
            block_k: 64,
            fast_exp: true,
            fold_log2e: true,
        }
    }
}

/// What [`attention`] runs on this machine: the instruction set, the blocks and the
/// threads.
pub fn implementation() -> String {
    let c = Config::default();
    format!(
        "the online softmax: {:?} micro-kernels, blocks of {} queries × {} keys, 2^x by polynomial, {} threads; no T×T table",
        c.isa,
        c.block_q,
        c.block_k,
        rayon::current_num_threads()
    )
}

/// Causal attention by the online softmax, fast: [`attention_with`] and
/// [`Config::default`].
pub fn attention(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
) -> Result<Attention, AttnError> {
    attention_with(q, k, v, Config::default())
}

/// One query block's buffers, reused from block to block by the thread that owns them.
struct Scratch {
    qt: Vec<f32>,    // d × br: the block's queries, transposed, zero past the end
    st: Vec<f32>,    // bc × br: one block of scores (transposed), then of probabilities
    o: Vec<f32>,     // br × dp: running outputs, not yet divided by ℓ
    m: Vec<f32>,     // br: running maxima of the scores
    l: Vec<f32>,     // br: running sums
    alpha: Vec<f32>, // br: this block's correction factors, e^(m_old − m_new)
}

impl Scratch {
    fn new(n: Dims) -> Scratch {
        Scratch {
            qt: vec![0.0; n.d * n.br],
            st: vec![0.0; n.bc * n.br],
            o: vec![0.0; n.br * n.dp],
            m: vec![0.0; n.br],
            l: vec![0.0; n.br],
            alpha: vec![0.0; n.br],
        }
    }
}

/// What every query block of one call shares.
struct Plan {
    kernels: Kernels,
    cfg: Config,
    n: Dims,    // block sizes and head dim
    t_n: usize, // tokens
    scale: f32, // 1/√d
}

/// One task: a block of queries of one head, and the rows of the output it owns.
struct Task<'a> {
    bh: usize,          // sequence × heads + head
    qb: usize,          // the block's index within the head
    out: &'a mut [f32], // its rows of the output, rows × d
    lse: &'a mut [f32], // its rows of the log-sum-exp
}

/// [`attention`] with a chosen instruction set, block sizes and exponential; an unavailable
/// instruction set or a zero block size is an [`AttnError::Unsupported`].
///
/// Memory beyond the output and the log-sum-exp: one set of block buffers per worker thread
/// (with the default blocks, 16 KiB each of transposed queries, scores and outputs);
/// nothing grows with T. Non-contiguous views are copied to standard layout first.
pub fn attention_with(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    cfg: Config,
) -> Result<Attention, AttnError> {
    let shape = check_qkv(&q, &k, &v)?;
    let kernels = Kernels::new(cfg.isa)?;
    if cfg.block_q == 0 || cfg.block_k == 0 {
        return Err(AttnError::Unsupported {
            what: format!(
                "block sizes {} queries × {} keys: both must be at least 1",
                cfg.block_q, cfg.block_k
            ),
        });
    }
    if shape.is_empty() {
        return Ok(Attention::empty(shape));
    }
    let [b_n, h_n, t_n, d_n] = shape.dims();
    let plan = Plan {
        kernels,
        cfg,
        n: Dims {
            br: cfg.block_q.next_multiple_of(LANES),
            bc: cfg.block_k,
            d: d_n,
            dp: d_n.next_multiple_of(LANES),
        },
        t_n,
        scale: shape.scale() as f32,
    };
    // Contiguous [b, h, T, d] rows whatever the views' strides (a copy only when needed).
    let (q, k, v) = (
        q.as_standard_layout(),
        k.as_standard_layout(),
        v.as_standard_layout(),
    );
    let (q, k, v) = (
        q.as_slice().expect("standard layout"),
        k.as_slice().expect("standard layout"),
        v.as_slice().expect("standard layout"),
    );
    let mut out = try_zeros::<f32>(&format!("the output for {shape}"), Some(shape.len()))?;
    let mut lse = try_zeros::<f32>("the log-sum-exp", Some(b_n * h_n * t_n))?;
    // ANCHOR: parallel
    // Every (sequence, head, query block) is a task of its own: it owns its rows of the
    // output and reads its head's q, k and v in place. Later blocks see more keys; they go
    // first, so the tasks left at the end are short ones.
    let br = plan.n.br;
    let mut tasks: Vec<Task> = out
        .chunks_mut(t_n * d_n)
        .zip(lse.chunks_mut(t_n))
        .enumerate()
        .flat_map(|(bh, (out_h, lse_h))| {
            let blocks = out_h.chunks_mut(br * d_n).zip(lse_h.chunks_mut(br));
            blocks
                .enumerate()
                .map(move |(qb, (out, lse))| Task { bh, qb, out, lse })
        })
        .collect();
    tasks.sort_by_key(|t| std::cmp::Reverse(t.qb));
    tasks.into_par_iter().for_each_init(
        || Scratch::new(plan.n),
        |scratch, task| {
            let head = task.bh * t_n * d_n..(task.bh + 1) * t_n * d_n;
            let (q, k, v) = (&q[head.clone()], &k[head.clone()], &v[head]);
            query_block(&plan, q, k, v, task, scratch)
        },
    );
    // ANCHOR_END: parallel
    Ok(Attention {
        out: Array4::from_shape_vec(shape.dims(), out).expect("b·h·T·d values"),
        lse: Array3::from_shape_vec((b_n, h_n, t_n), lse).expect("b·h·T values"),
    })
}

// ANCHOR: query_block
/// One block of queries against every key block it may see: the online softmax of
/// [`crate::attention_blocked`], one block pair at a time through the micro-kernels.
fn query_block(
    plan: &Plan,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    task: Task,
    scratch: &mut Scratch,
) {
    let (kernels, n, t_n) = (plan.kernels, plan.n, plan.t_n);
    let (q0, rows) = (task.qb * n.br, task.lse.len());
    // The block's queries, transposed (a SIMD register holds one dim of 16 queries);
    // queries past the sequence's end are zero. Not scaled: the scale multiplies each
    // finished dot product, as in step 01, so that the scores are step 01's to the last bit
    // (the backward of step 04 depends on it).
    scratch.qt.fill(0.0);
    for i in 0..rows {
        for (d, &x) in q[(q0 + i) * n.d..(q0 + i + 1) * n.d].iter().enumerate() {
            scratch.qt[d * n.br + i] = x;
        }
    }
    scratch.m.fill(f32::NEG_INFINITY);
    scratch.l.fill(0.0);
    scratch.o.fill(0.0);
    // the causal skip: key blocks after the one holding the block's last query are never
    // read
    let last = q0 + rows - 1;
    for k0 in (0..=last).step_by(n.bc) {
        let keys = n.bc.min(t_n - k0);
        let (k, v) = (
            &k[k0 * n.d..(k0 + keys) * n.d],
            &v[k0 * n.d..(k0 + keys) * n.d],
        );
        let st = &mut scratch.st;
        kernels.scores(&scratch.qt, k, st, keys, plan.scale, n);
        // rows past the sequence's end (a last, partial key block) see nothing
        st[keys * n.br..].fill(f32::NEG_INFINITY);
        // only a block whose last key comes after the block's first query needs the mask:
        // key k0 + j is later than query q0 + i for the queries i < k0 + j − q0
        if k0 + keys - 1 > q0 {
            for j in 0..keys {
                let later = (k0 + j).saturating_sub(q0).min(n.br);
                st[j * n.br..j * n.br + later].fill(f32::NEG_INFINITY);
            }
        }
        let (m, l, alpha) = (&mut scratch.m, &mut scratch.l, &mut scratch.alpha);
        if plan.cfg.fold_log2e {
            kernels.softmax::<true>(st, m, l, alpha, plan.cfg.fast_exp, n);
        } else {
            kernels.softmax::<false>(st, m, l, alpha, plan.cfg.fast_exp, n);
        }
        kernels.pv(st, v, &mut scratch.o, alpha, keys, n);
    }
    // o/ℓ, and the log-sum-exp ln Σ e^s = m + ln ℓ. Folded, ℓ is 2^e times the sum of e^(s
    // − m) (e, the rounding of m·log2 e, is the same for the whole row and cancels in o/ℓ),
    // so ln ℓ = (log2 ℓ − e)·ln 2. m stays exact: a score, the very number the backward
    // computes.
    for i in 0..rows {
        let inv = 1.0 / scratch.l[i];
        let o = &scratch.o[i * n.dp..i * n.dp + n.d];
        for (out, &o) in task.out[i * n.d..(i + 1) * n.d].iter_mut().zip(o) {
            *out = o * inv;
        }
        task.lse[i] = if plan.cfg.fold_log2e {
            let m = scratch.m[i];
            m + (scratch.l[i].log2() - log2e_rounding(m)) * LN_2
        } else {
            scratch.m[i] + scratch.l[i].ln()
        };
    }
}
// ANCHOR_END: query_block
