//! The model's layers, each a forward and its backward by hand, generic over the float
//! type.
//!
//! The model trains in `f32`, on our kernels. The same code in `f64` is what its gradients
//! are checked against: finite differences of an `f64` loss are accurate to about eight
//! digits, those of an `f32` loss to about two (`tests/gradients.rs`). Only attention
//! differs between the two: in `f32` it is step 02's online-softmax forward and step 04's
//! blockwise backward, in `f64` the references those two are themselves checked against.
//!
//! Every backward *adds* into the gradients it is given (`+=`), as the chain rule sums over
//! every path: the residual stream's gradient reaches a block's input both directly and
//! through the block.

use flash_core::reference::{Reference, attention_f64};
use flash_core::{Attention, AttnError};
use ndarray::linalg::general_mat_mul;
use ndarray::{
    Array1, Array2, Array4, ArrayView1, ArrayView2, ArrayView4, ArrayViewMut1,
    ArrayViewMut2, Axis, NdFloat, Zip, s,
};
use step09_masks::{Mask, ScoreMod}; // [step 09]

// ANCHOR: float
/// The float type a model runs in: `f32` to train, `f64` to check the gradients.
pub trait Float: NdFloat {
    /// What the attention forward keeps for its backward: the output and each row's
    /// natural-log log-sum-exp.
    type Saved: Send + Sync;

    /// A constant of the formulas, in this type.
    fn of(x: f64) -> Self;

    /// Causal attention on `[batch, heads, tokens, head_dim]`, scaled by `1/√head_dim`.
    // [step 09]
    /// With `mask` (step 09's), the keys it allows instead: `train --documents` gives a
    /// document mask, causal within each file and blind across files.
    // [/step 09]
    fn attention(
        q: ArrayView4<Self>,
        k: ArrayView4<Self>,
        v: ArrayView4<Self>,
        mask: Option<&Mask>, // [step 09]
    ) -> Result<Self::Saved, AttnError>;

    /// The output of a forward.
    fn attention_out(saved: &Self::Saved) -> ArrayView4<'_, Self>;

    /// dq, dk and dv, given the forward's result and the gradient of its output.
    fn attention_backward(
        q: ArrayView4<Self>,
        k: ArrayView4<Self>,
        v: ArrayView4<Self>,
        saved: &Self::Saved,
        dout: ArrayView4<Self>,
        mask: Option<&Mask>, // [step 09]
    ) -> Result<[Array4<Self>; 3], AttnError>;
}

impl Float for f32 {
    type Saved = Attention;

    fn of(x: f64) -> f32 {
        x as f32
    }

    /// Step 02's online softmax: no T×T table, and the log-sum-exp the backward needs.
    fn attention(
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        mask: Option<&Mask>, // [step 09]
    ) -> Result<Attention, AttnError> {
        // [step 09]
        // step 09's online softmax over the block mask's tiles, where a tile of two files is
        // never read; a batch of windows that each lie inside one file is causal attention,
        // step 02's (the backward decides alike)
        if let Some(mask) = mask.filter(|m| !is_causal(m)) {
            return step09_masks::forward(q, k, v, mask, &ScoreMod::None);
        }
        // [/step 09]
        step02_online_softmax::attention(q, k, v)
    }

    fn attention_out(saved: &Attention) -> ArrayView4<'_, f32> {
        saved.out.view()
    }

    /// Step 04's blockwise backward: the probabilities rebuilt from the log-sum-exp.
    fn attention_backward(
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        saved: &Attention,
        dout: ArrayView4<f32>,
        mask: Option<&Mask>, // [step 09]
    ) -> Result<[Array4<f32>; 3], AttnError> {
        // [step 09]
        if let Some(mask) = mask.filter(|m| !is_causal(m)) {
            let g = step09_masks::backward(q, k, v, saved, dout, mask, &ScoreMod::None)?;
            return Ok([g.dq, g.dk, g.dv]);
        }
        // [/step 09]
        let g = step04_backward::backward(q, k, v, saved, dout)?;
        Ok([g.dq, g.dk, g.dv])
    }
}
// ANCHOR_END: float
// [step 09]

/// Whether `mask` is plain causal attention over each whole sequence: the causal mask, or
/// documents of which each sequence holds one (ids never go down, so its first and last are
/// the same).
fn is_causal(mask: &Mask) -> bool {
    match mask {
        Mask::Documents(docs) => docs
            .ids()
            .chunks(docs.tokens().max(1))
            .all(|row| row.first() == row.last()),
        mask => mask.is_causal(),
    }
}
// [/step 09]

impl Float for f64 {
    type Saved = Reference;

    fn of(x: f64) -> f64 {
        x
    }

    /// The `f64` reference every forward of the repository is checked against.
    fn attention(
        q: ArrayView4<f64>,
        k: ArrayView4<f64>,
        v: ArrayView4<f64>,
        mask: Option<&Mask>, // [step 09]
    ) -> Result<Reference, AttnError> {
        // [step 09]
        // step 09's reference, the one its masked kernels are checked against
        if let Some(mask) = mask {
            let r = step09_masks::reference::attention_f64(q, k, v, mask, &ScoreMod::None)?;
            return Ok(Reference {
                out: r.out,
                lse: r.lse,
            });
        }
        // [/step 09]
        attention_f64(q, k, v)
    }

    fn attention_out(saved: &Reference) -> ArrayView4<'_, f64> {
        saved.out.view()
    }

    /// Step 04's `f64` backward through the whole table of probabilities.
    fn attention_backward(
        q: ArrayView4<f64>,
        k: ArrayView4<f64>,
        v: ArrayView4<f64>,
        _saved: &Reference,
        dout: ArrayView4<f64>,
        mask: Option<&Mask>, // [step 09]
    ) -> Result<[Array4<f64>; 3], AttnError> {
        // [step 09]
        if let Some(mask) = mask {
            let g = step09_masks::reference::backward_f64(
                q,
                k,
                v,
                dout,
                mask,
                &ScoreMod::None,
            )?;
            return Ok([g.dq, g.dk, g.dv]);
        }
        // [/step 09]
        let g = step04_backward::reference::backward_f64(q, k, v, dout)?;
        Ok([g.dq, g.dk, g.dv])
    }
}

/// Added to the variance before its square root, as in GPT-2.
pub const LAYERNORM_EPS: f64 = 1e-5;

/// What a LayerNorm keeps for its backward: each row's mean and `1/σ`.
#[derive(Clone, Debug)]
pub struct Norm<A> {
    pub out: Array2<A>,
    pub mean: Array1<A>,
    pub rstd: Array1<A>,
}

// ANCHOR: layernorm
/// LayerNorm of each row of `x` (`[rows, d]`): `y = (x − μ)/σ · w + b`, with
/// `σ = √(var + ε)` and the variance biased (divided by `d`), as in GPT-2.
pub fn layernorm<A: Float>(
    x: ArrayView2<A>,
    w: ArrayView1<A>,
    b: ArrayView1<A>,
) -> Norm<A> {
    let (rows, d) = x.dim();
    let n = A::of(d as f64);
    let mut out = Array2::zeros((rows, d));
    let mut mean = Array1::zeros(rows);
    let mut rstd = Array1::zeros(rows);
    for (i, row) in x.rows().into_iter().enumerate() {
        let m = row.sum() / n;
        let var = row.fold(A::zero(), |acc, &v| acc + (v - m) * (v - m)) / n;
        let r = A::one() / (var + A::of(LAYERNORM_EPS)).sqrt();
        Zip::from(out.row_mut(i))
            .and(row)
            .and(w)
            .and(b)
            .for_each(|y, &x, &w, &b| *y = (x - m) * r * w + b);
        mean[i] = m;
        rstd[i] = r;
    }
    Norm { out, mean, rstd }
}

/// The gradients of a LayerNorm, added into `dx`, `dw` and `db`. With `n̂ = (x − μ)/σ` and
/// `g = dy ∘ w`: `dx = (g − mean(g) − n̂ · mean(g ∘ n̂)) / σ`, `dw = Σ_rows dy ∘ n̂`,
/// `db = Σ_rows dy`.
pub fn layernorm_backward<A: Float>(
    dy: ArrayView2<A>,
    x: ArrayView2<A>,
    w: ArrayView1<A>,
    norm: &Norm<A>,
    mut dx: ArrayViewMut2<A>,
    mut dw: ArrayViewMut1<A>,
    mut db: ArrayViewMut1<A>,
) {
    let d = x.ncols();
    let n = A::of(d as f64);
    let mut xhat = vec![A::zero(); d];
    let mut g = vec![A::zero(); d];
    for i in 0..x.nrows() {
        let (m, r) = (norm.mean[i], norm.rstd[i]);
        let (dy, x) = (dy.row(i), x.row(i));
        let (mut mean_g, mut mean_gx) = (A::zero(), A::zero());
        for j in 0..d {
            xhat[j] = (x[j] - m) * r;
            g[j] = dy[j] * w[j];
            mean_g += g[j];
            mean_gx += g[j] * xhat[j];
            dw[j] += dy[j] * xhat[j];
            db[j] += dy[j];
        }
        mean_g /= n;
        mean_gx /= n;
        let mut dx = dx.row_mut(i);
        for j in 0..d {
            dx[j] += (g[j] - mean_g - xhat[j] * mean_gx) * r;
        }
    }
}
// ANCHOR_END: layernorm

/// A fully connected layer on rows: `y = x · W + b`, `x` `[rows, in]`, `W` `[in, out]` (the
/// layout of GPT-2's `Conv1D` weights), `b` `[out]`.
pub fn linear<A: Float>(x: ArrayView2<A>, w: ArrayView2<A>, b: ArrayView1<A>) -> Array2<A> {
    let mut y = Array2::zeros((x.nrows(), w.ncols()));
    y += &b;
    general_mat_mul(A::one(), &x, &w, A::one(), &mut y);
    y
}

/// The gradients of [`linear`]: `dW += xᵀ · dy`, `db += Σ_rows dy`, and `dx += dy · Wᵀ`.
pub fn linear_backward<A: Float>(
    dy: ArrayView2<A>,
    x: ArrayView2<A>,
    w: ArrayView2<A>,
    dx: &mut ArrayViewMut2<A>,
    dw: &mut ArrayViewMut2<A>,
    mut db: ArrayViewMut1<A>,
) {
    general_mat_mul(A::one(), &x.t(), &dy, A::one(), dw);
    db += &dy.sum_axis(Axis(0));
    general_mat_mul(A::one(), &dy, &w.t(), A::one(), dx);
}

// ANCHOR: gelu
/// √(2/π), of the tanh approximation of GELU.
const GELU_C: f64 = 0.797_884_560_802_865_4;

/// GELU in the tanh approximation GPT-2 uses (Hendrycks & Gimpel 2016, eq. 2):
/// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
pub fn gelu<A: Float>(x: A) -> A {
    let u = A::of(GELU_C) * (x + A::of(0.044715) * x * x * x);
    A::of(0.5) * x * (A::one() + u.tanh())
}

/// The derivative of [`gelu`]: `0.5·(1 + tanh u) + 0.5·x·(1 − tanh² u)·√(2/π)·(1 +
/// 3·0.044715·x²)`.
pub fn gelu_grad<A: Float>(x: A) -> A {
    let u = A::of(GELU_C) * (x + A::of(0.044715) * x * x * x);
    let t = u.tanh();
    let du = A::of(GELU_C) * (A::one() + A::of(3.0 * 0.044715) * x * x);
    A::of(0.5) * (A::one() + t) + A::of(0.5) * x * (A::one() - t * t) * du
}
// ANCHOR_END: gelu

/// Softmax over each row of `logits` (`[rows, vocab]`), in place: the probabilities.
pub fn softmax_rows<A: Float>(logits: &mut Array2<A>) {
    for mut row in logits.rows_mut() {
        let max = row.fold(A::neg_infinity(), |m, &x| m.max(x));
        row.mapv_inplace(|x| (x - max).exp());
        let sum = row.sum();
        row.mapv_inplace(|x| x / sum);
    }
}

/// The mean over rows of `−ln p[target]`: the loss the model minimises, in nats per token.
pub fn cross_entropy<A: Float>(probs: ArrayView2<A>, targets: &[u8]) -> A {
    let sum = targets
        .iter()
        .enumerate()
        .fold(A::zero(), |acc, (i, &t)| acc - probs[[i, t as usize]].ln());
    sum / A::of(targets.len() as f64)
}

/// The gradient of [`cross_entropy`] with respect to the logits: `(p − onehot(target)) /
/// rows`, the softmax and the logarithm differentiated together.
pub fn cross_entropy_backward<A: Float>(probs: ArrayView2<A>, targets: &[u8]) -> Array2<A> {
    let n = A::of(targets.len() as f64);
    let mut d = probs.to_owned();
    for (i, &t) in targets.iter().enumerate() {
        d[[i, t as usize]] -= A::one();
    }
    d.mapv_inplace(|x| x / n);
    d
}

// ANCHOR: heads
/// `[batch·tokens, heads·head_dim]`, one row per token with its heads side by side (what a
/// projection gives), to `[batch, heads, tokens, head_dim]`, the layout our kernels take:
/// `out[b, h, t, d] = x[b·T + t, h·D + d]`.
pub fn to_heads<A: Float>(x: ArrayView2<A>, batch: usize, heads: usize) -> Array4<A> {
    let (rows, width) = x.dim();
    let (tokens, head_dim) = (rows / batch, width / heads);
    let x = x
        .into_shape_with_order((batch, tokens, heads, head_dim))
        .expect("a standard-layout [batch·tokens, heads·head_dim] array");
    x.permuted_axes([0, 2, 1, 3])
        .as_standard_layout()
        .into_owned()
}

/// The inverse of [`to_heads`]: `[batch, heads, tokens, head_dim]` back to one row per
/// token.
pub fn from_heads<A: Float>(x: ArrayView4<A>) -> Array2<A> {
    let (batch, heads, tokens, head_dim) = x.dim();
    let x = x
        .permuted_axes([0, 2, 1, 3])
        .as_standard_layout()
        .into_owned();
    x.into_shape_with_order((batch * tokens, heads * head_dim))
        .expect("a standard-layout array")
}

/// q, k and v from the fused projection's output, a row per token: its columns are q's
/// heads, then k's, then v's (GPT-2's `c_attn`), all of one head dim.
pub fn split_qkv<A: Float>(
    qkv: ArrayView2<A>,
    batch: usize,
    heads: usize,
    kv_heads: usize, // [step 08]
) -> [Array4<A>; 3] {
    let heads_of = [heads; 3];
    let heads_of = [heads_of[0], kv_heads, kv_heads]; // [step 08]
    let head_dim = qkv.ncols() / heads_of.iter().sum::<usize>();
    let mut start = 0;
    heads_of.map(|h| {
        let cols = qkv.slice(s![.., start..start + h * head_dim]);
        start += h * head_dim;
        to_heads(cols.as_standard_layout().view(), batch, h)
    })
}

/// The adjoint of [`split_qkv`]: dq, dk and dv back to the fused projection's columns.
pub fn join_qkv<A: Float>(
    dq: ArrayView4<A>,
    dk: ArrayView4<A>,
    dv: ArrayView4<A>,
) -> Array2<A> {
    let parts = [from_heads(dq), from_heads(dk), from_heads(dv)];
    ndarray::concatenate(
        Axis(1),
        &[parts[0].view(), parts[1].view(), parts[2].view()],
    )
    .expect("one row per token in each")
}
// [step 08]

// ANCHOR: repeat_kv
/// Grouped-query attention on the CPU, as most models implement it: each of k's and v's
/// heads repeated `groups` times, `[B, H/g, T, D]` to `[B, H, T, D]`, so that query head
/// `h` meets key head `h / groups`; then plain attention.
pub fn repeat_kv<A: Float>(x: Array4<A>, groups: usize) -> Array4<A> {
    if groups == 1 {
        return x;
    }
    let (batch, kv_heads, tokens, head_dim) = x.dim();
    Array4::from_shape_fn(
        (batch, kv_heads * groups, tokens, head_dim),
        |(b, h, t, d)| x[[b, h / groups, t, d]],
    )
}

/// The adjoint of [`repeat_kv`]: a kv head's gradient is the sum of its `groups` copies'.
pub fn sum_groups<A: Float>(dx: Array4<A>, groups: usize) -> Array4<A> {
    if groups == 1 {
        return dx;
    }
    let (batch, heads, tokens, head_dim) = dx.dim();
    let mut out = Array4::zeros((batch, heads / groups, tokens, head_dim));
    for (h, head) in dx.axis_iter(Axis(1)).enumerate() {
        let mut sum = out.index_axis_mut(Axis(1), h / groups);
        sum += &head;
    }
    out
}
// ANCHOR_END: repeat_kv
// [/step 08]
// ANCHOR_END: heads
