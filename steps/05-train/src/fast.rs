//! The CPU trainer's fast path: the model of [`crate::model`], layer for layer, computed
//! the way llm.c's `train_gpt2.c` computes it on a CPU. The readable model is what the
//! chapter teaches and what this path is checked against (`tests/fast_path.rs`: the same
//! losses within `f32` rounding, step after step, and the same gradients on a tiny model);
//! `train --cpu-path fast` (the default) trains with this one, `--cpu-path readable` with
//! that one.
//!
//! The attention is the readable model's, [`Float::attention`] and
//! [`Float::attention_backward`]: step 02's online softmax and step 04's blockwise
//! backward. What changes is everything around it:
//!
//! - **A shard of the batch per thread.** A batch's sequences are independent until their
//!   gradients are summed, so each of rayon's threads takes a run of whole sequences
//!   through the entire forward and backward, and the shards' gradients are added at the
//!   end, in shard order (which thread ran what does not change the sum; how many threads
//!   there are does, so a run resumed with other threads is told so). Within a shard
//!   the products run on one thread: a product of a thousand rows is too short to split
//!   twice. This is step 07's data parallelism, over the cores of one CPU.
//! - **The products by faer**, whose kernels use the CPU's widest vectors (AVX-512 where
//!   it has them; `ndarray`'s matrixmultiply stops at AVX2). A product adds into what is
//!   there: the bias, or the residual stream, is written first and the product lands on
//!   top.
//! - **Memory allocated once.** Each shard keeps its activations and gradients from step to
//!   step, as llm.c allocates its activations at the first forward: a buffer freed and
//!   allocated again every layer of every step costs the kernel a page fault per 4 KiB,
//!   which took a quarter of a step.
//! - **Fewer passes, vectorised.** `e^x` for the softmax and for GELU's `tanh` is step
//!   02's SIMD polynomial; GELU keeps its `tanh` for the backward; the softmax, the
//!   cross-entropy and its gradient are one pass over a row of logits; q, k and v are
//!   copied to and from the heads' layout a head's row at a time.
//!
//! ## Layout
//!
//! - [`FastCpu`]: a [`Trainer`] trained by this path, as a [`Learner`].
//! - [`Workspace`]: each shard's buffers, kept from step to step.
//! - [`loss_and_grads`]: one batch's mean loss and its gradients, shard by shard.
//! - [`batch_loss`]: the mean loss alone (the held-out loss).

use std::f32::consts::LOG2_E;
use std::time::Instant;

use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use flash_core::Attention;
use ndarray::{Array4, ArrayView2, ArrayView4, Axis};
use rayon::prelude::*;
use step02_online_softmax::{Isa, kernels::Kernels};
use step09_masks::{Documents, Mask}; // [step 09]

use crate::TrainError;
use crate::data::{Batch, Corpus, train_batch};
use crate::layers::{Float, LAYERNORM_EPS};
use crate::model::{Block, Config, Params, check_inputs};
use crate::optim::clip_grad_norm;
use crate::train::{Hardware, Learner, Settings, StepRecord, Trainer};

// ANCHOR: product
/// A row-major `[rows, cols]` slice as a matrix, for faer.
fn mat(data: &[f32], cols: usize) -> MatRef<'_, f32> {
    MatRef::from_row_major_slice(data, data.len() / cols, cols)
}

fn mat_mut(data: &mut [f32], cols: usize) -> MatMut<'_, f32> {
    MatMut::from_row_major_slice_mut(data, data.len() / cols, cols)
}

/// `c += a · b`, on this thread: the shards are the parallelism. A transpose is a view
/// (`mat(w, n).transpose()`), never a copy.
fn add_product(c: MatMut<f32>, a: MatRef<f32>, b: MatRef<f32>) {
    matmul(c, Accum::Add, a, b, 1.0, Par::Seq);
}

/// `c = a · b`: what `c` held is never read.
fn set_product(c: MatMut<f32>, a: MatRef<f32>, b: MatRef<f32>) {
    matmul(c, Accum::Replace, a, b, 1.0, Par::Seq);
}
// ANCHOR_END: product

/// The model's shape, as a shard of `sequences` sequences of `tokens` sees it.
#[derive(Clone, Copy)]
struct Dims {
    sequences: usize,
    tokens: usize,
    rows: usize, // sequences · tokens
    c: usize,    // d_model
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    qkv: usize, // the fused projection's columns
    vocab: usize,
}

impl Dims {
    fn new(cfg: &Config, sequences: usize, tokens: usize) -> Dims {
        // the fused projection holds q's heads, then k's and v's, all of one head dim
        let kv_heads = (cfg.qkv_width() - cfg.d_model) / (2 * cfg.head_dim());
        Dims {
            sequences,
            tokens,
            rows: sequences * tokens,
            c: cfg.d_model,
            heads: cfg.heads,
            kv_heads,
            head_dim: cfg.head_dim(),
            qkv: cfg.qkv_width(),
            vocab: cfg.vocab,
        }
    }

    /// `[B, H, T, D]`, the attention's layout.
    fn heads_shape(&self) -> (usize, usize, usize, usize) {
        (self.sequences, self.heads, self.tokens, self.head_dim)
    }
}

/// A LayerNorm's output and what its backward needs: each row's mean and `1/σ`.
#[derive(Default)]
struct Norm {
    out: Vec<f32>,
    mean: Vec<f32>,
    rstd: Vec<f32>,
}

/// What one block's forward keeps for its backward (as [`crate::model::BlockActs`]), all
/// `[rows, width]` but q, k, v, in `[B, H, T, D]`.
#[derive(Default)]
struct BlockActs {
    x: Vec<f32>,
    ln_1: Norm,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// The attention's output and log-sum-exp, as step 02 returns them.
    att: Option<Attention>,
    att_rows: Vec<f32>,
    x_mid: Vec<f32>,
    ln_2: Norm,
    /// Before the GELU, `[rows, 4C]`.
    fc: Vec<f32>,
    /// `tanh` of GELU's argument: its backward needs it again.
    fc_tanh: Vec<f32>,
    fc_gelu: Vec<f32>,
}

/// One shard's buffers, kept from step to step: its activations, its gradients, and the
/// gradients of the activations on the way back.
pub struct Workspace {
    blocks: Vec<BlockActs>,
    x_final: Vec<f32>,
    ln_f: Norm,
    /// `[rows, vocab]`: the logits, then their gradient.
    logits: Vec<f32>,
    grads: Params<f32>,
    d: ActGrads,
}

/// The gradients of the activations on the way back through the blocks.
#[derive(Default)]
struct ActGrads {
    dx: Vec<f32>,
    d_rows: Vec<f32>, // [rows, C]: the gradient of a LayerNorm's output or the attention's
    d_fc: Vec<f32>,   // [rows, 4C]
    d_heads: Vec<f32>,
    d_qkv: Vec<f32>,
}

impl Workspace {
    /// Empty buffers: the first step sizes them.
    pub fn new(config: Config) -> Workspace {
        Workspace {
            blocks: (0..config.layers).map(|_| BlockActs::default()).collect(),
            x_final: Vec::new(),
            ln_f: Norm::default(),
            logits: Vec::new(),
            grads: Params::zeros(config),
            d: ActGrads::default(),
        }
    }
}

/// `buf` as `len` zeros, in the memory it already has when that is enough.
fn zeros(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buf.clear();
    buf.resize(len, 0.0);
    buf
}

/// `buf` as `len` numbers, in the memory it already has when that is enough, for a product
/// to overwrite.
fn sized(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buf.resize(len, 0.0);
    &mut buf[..len]
}

/// Every row of `buf` set to `b`: a product then adds on top of its bias.
fn rows_of<'a>(buf: &'a mut Vec<f32>, b: &[f32], rows: usize) -> &'a mut [f32] {
    buf.clear();
    for _ in 0..rows {
        buf.extend_from_slice(b);
    }
    buf
}

/// Lanes of the running sums below: one AVX-512 register of `f32`, two of AVX2.
const LANES: usize = 16;

/// `Σ a∘b`, in [`LANES`] running sums that the compiler keeps in vector registers (a
/// single running sum must add one value at a time, in order).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (a, b) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = a
        .remainder()
        .iter()
        .zip(b.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (a, b) in a.zip(b) {
        for ((s, x), y) in acc.iter_mut().zip(a).zip(b) {
            *s += x * y;
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `Σ a`, the same way.
fn sum(a: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let a = a.chunks_exact(LANES);
    let tail: f32 = a.remainder().iter().sum();
    for a in a {
        acc.iter_mut().zip(a).for_each(|(s, x)| *s += x);
    }
    acc.iter().sum::<f32>() + tail
}

/// LayerNorm of each row, as [`crate::layers::layernorm`].
fn layernorm(x: &[f32], w: &[f32], b: &[f32], norm: &mut Norm) {
    let c = w.len();
    let rows = x.len() / c;
    let out = zeros(&mut norm.out, x.len());
    let (mean, rstd) = (zeros(&mut norm.mean, rows), zeros(&mut norm.rstd, rows));
    let n = c as f32;
    for (i, (x, y)) in x.chunks_exact(c).zip(out.chunks_exact_mut(c)).enumerate() {
        let m = sum(x) / n;
        y.iter_mut().zip(x).for_each(|(y, x)| *y = x - m);
        let r = 1.0 / (dot(y, y) / n + LAYERNORM_EPS as f32).sqrt();
        for ((y, w), b) in y.iter_mut().zip(w).zip(b) {
            *y = *y * r * w + b;
        }
        mean[i] = m;
        rstd[i] = r;
    }
}

/// The gradients of [`layernorm`], added into `dx`, `dw` and `db`, as
/// [`crate::layers::layernorm_backward`].
fn layernorm_backward(
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    norm: &Norm,
    dx: &mut [f32],
    dw: &mut [f32],
    db: &mut [f32],
) {
    let c = w.len();
    let n = c as f32;
    // x̂ = (x − μ)/σ and g = dy ∘ w, of one row
    let (mut xhat, mut g) = (vec![0.0; c], vec![0.0; c]);
    let rows = dy
        .chunks_exact(c)
        .zip(x.chunks_exact(c))
        .zip(dx.chunks_exact_mut(c));
    for (i, ((dy, x), dx)) in rows.enumerate() {
        let (m, r) = (norm.mean[i], norm.rstd[i]);
        xhat.iter_mut().zip(x).for_each(|(h, x)| *h = (x - m) * r);
        g.iter_mut()
            .zip(dy)
            .zip(w)
            .for_each(|((g, dy), w)| *g = dy * w);
        let (mean_g, mean_gx) = (sum(&g) / n, dot(&g, &xhat) / n);
        for (((dw, db), dy), h) in dw.iter_mut().zip(db.iter_mut()).zip(dy).zip(&xhat) {
            *dw += dy * h;
            *db += dy;
        }
        for ((dx, g), h) in dx.iter_mut().zip(&g).zip(&xhat) {
            *dx += (g - mean_g - h * mean_gx) * r;
        }
    }
}

/// `db += Σ_rows dy`: a bias's gradient.
fn add_column_sums(db: &mut [f32], dy: &[f32]) {
    for row in dy.chunks_exact(db.len()) {
        db.iter_mut().zip(row).for_each(|(d, g)| *d += g);
    }
}

/// `y = x + b` on every row, and then `+ a · w` on top: a projection into the residual
/// stream.
fn residual(y: &mut Vec<f32>, x: &[f32], b: &[f32], a: &[f32], w: &[f32]) {
    let c = b.len();
    y.clear();
    y.extend_from_slice(x);
    for row in y.chunks_exact_mut(c) {
        row.iter_mut().zip(b).for_each(|(y, b)| *y += b);
    }
    add_product(mat_mut(y, c), mat(a, w.len() / c), mat(w, c));
}

// ANCHOR: gelu
/// √(2/π), of GELU's tanh approximation.
const GELU_C: f32 = 0.797_884_6;

/// GELU of every element of `x`, as [`crate::layers::gelu`], into `y`, and each
/// element's `tanh u` into `tanh` for the backward. `tanh u = sign(u)·(1 − e)/(1 + e)`
/// with `e = e^(−2|u|)`, by step 02's SIMD `2^x`, whose argument is never above 0 here
/// (the standard library's `tanh`, one value at a time, took a third of a step). Near
/// `u = 0` the quotient loses digits of `tanh u` but not of `1 + tanh u`, which is what
/// GELU uses: its error stays that of a rounding of GELU's output.
fn gelu(x: &[f32], exp: Kernels, y: &mut Vec<f32>, tanh: &mut Vec<f32>) {
    tanh.clear();
    tanh.extend(
        x.iter()
            .map(|&x| -2.0 * (GELU_C * (x + 0.044715 * x * x * x)).abs()),
    );
    exp.exp2_shifted(tanh, 0.0, LOG2_E);
    for (t, &x) in tanh.iter_mut().zip(x) {
        *t = ((1.0 - *t) / (1.0 + *t)).copysign(x + 0.044715 * x * x * x);
    }
    y.clear();
    y.extend(
        x.iter()
            .zip(tanh.iter())
            .map(|(&x, &t)| 0.5 * x * (1.0 + t)),
    );
}

/// `dy ∘ gelu'(x)` in place, as [`crate::layers::gelu_grad`], from the forward's `tanh u`.
fn gelu_backward(dy: &mut [f32], x: &[f32], tanh: &[f32]) {
    for ((d, &x), &t) in dy.iter_mut().zip(x).zip(tanh) {
        let du = GELU_C * (1.0 + 3.0 * 0.044715 * x * x);
        *d *= 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du;
    }
}
// ANCHOR_END: gelu

/// `[B, heads, T, D]` into `out` from the `[B·T, width]` rows, a head's `D` columns at a
/// time: head `h` is columns `from + (h / group)·D ..` (with grouped heads, each key and
/// value head serves `group` query heads), as [`crate::layers::split_qkv`] and
/// [`crate::layers::repeat_kv`].
fn gather_heads(
    rows: &[f32],
    width: usize,
    from: usize,
    n: Dims,
    group: usize,
    out: &mut Vec<f32>,
) {
    let d = n.head_dim;
    out.clear();
    for b in 0..n.sequences {
        for h in 0..n.heads {
            let col = from + (h / group) * d;
            for t in 0..n.tokens {
                let start = (b * n.tokens + t) * width + col;
                out.extend_from_slice(&rows[start..start + d]);
            }
        }
    }
}

/// The adjoint of [`gather_heads`]: `[B, heads, T, D]` added into the columns it was
/// gathered from, the `group` heads that share a column summed there.
fn scatter_heads(
    x: &[f32],
    rows: &mut [f32],
    width: usize,
    from: usize,
    n: Dims,
    group: usize,
) {
    let d = n.head_dim;
    for (i, head_row) in x.chunks_exact(d).enumerate() {
        let (t, bh) = (i % n.tokens, i / n.tokens);
        let (b, h) = (bh / n.heads, bh % n.heads);
        let start = (b * n.tokens + t) * width + from + (h / group) * d;
        rows[start..start + d]
            .iter_mut()
            .zip(head_row)
            .for_each(|(r, x)| *r += x);
    }
}

fn view4(x: &[f32], n: Dims) -> ArrayView4<'_, f32> {
    ArrayView4::from_shape(n.heads_shape(), x).expect("B·H·T·D values")
}

/// A weight's numbers: every array of a [`Params`] is made by `Params::zeros`, in standard
/// layout.
fn slice<D: ndarray::Dimension>(a: &ndarray::Array<f32, D>) -> &[f32] {
    a.as_slice().expect("a weight in standard layout")
}

fn slice_mut<D: ndarray::Dimension>(a: &mut ndarray::Array<f32, D>) -> &mut [f32] {
    a.as_slice_mut().expect("a weight in standard layout")
}

/// A shard's forward over `inputs` (`[sequences, tokens]`, checked), into its workspace,
/// ending with the logits.
fn forward(
    p: &Params<f32>,
    inputs: ArrayView2<u8>,
    mask: Option<&Mask>, // [step 09]
    exp: Kernels,
    ws: &mut Workspace,
) -> Result<Dims, TrainError> {
    let (sequences, tokens) = inputs.dim();
    let n = Dims::new(&p.config, sequences, tokens);
    let (c, kv) = (n.c, n.kv_heads * n.head_dim);
    let group = n.heads / n.kv_heads;
    let (wte, wpe) = (slice(&p.wte), slice(&p.wpe));
    // x[b·T + t] = wte[token] + wpe[t]: the first block's input
    let x = zeros(&mut ws.blocks[0].x, n.rows * c);
    for ((b, t), &tok) in inputs.indexed_iter() {
        let row = &mut x[(b * tokens + t) * c..][..c];
        let (e, pos) = (&wte[tok as usize * c..][..c], &wpe[t * c..][..c]);
        for j in 0..c {
            row[j] = e[j] + pos[j];
        }
    }
    for l in 0..p.blocks.len() {
        let w = &p.blocks[l];
        let a = &mut ws.blocks[l];
        layernorm(&a.x, slice(&w.ln_1_w), slice(&w.ln_1_b), &mut a.ln_1);
        let mut qkv = std::mem::take(&mut a.att_rows); // a buffer for the moment
        let qkv_rows = rows_of(&mut qkv, slice(&w.attn_b), n.rows);
        add_product(
            mat_mut(qkv_rows, n.qkv),
            mat(&a.ln_1.out, c),
            mat(slice(&w.attn_w), n.qkv),
        );
        gather_heads(&qkv, n.qkv, 0, n, 1, &mut a.q);
        gather_heads(&qkv, n.qkv, c, n, group, &mut a.k);
        gather_heads(&qkv, n.qkv, c + kv, n, group, &mut a.v);
        let att = f32::attention(
            view4(&a.q, n),
            view4(&a.k, n),
            view4(&a.v, n),
            mask, // [step 09]
        )?;
        let out = att.out.as_slice().expect("a new array, in standard layout");
        a.att_rows = qkv;
        scatter_heads(out, zeros(&mut a.att_rows, n.rows * c), c, 0, n, 1);
        a.att = Some(att);
        residual(
            &mut a.x_mid,
            &a.x,
            slice(&w.proj_b),
            &a.att_rows,
            slice(&w.proj_w),
        );
        layernorm(&a.x_mid, slice(&w.ln_2_w), slice(&w.ln_2_b), &mut a.ln_2);
        let fc = rows_of(&mut a.fc, slice(&w.fc_b), n.rows);
        add_product(
            mat_mut(fc, 4 * c),
            mat(&a.ln_2.out, c),
            mat(slice(&w.fc_w), 4 * c),
        );
        gelu(&a.fc, exp, &mut a.fc_gelu, &mut a.fc_tanh);
        // the block's output: the next block's input, or the last LayerNorm's
        let mut next = match ws.blocks.get_mut(l + 1) {
            Some(b) => std::mem::take(&mut b.x),
            None => std::mem::take(&mut ws.x_final),
        };
        let a = &ws.blocks[l];
        residual(
            &mut next,
            &a.x_mid,
            slice(&w.fc_proj_b),
            &a.fc_gelu,
            slice(&w.fc_proj_w),
        );
        match ws.blocks.get_mut(l + 1) {
            Some(b) => b.x = next,
            None => ws.x_final = next,
        }
    }
    layernorm(
        &ws.x_final,
        slice(&p.ln_f_w),
        slice(&p.ln_f_b),
        &mut ws.ln_f,
    );
    // the output layer is the token embedding, transposed
    let logits = sized(&mut ws.logits, n.rows * n.vocab);
    set_product(
        mat_mut(logits, n.vocab),
        mat(&ws.ln_f.out, c),
        mat(wte, c).transpose(),
    );
    Ok(n)
}

/// The softmax of each row of logits, its cross-entropy against the target, and, with
/// `grad`, the gradient with respect to the logits in their place: `(p − onehot(target)) /
/// batch_rows`, where `batch_rows` counts the rows of the whole batch, every shard's. One
/// pass over a row; returns the sum of the rows' `−ln p[target]`. `e^(x − max)` is step
/// 02's `2^x`, whose argument is never above 0.
fn cross_entropy(
    logits: &mut [f32],
    targets: ArrayView2<u8>,
    vocab: usize,
    batch_rows: usize,
    grad: bool,
    exp: Kernels,
) -> f64 {
    let mut sum = 0.0;
    for (row, &t) in logits.chunks_exact_mut(vocab).zip(targets.iter()) {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        exp.exp2_shifted(row, max, LOG2_E);
        let total: f32 = row.iter().sum();
        sum -= (row[t as usize] / total).ln() as f64;
        if grad {
            let scale = 1.0 / (total * batch_rows as f32);
            row.iter_mut().for_each(|x| *x *= scale);
            row[t as usize] -= 1.0 / batch_rows as f32;
        }
    }
    sum
}

/// A shard's gradients into `ws.grads` (set to zero first), from its forward and the
/// gradient of its logits (in `ws.logits`).
fn backward(
    p: &Params<f32>,
    n: Dims,
    inputs: ArrayView2<u8>,
    mask: Option<&Mask>, // [step 09]
    ws: &mut Workspace,
) -> Result<(), TrainError> {
    let c = n.c;
    let g = &mut ws.grads;
    for (_, mut t) in g.tensors_mut() {
        t.fill(0.0);
    }
    let d = &mut ws.d;
    let dlogits = &ws.logits;
    // logits = h · wteᵀ: dwte += dlogitsᵀ · h, dh = dlogits · wte
    add_product(
        mat_mut(slice_mut(&mut g.wte), c),
        mat(dlogits, n.vocab).transpose(),
        mat(&ws.ln_f.out, c),
    );
    let dln_f = sized(&mut d.d_rows, n.rows * c);
    set_product(
        mat_mut(dln_f, c),
        mat(dlogits, n.vocab),
        mat(slice(&p.wte), c),
    );
    let dx = zeros(&mut d.dx, n.rows * c);
    layernorm_backward(
        &d.d_rows,
        &ws.x_final,
        slice(&p.ln_f_w),
        &ws.ln_f,
        dx,
        slice_mut(&mut g.ln_f_w),
        slice_mut(&mut g.ln_f_b),
    );
    for ((w, a), gw) in p.blocks.iter().zip(&ws.blocks).zip(&mut g.blocks).rev() {
        mlp_backward(w, a, gw, n, d);
        projection_backward(w, a, gw, n, d);
        let att = a.att.as_ref().expect("the forward's attention, kept");
        let dqkv = f32::attention_backward(
            view4(&a.q, n),
            view4(&a.k, n),
            view4(&a.v, n),
            att,
            view4(&d.d_heads, n),
            mask, // [step 09]
        )?;
        qkv_backward(w, a, gw, n, dqkv, d);
    }
    // x[b·T + t] = wte[token] + wpe[t]
    let dx = &d.dx;
    let (dwte, dwpe) = (slice_mut(&mut g.wte), slice_mut(&mut g.wpe));
    for ((b, t), &tok) in inputs.indexed_iter() {
        let row = &dx[(b * n.tokens + t) * c..][..c];
        let e = &mut dwte[tok as usize * c..][..c];
        e.iter_mut().zip(row).for_each(|(e, d)| *e += d);
        let pos = &mut dwpe[t * c..][..c];
        pos.iter_mut().zip(row).for_each(|(p, d)| *p += d);
    }
    Ok(())
}

/// A block's MLP half, from `dx`, the gradient of the block's output: the residual passes
/// it straight through to x_mid, and the MLP adds its own share.
fn mlp_backward(
    w: &Block<f32>,
    a: &BlockActs,
    gw: &mut Block<f32>,
    n: Dims,
    d: &mut ActGrads,
) {
    let c = n.c;
    let dx = &mut d.dx;
    add_product(
        mat_mut(slice_mut(&mut gw.fc_proj_w), c),
        mat(&a.fc_gelu, 4 * c).transpose(),
        mat(dx, c),
    );
    add_column_sums(slice_mut(&mut gw.fc_proj_b), dx);
    let dfc = sized(&mut d.d_fc, n.rows * 4 * c);
    set_product(
        mat_mut(dfc, 4 * c),
        mat(dx, c),
        mat(slice(&w.fc_proj_w), c).transpose(),
    );
    gelu_backward(dfc, &a.fc, &a.fc_tanh);
    add_product(
        mat_mut(slice_mut(&mut gw.fc_w), 4 * c),
        mat(&a.ln_2.out, c).transpose(),
        mat(dfc, 4 * c),
    );
    add_column_sums(slice_mut(&mut gw.fc_b), dfc);
    let dln_2 = sized(&mut d.d_rows, n.rows * c);
    set_product(
        mat_mut(dln_2, c),
        mat(dfc, 4 * c),
        mat(slice(&w.fc_w), 4 * c).transpose(),
    );
    layernorm_backward(
        dln_2,
        &a.x_mid,
        slice(&w.ln_2_w),
        &a.ln_2,
        dx,
        slice_mut(&mut gw.ln_2_w),
        slice_mut(&mut gw.ln_2_b),
    );
}

/// The attention's half, the same way: the residual, then the projection, its gradient
/// into `d_heads` for the attention's backward.
fn projection_backward(
    w: &Block<f32>,
    a: &BlockActs,
    gw: &mut Block<f32>,
    n: Dims,
    d: &mut ActGrads,
) {
    let c = n.c;
    let dx = &d.dx;
    add_product(
        mat_mut(slice_mut(&mut gw.proj_w), c),
        mat(&a.att_rows, c).transpose(),
        mat(dx, c),
    );
    add_column_sums(slice_mut(&mut gw.proj_b), dx);
    let datt_rows = sized(&mut d.d_rows, n.rows * c);
    set_product(
        mat_mut(datt_rows, c),
        mat(dx, c),
        mat(slice(&w.proj_w), c).transpose(),
    );
    gather_heads(datt_rows, c, 0, n, 1, &mut d.d_heads);
}

/// From the attention's `[dq, dk, dv]`: the fused projection's gradients and the first
/// LayerNorm's, whose input gradient `dx` is the block before's output gradient.
fn qkv_backward(
    w: &Block<f32>,
    a: &BlockActs,
    gw: &mut Block<f32>,
    n: Dims,
    [dq, dk, dv]: [Array4<f32>; 3],
    d: &mut ActGrads,
) {
    let (c, kv) = (n.c, n.kv_heads * n.head_dim);
    let group = n.heads / n.kv_heads;
    let dqkv = zeros(&mut d.d_qkv, n.rows * n.qkv);
    for (grad, from, group) in [(&dq, 0, 1), (&dk, c, group), (&dv, c + kv, group)] {
        let grad = grad.as_slice().expect("a new array, in standard layout");
        scatter_heads(grad, dqkv, n.qkv, from, n, group);
    }
    add_product(
        mat_mut(slice_mut(&mut gw.attn_w), n.qkv),
        mat(&a.ln_1.out, c).transpose(),
        mat(dqkv, n.qkv),
    );
    add_column_sums(slice_mut(&mut gw.attn_b), dqkv);
    let dln_1 = sized(&mut d.d_rows, n.rows * c);
    set_product(
        mat_mut(dln_1, c),
        mat(dqkv, n.qkv),
        mat(slice(&w.attn_w), n.qkv).transpose(),
    );
    layernorm_backward(
        dln_1,
        &a.x,
        slice(&w.ln_1_w),
        &a.ln_1,
        &mut d.dx,
        slice_mut(&mut gw.ln_1_w),
        slice_mut(&mut gw.ln_1_b),
    );
}

/// The batch's sequences in `shards` runs, as even as they can be: `from..to` of each.
fn runs(sequences: usize, shards: usize) -> Vec<(usize, usize)> {
    let shards = shards.clamp(1, sequences.max(1));
    (0..shards)
        .map(|s| (s * sequences / shards, (s + 1) * sequences / shards))
        .collect()
}

/// A workspace per thread, made on first use.
fn workspaces(config: Config, spaces: &mut Vec<Workspace>) -> &mut [Workspace] {
    let threads = rayon::current_num_threads();
    if spaces.len() != threads || spaces[0].grads.config != config {
        *spaces = (0..threads).map(|_| Workspace::new(config)).collect();
    }
    spaces
}

// ANCHOR: shards
/// The summed cross-entropy of each shard of the batch, a run of sequences per thread, in
/// shard order; with `grads`, each shard's gradients too, in its workspace. `spaces`
/// keeps the shards' buffers for the next call.
fn shards<'s>(
    p: &Params<f32>,
    inputs: ArrayView2<u8>,
    targets: ArrayView2<u8>,
    packed_documents: Option<&Documents>, // [step 09]
    spaces: &'s mut Vec<Workspace>,
    grads: bool,
) -> Result<(Vec<f64>, &'s mut [Workspace]), TrainError> {
    check_inputs(&p.config, inputs)?;
    let exp = Kernels::new(Isa::detect())?;
    let batch_rows = inputs.len();
    let spaces = workspaces(p.config, spaces);
    let runs = runs(inputs.nrows(), spaces.len());
    let sums = runs
        .par_iter()
        .zip(spaces.par_iter_mut())
        .map(|(&(from, to), ws)| {
            let inputs = inputs.slice_axis(Axis(0), (from..to).into());
            let targets = targets.slice_axis(Axis(0), (from..to).into());
            let mask = packed_documents.map(|d| shard_mask(d, from, to)); // [step 09]
            let n = forward(
                p,
                inputs,
                mask.as_ref(), // [step 09]
                exp,
                ws,
            )?;
            let sum =
                cross_entropy(&mut ws.logits, targets, n.vocab, batch_rows, grads, exp);
            if grads {
                backward(
                    p,
                    n,
                    inputs,
                    mask.as_ref(), // [step 09]
                    ws,
                )?;
            }
            Ok(sum)
        })
        .collect::<Result<Vec<f64>, TrainError>>()?;
    let used = runs.len();
    Ok((sums, &mut spaces[..used]))
}
// [step 09]

/// The document mask of sequences `from..to` of a batch packed as `documents`: a shard's
/// rows of its ids.
fn shard_mask(documents: &Documents, from: usize, to: usize) -> Mask {
    if documents.rows() == 1 {
        // every sequence packed alike
        return Mask::Documents(documents.clone());
    }
    let t = documents.tokens();
    let ids = documents.ids()[from * t..to * t].to_vec();
    Mask::Documents(Documents::from_ids(to - from, t, ids).expect("rows of a valid table"))
}
// [/step 09]

/// The mean cross-entropy of the batch and its gradient with respect to every weight:
/// the readable model's [`crate::forward`], [`crate::loss`] and [`crate::backward`] in one
/// call, a shard of sequences per thread, the shards' gradients added in shard order.
/// `spaces` keeps the shards' buffers for the next call.
pub fn loss_and_grads(
    p: &Params<f32>,
    inputs: ArrayView2<u8>,
    targets: ArrayView2<u8>,
    spaces: &mut Vec<Workspace>,
) -> Result<(f32, Params<f32>), TrainError> {
    // [step 09]
    loss_and_grads_documents(p, inputs, targets, None, spaces)
}

/// [`loss_and_grads`] with documents packed in each sequence (`train --documents`): each
/// token attends to the earlier tokens of its own document only (`None`: causal).
pub fn loss_and_grads_documents(
    p: &Params<f32>,
    inputs: ArrayView2<u8>,
    targets: ArrayView2<u8>,
    packed_documents: Option<&Documents>,
    spaces: &mut Vec<Workspace>,
) -> Result<(f32, Params<f32>), TrainError> {
    // [/step 09]
    let (sums, shards) = shards(
        p,
        inputs,
        targets,
        packed_documents, // [step 09]
        spaces,
        true,
    )?;
    let mut grads = shards[0].grads.clone();
    for ws in &shards[1..] {
        let parts = grads.tensors_mut().into_iter().zip(ws.grads.tensors());
        for ((_, mut total), (_, part)) in parts {
            total += &part;
        }
    }
    Ok((
        (sums.iter().sum::<f64>() / inputs.len() as f64) as f32,
        grads,
    ))
}
// ANCHOR_END: shards

/// The mean cross-entropy of the batch, without its gradients.
pub fn batch_loss(
    p: &Params<f32>,
    inputs: ArrayView2<u8>,
    targets: ArrayView2<u8>,
    spaces: &mut Vec<Workspace>,
) -> Result<f32, TrainError> {
    // [step 09]
    batch_loss_documents(p, inputs, targets, None, spaces)
}

/// [`batch_loss`] with documents packed in each sequence, as [`loss_and_grads_documents`].
pub fn batch_loss_documents(
    p: &Params<f32>,
    inputs: ArrayView2<u8>,
    targets: ArrayView2<u8>,
    packed_documents: Option<&Documents>,
    spaces: &mut Vec<Workspace>,
) -> Result<f32, TrainError> {
    // [/step 09]
    let (sums, _) = shards(
        p,
        inputs,
        targets,
        packed_documents, // [step 09]
        spaces,
        false,
    )?;
    Ok((sums.iter().sum::<f64>() / inputs.len() as f64) as f32)
}

/// A [`Trainer`] trained by the fast path: its weights, optimizer and step, updated in
/// place, so that what is saved afterwards is the trainer's.
pub struct FastCpu<'a> {
    pub trainer: &'a mut Trainer,
    spaces: Vec<Workspace>,
}

impl<'a> FastCpu<'a> {
    pub fn new(trainer: &'a mut Trainer) -> FastCpu<'a> {
        FastCpu {
            trainer,
            spaces: Vec::new(),
        }
    }
}

impl Learner for FastCpu<'_> {
    fn config(&self) -> Config {
        self.trainer.params.config
    }

    fn steps_done(&self) -> usize {
        self.trainer.step
    }

    fn params_count(&self) -> usize {
        self.trainer.params.count()
    }

    /// [`Trainer::train_step`] with [`loss_and_grads`] for its forward and backward: the
    /// same batch, clipping, schedule and AdamW.
    fn train_step(
        &mut self,
        corpus: &Corpus,
        settings: &Settings,
    ) -> Result<StepRecord, TrainError> {
        let t = &mut *self.trainer;
        let started = Instant::now();
        let Batch {
            inputs,
            targets,
            .. // [step 09]
        } = train_batch(
            &corpus.train,
            settings.batch,
            settings.seq_len,
            settings.seed,
            t.step,
        );
        // [step 09]
        // --documents: the same windows, each token blind to the files before its own
        let (batch, tokens, seed) = (settings.batch, settings.seq_len, settings.seed);
        let documents = settings
            .documents
            .then(|| corpus.train_documents(batch, tokens, seed, t.step));
        let loss_and_grads = |p, inputs, targets, spaces| {
            loss_and_grads_documents(p, inputs, targets, documents.as_ref(), spaces)
        };
        // [/step 09]
        let (loss, mut grads) =
            loss_and_grads(&t.params, inputs.view(), targets.view(), &mut self.spaces)?;
        let grad_norm = clip_grad_norm(&mut grads, settings.clip);
        let lr = settings.schedule.lr(t.step);
        t.opt.step(&mut t.params, &grads, lr);
        t.step += 1;
        let seconds = started.elapsed().as_secs_f64();
        Ok(StepRecord::timed(
            t.step,
            loss,
            lr,
            grad_norm,
            seconds,
            settings.batch * settings.seq_len,
        ))
    }

    fn heldout_loss(&mut self, batches: &[Batch]) -> Result<f32, TrainError> {
        let mut sum = 0.0;
        for b in batches {
            let p = &self.trainer.params;
            // [step 09]
            let batch_loss = |p, inputs, targets, spaces| {
                batch_loss_documents(p, inputs, targets, b.documents.as_ref(), spaces)
            };
            // [/step 09]
            sum +=
                batch_loss(p, b.inputs.view(), b.targets.view(), &mut self.spaces)? as f64;
        }
        Ok((sum / batches.len() as f64) as f32)
    }

    fn hardware(&self) -> Hardware {
        Learner::hardware(&*self.trainer)
    }

    fn trainer(&self) -> &'static str {
        "step05-train-fast"
    }

    fn checkpoint(&self) -> Result<crate::Checkpoint, TrainError> {
        self.trainer.checkpoint()
    }
    // [step 09]

    fn packs_documents(&self) -> bool {
        true
    }
    // [/step 09]
}
