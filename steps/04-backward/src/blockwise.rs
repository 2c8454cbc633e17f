//! The blockwise backward of FlashAttention-2 (Dao 2023, Algorithm 2), on the CPU.
//!
//! Nothing of size T×T is ever allocated. The probabilities are rebuilt a block at a time
//! from the scores and the log-sum-exp the forward kept, `P_ij = exp(S_ij − lse_i)`, and
//! used at once. First [`delta`]: `δ_i = Σ_d dO_i·O_i`, once per row (FA-2 Algorithm 2,
//! line 4; in the FlashAttention code the "preprocessing" kernel). Then one of two ways:
//!
//! - [`backward`] (and [`backward_with_blocks`]): Algorithm 2 as written, one pass. A task
//!   takes a run of a head's key blocks; for each it streams past every block of queries
//!   that can see it, adding into its rows of dK and dV and into the queries' rows of dQ.
//!   The task owns a whole dQ for its head to add into, so no two tasks ever add to the
//!   same number: when a head is split into several runs (so that there are enough tasks
//!   for the threads), each run has its own dQ, and they are summed in a fixed order at the
//!   end. Five products per block pair.
//! - [`backward_two_pass`]: the split of the GPU kernels (chapter 4). The key pass has one
//!   task per (sequence, head, block of keys), owning its block's dK and dV; the query pass
//!   one task per (sequence, head, block of queries), owning its block's dQ. The scores,
//!   probabilities and `dP` are computed twice: seven products per block pair.
//!
//! Both sum every gradient in one fixed order, chosen from the shape alone: the result is
//! identical on every run and on any number of threads.

use std::ops::Range;

use flash_core::{Attention, AttnError, Shape, try_zeros};
use ndarray::linalg::general_mat_mul;
use ndarray::{
    Array2, Array3, Array4, ArrayView1, ArrayView2, ArrayView4, ArrayViewMut2, Axis,
};
use ndarray::{Zip, s};
use rayon::prelude::*;
use step02_online_softmax::{Isa, kernels::Kernels};

use crate::{Grads, check_backward};

/// How many queries and how many keys one block holds. Any sizes of at least 1 give the
/// same gradients up to rounding; they only change the speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSizes {
    /// Rows of a block: queries (and their `dO`, `lse`, `δ`).
    pub queries: usize,
    /// Columns of a block: keys and values.
    pub keys: usize,
}

impl Default for BlockSizes {
    /// 128 × 128: a block of `P` or `dS` is 64 KiB, and the two of them and the four `128 ×
    /// d` slices they are made from stay in a core's L2 cache; the products of `ndarray`
    /// run faster on them than on 64 × 64 blocks.
    fn default() -> Self {
        BlockSizes {
            queries: 128,
            keys: 128,
        }
    }
}

impl BlockSizes {
    /// The sizes [`backward`] takes for a sequence of `tokens`: 128 × 128, and 256 × 256
    /// from 4,096 tokens, where the longer products outweigh the larger blocks' longer tail
    /// (on the 2-core EPYC of chapter 2, 1–10% faster at 4,096 and 8,192 tokens and 4–8%
    /// slower at 2,048: `examples/backward-speed.rs`).
    pub fn for_tokens(tokens: usize) -> BlockSizes {
        let side = if tokens >= 4096 { 256 } else { 128 };
        BlockSizes {
            queries: side,
            keys: side,
        }
    }
}

/// The gradients of q, k and v, blockwise, with the block sizes of
/// [`BlockSizes::for_tokens`]. `fwd` is what a forward returned for these q, k and v: its
/// output and the natural-log log-sum-exp of each row.
pub fn backward(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    fwd: &Attention,
    dout: ArrayView4<f32>,
) -> Result<Grads, AttnError> {
    let blocks = BlockSizes::for_tokens(q.dim().2);
    backward_with_blocks(q, k, v, fwd, dout, blocks)
}

// ANCHOR: blockwise_backward
/// The gradients of q, k and v in one pass, with the given block sizes.
pub fn backward_with_blocks(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    fwd: &Attention,
    dout: ArrayView4<f32>,
    blocks: BlockSizes,
) -> Result<Grads, AttnError> {
    let shape = check_backward(&q, &k, &v, fwd, &dout)?;
    check_blocks(blocks)?;
    if shape.is_empty() {
        return Ok(Grads::zeros(shape));
    }
    let delta = delta(fwd.out.view(), dout); // [b, h, T]
    let [_, _, t_n, d_n] = shape.dims();
    let zeros = |what, len| try_zeros::<f32>(what, Some(len));
    let (mut dq, mut dk, mut dv) = (
        zeros("dq", shape.len())?,
        zeros("dk", shape.len())?,
        zeros("dv", shape.len())?,
    );
    let kernels = Kernels::new(Isa::detect())?;
    let head =
        |bh: usize| Head::new(bh, shape, &q, &k, &v, &dout, fwd, &delta, blocks, kernels);
    // each head's key blocks in runs of about equal work, `ends[r]..ends[r + 1]`; the runs
    // after the first add into a dQ of their own, [head][run - 1][T][d]
    let ends = runs(shape, blocks);
    let per_head = t_n * d_n;
    let extra_per_head = (ends.len() - 2) * per_head;
    let heads_n = shape.batch * shape.heads;
    let mut extra = zeros("a copy of dq per extra run", heads_n * extra_per_head)?;
    let mut tasks = Vec::new();
    let mut extras = extra.as_mut_slice();
    let heads = dq
        .chunks_mut(per_head)
        .zip(dk.chunks_mut(per_head))
        .zip(dv.chunks_mut(per_head));
    for (bh, ((dq, mut dk), mut dv)) in heads.enumerate() {
        let (extra, rest) = extras.split_at_mut(extra_per_head);
        extras = rest;
        let mut dqs = std::iter::once(dq).chain(extra.chunks_mut(per_head));
        let mut done = 0; // key rows handed out so far
        for run in ends.windows(2) {
            let rows = (run[1] * blocks.keys).min(t_n) - done;
            let (dk_run, dk_rest) = dk.split_at_mut(rows * d_n);
            let (dv_run, dv_rest) = dv.split_at_mut(rows * d_n);
            (dk, dv) = (dk_rest, dv_rest);
            let dq = dqs.next().expect("one dq per run");
            tasks.push((bh, run[0]..run[1], dk_run, dv_run, dq));
            done += rows;
        }
    }
    tasks
        .into_par_iter()
        .for_each(|(bh, run, dk, dv, dq)| head(bh).key_run(run, dk, dv, dq));
    // dQ = the first run's + the others', in order
    if extra_per_head > 0 {
        dq.par_chunks_mut(per_head)
            .zip(extra.par_chunks(extra_per_head))
            .for_each(|(dq, extra)| {
                for part in extra.chunks(per_head) {
                    dq.iter_mut().zip(part).for_each(|(a, b)| *a += b);
                }
            });
    }
    Ok(grads(shape, dq, dk, dv))
}
// ANCHOR_END: blockwise_backward

// ANCHOR: runs
/// Where a head's key blocks are cut into runs: `ends[r]..ends[r + 1]` is run r. As many
/// runs as make about 16 tasks in all (at most 4 per head, at least 2 blocks each), cut so
/// that each run sees about the same number of queries (the first key blocks are seen by
/// the most). A function of the shape alone, never of the thread count, so the sums run in
/// the same order on any machine.
fn runs(shape: Shape, blocks: BlockSizes) -> Vec<usize> {
    let (t_n, bc) = (shape.tokens, blocks.keys);
    let n = t_n.div_ceil(bc);
    let count = 16usize
        .div_ceil(shape.batch * shape.heads)
        .min(4)
        .min(n / 2)
        .max(1);
    // key block j is seen by the queries from its first key on: T − j·bc of them
    let work = |j: usize| t_n - j * bc;
    let total: usize = (0..n).map(work).sum();
    let mut ends = vec![0];
    let mut sum = 0;
    for j in 0..n {
        sum += work(j);
        if sum * count >= ends.len() * total && ends.len() < count {
            ends.push(j + 1);
        }
    }
    ends.push(n);
    ends
}
// ANCHOR_END: runs

fn check_blocks(blocks: BlockSizes) -> Result<(), AttnError> {
    if blocks.queries == 0 || blocks.keys == 0 {
        return Err(AttnError::Unsupported {
            what: format!("block sizes {blocks:?}: both must be at least 1"),
        });
    }
    Ok(())
}

fn grads(shape: Shape, dq: Vec<f32>, dk: Vec<f32>, dv: Vec<f32>) -> Grads {
    let grad = |buf| Array4::from_shape_vec(shape.dims(), buf).expect("length is b·h·T·d");
    Grads {
        dq: grad(dq),
        dk: grad(dk),
        dv: grad(dv),
    }
}

// ANCHOR: two_pass_backward
/// The gradients of q, k and v in two passes, as the GPU kernels compute them: dK and dV
/// per block of keys, then dQ per block of queries.
pub fn backward_two_pass(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    fwd: &Attention,
    dout: ArrayView4<f32>,
    blocks: BlockSizes,
) -> Result<Grads, AttnError> {
    let shape = check_backward(&q, &k, &v, fwd, &dout)?;
    check_blocks(blocks)?;
    if shape.is_empty() {
        return Ok(Grads::zeros(shape));
    }
    // [b, h, T]: the only thing kept besides dq, dk and dv
    let delta = delta(fwd.out.view(), dout);
    let [_, _, t_n, d_n] = shape.dims();
    let zeros = |what| try_zeros::<f32>(what, Some(shape.len()));
    let (mut dq, mut dk, mut dv) = (zeros("dq")?, zeros("dk")?, zeros("dv")?);
    let kernels = Kernels::new(Isa::detect())?;
    let head =
        |bh: usize| Head::new(bh, shape, &q, &k, &v, &dout, fwd, &delta, blocks, kernels);
    // the key pass: one task per (sequence, head, block of keys), owning its rows of dK and
    // dV
    let per_head = t_n * d_n;
    let per_key_block = blocks.keys * d_n;
    dk.par_chunks_mut(per_head)
        .zip(dv.par_chunks_mut(per_head))
        .enumerate()
        .flat_map(|(bh, (dk, dv))| {
            let chunks = dk.par_chunks_mut(per_key_block);
            let chunks = chunks.zip(dv.par_chunks_mut(per_key_block));
            chunks.enumerate().map(move |(j, kv)| (bh, j, kv))
        })
        .for_each(|(bh, j, (dk, dv))| head(bh).key_block(j, dk, dv));
    // the query pass: one task per (sequence, head, block of queries), owning its rows of
    // dQ
    let per_query_block = blocks.queries * d_n;
    dq.par_chunks_mut(per_head)
        .enumerate()
        .flat_map(|(bh, dq)| {
            let chunks = dq.par_chunks_mut(per_query_block).enumerate();
            chunks.map(move |(i, dq)| (bh, i, dq))
        })
        .for_each(|(bh, i, dq)| head(bh).query_block(i, dq));
    Ok(grads(shape, dq, dk, dv))
}
// ANCHOR_END: two_pass_backward

// ANCHOR: delta
/// `δ_i = Σ_d dO_id·O_id` for every row, `[batch, heads, tokens]`: the row sums
/// `Σ_j P_ij·dP_ij` that the softmax's gradient needs, without `P` or `dP`, since
/// `Σ_j P_ij·(dO_i·v_j) = dO_i·Σ_j P_ij·v_j = dO_i·O_i`.
pub fn delta(out: ArrayView4<f32>, dout: ArrayView4<f32>) -> Array3<f32> {
    Zip::from(out.lanes(Axis(3)))
        .and(dout.lanes(Axis(3)))
        .map_collect(|o, g| o.dot(&g))
}
// ANCHOR_END: delta

/// One head of one sequence: the `[T, d]` slices of the inputs and the `[T]` rows of `lse`
/// and `δ`.
struct Head<'a> {
    q: ArrayView2<'a, f32>,
    k: ArrayView2<'a, f32>,
    v: ArrayView2<'a, f32>,
    dout: ArrayView2<'a, f32>,
    lse: ArrayView1<'a, f32>,
    delta: ArrayView1<'a, f32>,
    scale: f32,
    blocks: BlockSizes,
    kernels: Kernels,
}

impl<'a> Head<'a> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        bh: usize,
        shape: Shape,
        q: &'a ArrayView4<f32>,
        k: &'a ArrayView4<f32>,
        v: &'a ArrayView4<f32>,
        dout: &'a ArrayView4<f32>,
        fwd: &'a Attention,
        delta: &'a Array3<f32>,
        blocks: BlockSizes,
        kernels: Kernels,
    ) -> Head<'a> {
        let (b, h) = (bh / shape.heads, bh % shape.heads);
        Head {
            q: q.slice(s![b, h, .., ..]),
            k: k.slice(s![b, h, .., ..]),
            v: v.slice(s![b, h, .., ..]),
            dout: dout.slice(s![b, h, .., ..]),
            lse: fwd.lse.slice(s![b, h, ..]),
            delta: delta.slice(s![b, h, ..]),
            scale: shape.scale() as f32,
            blocks,
            kernels,
        }
    }

    // ANCHOR: one_pass
    /// Key blocks `run` of the head: for each, `dV_j = Σ_i P_ijᵀ·dO_i`, `dK_j = Σ_i
    /// dS_ijᵀ·Q_i·scale` into `dk` and `dv` (the run's rows, from its first key on), and
    /// `dQ_i += dS_ij·K_j·scale` into `dq` (a whole `[T, d]` dQ this run owns).
    fn key_run(&self, run: Range<usize>, dk: &mut [f32], dv: &mut [f32], dq: &mut [f32]) {
        let (t_n, d_n) = self.q.dim();
        let (br, bc) = (self.blocks.queries, self.blocks.keys);
        let first_key = run.start * bc;
        let mut dk =
            ArrayViewMut2::from_shape((dk.len() / d_n, d_n), dk).expect("[keys, d]");
        let mut dv =
            ArrayViewMut2::from_shape((dv.len() / d_n, d_n), dv).expect("[keys, d]");
        let mut dq = ArrayViewMut2::from_shape((t_n, d_n), dq).expect("[T, d]");
        let mut p = Array2::zeros((br, bc));
        let mut ds = Array2::zeros((br, bc));
        for j in run {
            let keys = j * bc..((j + 1) * bc).min(t_n);
            let local = keys.start - first_key..keys.end - first_key;
            let mut dk = dk.slice_mut(s![local.clone(), ..]);
            let mut dv = dv.slice_mut(s![local, ..]);
            let k = self.k.slice(s![keys.clone(), ..]);
            // causal: the query blocks before the one holding the first key see none of
            // them
            for start in (keys.start / br * br..t_n).step_by(br) {
                let rows = start..(start + br).min(t_n);
                let mut p = p.slice_mut(s![..rows.len(), ..keys.len()]);
                let mut ds = ds.slice_mut(s![..rows.len(), ..keys.len()]);
                self.probabilities(rows.clone(), keys.clone(), &mut p);
                self.grad_scores(rows.clone(), keys.clone(), &p.view(), &mut ds);
                let (q, dout) = (
                    self.q.slice(s![rows.clone(), ..]),
                    self.dout.slice(s![rows.clone(), ..]),
                );
                general_mat_mul(1.0, &p.t(), &dout, 1.0, &mut dv); // dV_j += P_ijᵀ·dO_i
                // dK_j += dS_ijᵀ·Q_i·scale
                general_mat_mul(self.scale, &ds.t(), &q, 1.0, &mut dk);
                let mut dq = dq.slice_mut(s![rows, ..]);
                // dQ_i += dS_ij·K_j·scale
                general_mat_mul(self.scale, &ds, &k, 1.0, &mut dq);
            }
        }
    }
    // ANCHOR_END: one_pass

    // ANCHOR: key_pass
    /// Key block `j`: `dK_j = Σ_i dS_ijᵀ·Q_i·scale` and `dV_j = Σ_i P_ijᵀ·dO_i` over the
    /// query blocks `i` that see any of its keys, written into `dk` and `dv`, its `[keys,
    /// d]` rows.
    fn key_block(&self, j: usize, dk: &mut [f32], dv: &mut [f32]) {
        let (t_n, d_n) = self.q.dim();
        let keys = j * self.blocks.keys..((j + 1) * self.blocks.keys).min(t_n);
        let mut dk = ArrayViewMut2::from_shape((keys.len(), d_n), dk).expect("[keys, d]");
        let mut dv = ArrayViewMut2::from_shape((keys.len(), d_n), dv).expect("[keys, d]");
        let mut p = Array2::zeros((self.blocks.queries, keys.len()));
        let mut ds = Array2::zeros((self.blocks.queries, keys.len()));
        // causal: the blocks of queries before the one holding query `keys.start` see none
        // of these keys (every query there comes before every key here), so they are
        // skipped
        let first = keys.start / self.blocks.queries * self.blocks.queries;
        for start in (first..t_n).step_by(self.blocks.queries) {
            let rows = start..(start + self.blocks.queries).min(t_n);
            let mut p = p.slice_mut(s![..rows.len(), ..]);
            let mut ds = ds.slice_mut(s![..rows.len(), ..]);
            self.probabilities(rows.clone(), keys.clone(), &mut p);
            self.grad_scores(rows.clone(), keys.clone(), &p.view(), &mut ds);
            let dout = self.dout.slice(s![rows.clone(), ..]);
            general_mat_mul(1.0, &p.t(), &dout, 1.0, &mut dv); // dV_j += P_ijᵀ·dO_i
            let q = self.q.slice(s![rows, ..]);
            // dK_j += dS_ijᵀ·Q_i·scale
            general_mat_mul(self.scale, &ds.t(), &q, 1.0, &mut dk);
        }
    }
    // ANCHOR_END: key_pass

    // ANCHOR: query_pass
    /// Query block `i`: `dQ_i = Σ_j dS_ij·K_j·scale` over the key blocks `j` it sees,
    /// written into `dq`, its `[queries, d]` rows.
    fn query_block(&self, i: usize, dq: &mut [f32]) {
        let (t_n, d_n) = self.q.dim();
        let rows = i * self.blocks.queries..((i + 1) * self.blocks.queries).min(t_n);
        let mut dq =
            ArrayViewMut2::from_shape((rows.len(), d_n), dq).expect("[queries, d]");
        let mut p = Array2::zeros((rows.len(), self.blocks.keys));
        let mut ds = Array2::zeros((rows.len(), self.blocks.keys));
        // causal: the key blocks that start after the last query here are skipped
        for start in (0..rows.end).step_by(self.blocks.keys) {
            let keys = start..(start + self.blocks.keys).min(t_n);
            let mut p = p.slice_mut(s![.., ..keys.len()]);
            let mut ds = ds.slice_mut(s![.., ..keys.len()]);
            self.probabilities(rows.clone(), keys.clone(), &mut p);
            self.grad_scores(rows.clone(), keys.clone(), &p.view(), &mut ds);
            let k = self.k.slice(s![keys, ..]);
            // dQ_i += dS_ij·K_j·scale
            general_mat_mul(self.scale, &ds, &k, 1.0, &mut dq);
        }
    }
    // ANCHOR_END: query_pass

    // ANCHOR: probabilities_from_lse
    /// The block of probabilities `P_ij = exp(S_ij − lse_i)` for queries `rows` and keys
    /// `cols`, from the scores `S = Q·Kᵀ·scale` and the log-sum-exp the forward kept: no
    /// maximum and no sum to find again, since `lse_i` already holds both. Masked entries
    /// (key after query) are exactly 0.
    ///
    /// `S_ij − lse_i` is small where `P_ij` is large, while both may be in the hundreds: an
    /// error of one part in 10⁷ in either is an error of 10⁻⁵ in `P_ij`. So the scores are
    /// rounded exactly as the forwards of steps 01 and 02 round theirs (`ndarray`'s product
    /// with the scale as its `alpha`, one rounding of the finished dot product), and the
    /// subtraction comes before anything else, where it is exact for a score near the
    /// log-sum-exp.
    fn probabilities(
        &self,
        rows: Range<usize>,
        cols: Range<usize>,
        p: &mut ArrayViewMut2<f32>,
    ) {
        let (q, k) = (
            self.q.slice(s![rows.clone(), ..]),
            self.k.slice(s![cols.clone(), ..]),
        );
        general_mat_mul(self.scale, &q, &k.t(), 0.0, p); // S_ij
        for (i, mut row) in rows.zip(p.rows_mut()) {
            // query i sees keys 0..=i: the first `seen` columns of this block
            let seen = (i + 1).saturating_sub(cols.start).min(cols.len());
            let row = row.as_slice_mut().expect("a block's rows are contiguous");
            let (live, masked) = row.split_at_mut(seen);
            // e^(s − lse) = 2^((s − lse)·log2 e), with step 02's polynomial
            self.kernels
                .exp2_shifted(live, self.lse[i], std::f32::consts::LOG2_E);
            masked.fill(0.0);
        }
    }
    // ANCHOR_END: probabilities_from_lse

    // ANCHOR: grad_scores
    /// The block of score gradients `dS_ij = P_ij·(dP_ij − δ_i)`, with `dP = dO_i·V_jᵀ`.
    /// Where `P` is masked to 0, so is `dS`.
    fn grad_scores(
        &self,
        rows: Range<usize>,
        cols: Range<usize>,
        p: &ArrayView2<f32>,
        ds: &mut ArrayViewMut2<f32>,
    ) {
        let (dout, v) = (
            self.dout.slice(s![rows.clone(), ..]),
            self.v.slice(s![cols, ..]),
        );
        general_mat_mul(1.0, &dout, &v.t(), 0.0, ds); // dP_ij
        for (i, (mut ds, p)) in rows.zip(ds.rows_mut().into_iter().zip(p.rows())) {
            let delta = self.delta[i];
            ds.zip_mut_with(&p, |d, &p| *d = p * (*d - delta));
        }
    }
    // ANCHOR_END: grad_scores
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delta_is_the_row_dot_of_out_and_dout() {
        let out = Array4::from_shape_vec((1, 1, 2, 3), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
            .unwrap();
        let dout =
            Array4::from_shape_vec((1, 1, 2, 3), vec![1.0, 0.0, -1.0, 0.5, 0.5, 0.5]);
        let d = delta(out.view(), dout.unwrap().view());
        assert_eq!(d.into_raw_vec_and_offset().0, vec![-2.0, 7.5]);
    }
}
