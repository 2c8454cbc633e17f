//! The online softmax (step 02) and the blockwise backward (step 04) with a mask and a
//! score function, on the CPU in `f32`, visiting only the block mask's non-empty tiles.
//!
//! In a full tile every score is computed and passed through the score function, and the
//! mask is never asked; in a partial tile the mask is asked about each (query, key) pair;
//! an empty tile is never read. [`Work`] counts what was done, so a test can check that
//! skipping really skips. Parallel with rayon: the forward over (sequence, head), the
//! backward over (sequence, kv head), a task owning the dK and dV of its kv head and the dQ
//! of the query heads that share it, so no two tasks add to the same number and every sum
//! runs in one fixed order.

use flash_core::method::Grads;
use flash_core::{Attention, AttnError, try_zeros};
use ndarray::{Array2, Array4, ArrayView2, ArrayView4, ArrayViewMut2, s};
use rayon::prelude::*;

use crate::block::{BlockMask, BlockSizes};
use crate::mask::{Mask, ScoreMod};
use crate::shape::{QkvShape, check_grads_inputs, check_masked};

/// What a pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Work {
    /// Scores computed: every score of every tile visited.
    pub scores: u64,
    /// Times the mask was asked: once per score of a partial tile.
    pub mask_calls: u64,
    /// Scores that went into the softmax: those of full tiles and those the mask let
    /// through in partial ones.
    pub kept: u64,
}

impl std::ops::Add for Work {
    type Output = Work;
    fn add(self, o: Work) -> Work {
        Work {
            scores: self.scores + o.scores,
            mask_calls: self.mask_calls + o.mask_calls,
            kept: self.kept + o.kept,
        }
    }
}

/// The block mask of `mask` for this shape with the default blocks, 64 × 64.
fn default_block_mask(shape: QkvShape, mask: &Mask) -> Result<BlockMask, AttnError> {
    let dims = (shape.batch, shape.heads, shape.q_tokens, shape.kv_tokens);
    BlockMask::new(mask, dims, BlockSizes::default())
}

fn check_block_mask(shape: QkvShape, block_mask: &BlockMask) -> Result<(), AttnError> {
    let dims = (shape.batch, shape.heads, shape.q_tokens, shape.kv_tokens);
    if block_mask.shape() != dims {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "the block mask was made for (batch, heads, tq, tk) = {:?}, but the inputs \
                 are {shape}",
                block_mask.shape()
            ),
        });
    }
    Ok(())
}

/// The masked forward with 64 × 64 blocks: the output and each row's log-sum-exp (−∞, and
/// an output of 0, for a row that sees no key).
pub fn forward(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    mask: &Mask,
    score: &ScoreMod,
) -> Result<Attention, AttnError> {
    let shape = check_masked(&q, &k, &v, mask, score)?;
    let block_mask = default_block_mask(shape, mask)?;
    Ok(forward_with(q, k, v, &block_mask, score)?.0)
}

// ANCHOR: masked_forward
/// The masked forward over `block_mask`'s tiles, and the work it did.
pub fn forward_with(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    block_mask: &BlockMask,
    score: &ScoreMod,
) -> Result<(Attention, Work), AttnError> {
    let shape = check_masked(&q, &k, &v, block_mask.mask(), score)?;
    check_block_mask(shape, block_mask)?;
    let [_, h_n, t_n, d_n] = shape.q_dims();
    let zeros = |what, len| try_zeros::<f32>(what, Some(len));
    let mut out = zeros("out", shape.batch * h_n * t_n * d_n)?;
    let mut lse = zeros("lse", shape.batch * h_n * t_n)?;
    let work = out
        .par_chunks_mut((t_n * d_n).max(1))
        .zip(lse.par_chunks_mut(t_n.max(1)))
        .enumerate()
        .map(|(bh, (out, lse))| {
            let (b, h) = (bh / h_n, bh % h_n);
            let head = Head::new(shape, b, h, &q, &k, &v, block_mask, score);
            head.forward(out, lse)
        })
        .reduce(Work::default, |a, b| a + b);
    let out = Array4::from_shape_vec(shape.q_dims(), out).expect("b·h·tq·d values");
    let lse = ndarray::Array3::from_shape_vec((shape.batch, h_n, t_n), lse)
        .expect("b·h·tq values");
    Ok((Attention { out, lse }, work))
}
// ANCHOR_END: masked_forward

/// The masked backward with 64 × 64 blocks. `fwd` is what a forward returned for these
/// inputs (its output and log-sum-exp).
pub fn backward(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    fwd: &Attention,
    dout: ArrayView4<f32>,
    mask: &Mask,
    score: &ScoreMod,
) -> Result<Grads, AttnError> {
    let shape = check_masked(&q, &k, &v, mask, score)?;
    let block_mask = default_block_mask(shape, mask)?;
    Ok(backward_with(q, k, v, fwd, dout, &block_mask, score)?.0)
}

// ANCHOR: masked_backward
/// The masked backward over `block_mask`'s tiles, and the work it did: one task per
/// (sequence, kv head), which walks each key block's list of query blocks.
pub fn backward_with(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    fwd: &Attention,
    dout: ArrayView4<f32>,
    block_mask: &BlockMask,
    score: &ScoreMod,
) -> Result<(Grads, Work), AttnError> {
    let shape = check_masked(&q, &k, &v, block_mask.mask(), score)?;
    check_block_mask(shape, block_mask)?;
    check_grads_inputs(shape, &dout, &fwd.out.view(), fwd.lse.dim().into())?;
    let (t_n, s_n, d_n, group) = (
        shape.q_tokens,
        shape.kv_tokens,
        shape.head_dim,
        shape.group().max(1),
    );
    let zeros = |what, len| try_zeros::<f32>(what, Some(len));
    let q_len = shape.batch * shape.heads * t_n * d_n;
    let kv_len = shape.batch * shape.kv_heads * s_n * d_n;
    let (mut dq, mut dk, mut dv) = (
        zeros("dq", q_len)?,
        zeros("dk", kv_len)?,
        zeros("dv", kv_len)?,
    );
    let work = dq
        .par_chunks_mut((group * t_n * d_n).max(1))
        .zip(dk.par_chunks_mut((s_n * d_n).max(1)))
        .zip(dv.par_chunks_mut((s_n * d_n).max(1)))
        .enumerate()
        .map(|(bg, ((dq, dk), dv))| {
            let (b, g) = (bg / shape.kv_heads, bg % shape.kv_heads);
            let mut dk = ArrayViewMut2::from_shape((s_n, d_n), dk).expect("[tk, d]");
            let mut dv = ArrayViewMut2::from_shape((s_n, d_n), dv).expect("[tk, d]");
            let mut work = Work::default();
            for (n, dq) in dq.chunks_mut((t_n * d_n).max(1)).enumerate() {
                let h = g * group + n;
                let head = Head::new(shape, b, h, &q, &k, &v, block_mask, score);
                let dq = ArrayViewMut2::from_shape((t_n, d_n), dq).expect("[tq, d]");
                let fwd = (
                    fwd.out.slice(s![b, h, .., ..]),
                    fwd.lse.slice(s![b, h, ..]).to_vec(),
                );
                let dout = dout.slice(s![b, h, .., ..]);
                work = work + head.backward(fwd, dout, dq, dk.view_mut(), dv.view_mut());
            }
            work
        })
        .reduce(Work::default, |a, b| a + b);
    let grad = |dims: [usize; 4], buf| Array4::from_shape_vec(dims, buf).expect("sizes");
    let grads = Grads {
        dq: grad(shape.q_dims(), dq),
        dk: grad(shape.kv_dims(), dk),
        dv: grad(shape.kv_dims(), dv),
    };
    Ok((grads, work))
}
// ANCHOR_END: masked_backward

/// One query head of one sequence, and the kv head it reads.
struct Head<'a> {
    q: ArrayView2<'a, f32>,
    k: ArrayView2<'a, f32>,
    v: ArrayView2<'a, f32>,
    b: usize,
    h: usize,
    /// The absolute position of query row 0.
    offset: usize,
    scale: f32,
    table: usize,
    block_mask: &'a BlockMask,
    score: &'a ScoreMod,
}

impl<'a> Head<'a> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        shape: QkvShape,
        b: usize,
        h: usize,
        q: &'a ArrayView4<f32>,
        k: &'a ArrayView4<f32>,
        v: &'a ArrayView4<f32>,
        block_mask: &'a BlockMask,
        score: &'a ScoreMod,
    ) -> Head<'a> {
        let g = shape.kv_head(h);
        Head {
            q: q.slice(s![b, h, .., ..]),
            k: k.slice(s![b, g, .., ..]),
            v: v.slice(s![b, g, .., ..]),
            b,
            h,
            offset: shape.offset(),
            scale: shape.scale() as f32,
            table: block_mask.table(b, h),
            block_mask,
            score,
        }
    }

    // ANCHOR: tile_scores
    /// The tile's scores after the score function, `−∞` where the mask hides a key: the
    /// mask is asked only when the tile is partial.
    fn scores(
        &self,
        rows: std::ops::Range<usize>,
        keys: std::ops::Range<usize>,
        full: bool,
        work: &mut Work,
    ) -> (Array2<f32>, Array2<f32>) {
        let raw = self
            .q
            .slice(s![rows.clone(), ..])
            .dot(&self.k.slice(s![keys.clone(), ..]).t())
            * self.scale;
        let mut modified = raw.clone();
        let mask = self.block_mask.mask();
        for ((r, c), x) in modified.indexed_iter_mut() {
            let (qp, key) = (rows.start + r + self.offset, keys.start + c);
            if !full {
                work.mask_calls += 1;
                if !mask.allows(self.b, self.h, qp, key) {
                    *x = f32::NEG_INFINITY;
                    continue;
                }
            }
            work.kept += 1;
            if !self.score.is_identity() {
                *x = self.score.apply(f64::from(*x), self.b, self.h, qp, key) as f32;
            }
        }
        work.scores += (rows.len() * keys.len()) as u64;
        (raw, modified)
    }
    // ANCHOR_END: tile_scores

    // ANCHOR: online_tiles
    /// The forward of this head into `out` (`[tq, d]`) and `lse` (`[tq]`): for each query
    /// block, step 02's running maximum, sum and output over the key blocks it sees.
    fn forward(&self, out: &mut [f32], lse: &mut [f32]) -> Work {
        let (t_n, d_n) = self.q.dim();
        let blocks = self.block_mask.blocks();
        let mut work = Work::default();
        let mut out = ArrayViewMut2::from_shape((t_n, d_n), out).expect("[tq, d]");
        for i in 0..self.block_mask.q_blocks() {
            let rows = i * blocks.queries..((i + 1) * blocks.queries).min(t_n);
            // m: each row's largest score so far; l: its sum of e^(s − m);
            // acc: its Σ e^(s − m)·v
            let mut m = vec![f32::NEG_INFINITY; rows.len()];
            let mut l = vec![0.0f32; rows.len()];
            let mut acc = Array2::<f32>::zeros((rows.len(), d_n));
            for (j, full) in self.block_mask.kv_blocks_of(self.table, i) {
                let keys = j * blocks.keys..((j + 1) * blocks.keys).min(self.k.nrows());
                let (_, mut p) = self.scores(rows.clone(), keys.clone(), full, &mut work);
                for (r, mut row) in p.rows_mut().into_iter().enumerate() {
                    let m_new = row.fold(m[r], |a, &b| a.max(b));
                    if m_new == f32::NEG_INFINITY {
                        // the row has seen no key yet: nothing to rescale or add
                        row.fill(0.0);
                        continue;
                    }
                    // a new maximum shrinks what was summed so far by e^(m_old − m_new)
                    let shrink = (m[r] - m_new).exp();
                    row.mapv_inplace(|s| (s - m_new).exp());
                    l[r] = l[r] * shrink + row.sum();
                    acc.row_mut(r).mapv_inplace(|x| x * shrink);
                    m[r] = m_new;
                }
                acc += &p.dot(&self.v.slice(s![keys, ..]));
            }
            for (r, t) in rows.enumerate() {
                // a row that saw no key: output 0, log-sum-exp −∞
                if l[r] > 0.0 {
                    out.row_mut(t).assign(&(&acc.row(r) / l[r]));
                    lse[t] = m[r] + l[r].ln();
                } else {
                    lse[t] = f32::NEG_INFINITY;
                }
            }
        }
        work
    }
    // ANCHOR_END: online_tiles

    // ANCHOR: backward_tiles
    /// This head's part of the backward: for each key block, the query blocks that see it,
    /// `P = e^(s' − lse)` rebuilt, `dS = P ∘ (dP − δ) · score'(s)`, added into dQ (this
    /// head's), dK and dV (its kv head's, shared with the group's other heads).
    fn backward(
        &self,
        (out, lse): (ArrayView2<f32>, Vec<f32>),
        dout: ArrayView2<f32>,
        mut dq: ArrayViewMut2<f32>,
        mut dk: ArrayViewMut2<f32>,
        mut dv: ArrayViewMut2<f32>,
    ) -> Work {
        let blocks = self.block_mask.blocks();
        let (t_n, s_n) = (self.q.nrows(), self.k.nrows());
        // δ_i = Σ_d dO_id·O_id = Σ_j P_ij·dP_ij (0 for a row that saw no key)
        let delta: Vec<f32> = (0..t_n).map(|i| out.row(i).dot(&dout.row(i))).collect();
        let mut work = Work::default();
        for j in 0..self.block_mask.kv_blocks() {
            let keys = j * blocks.keys..((j + 1) * blocks.keys).min(s_n);
            for (i, full) in self.block_mask.q_blocks_of(self.table, j) {
                let rows = i * blocks.queries..((i + 1) * blocks.queries).min(t_n);
                let (raw, modified) =
                    self.scores(rows.clone(), keys.clone(), full, &mut work);
                let p = Array2::from_shape_fn(modified.dim(), |(r, c)| {
                    let (s, lse) = (modified[[r, c]], lse[rows.start + r]);
                    if s == f32::NEG_INFINITY || lse == f32::NEG_INFINITY {
                        0.0
                    } else {
                        (s - lse).exp()
                    }
                });
                let dout_i = dout.slice(s![rows.clone(), ..]);
                let dp = dout_i.dot(&self.v.slice(s![keys.clone(), ..]).t());
                let ds = Array2::from_shape_fn(p.dim(), |(r, c)| {
                    let at = (rows.start + r, keys.start + c);
                    let chain = if self.score.is_identity() {
                        1.0
                    } else {
                        let qp = at.0 + self.offset;
                        let s = f64::from(raw[[r, c]]);
                        self.score.grad(s, self.b, self.h, qp, at.1) as f32
                    };
                    p[[r, c]] * (dp[[r, c]] - delta[at.0]) * chain
                });
                let mut dv = dv.slice_mut(s![keys.clone(), ..]);
                dv += &p.t().dot(&dout_i); // dV_j += P_ijᵀ·dO_i
                let mut dk = dk.slice_mut(s![keys.clone(), ..]);
                // dK_j += dS_ijᵀ·Q_i·scale
                dk.scaled_add(self.scale, &ds.t().dot(&self.q.slice(s![rows.clone(), ..])));
                let mut dq = dq.slice_mut(s![rows, ..]);
                // dQ_i += dS_ij·K_j·scale
                dq.scaled_add(self.scale, &ds.dot(&self.k.slice(s![keys.clone(), ..])));
            }
        }
        work
    }
    // ANCHOR_END: backward_tiles
}
