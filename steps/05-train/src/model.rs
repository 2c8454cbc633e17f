//! The model: a GPT-2-style decoder over bytes, its forward with what the backward needs
//! kept, and its backward by hand.
//!
//! With `B` sequences of `T` tokens, `C = d_model`, `H` heads of `D = C/H`, a block is
//!
//! ```text
//! x ─┬─ LayerNorm ─ x·W_qkv + b [B·T, 3C] ─ to heads: q, k, v [B, H, T, D] ─ attention ─┐
//!    │                                                                                  │
//!    │         out [B, H, T, D] ─ from heads [B·T, C] ─ x·W_proj + b ─────────────── (+) ─ x'
//! x' ─┬─ LayerNorm ─ x·W_fc + b [B·T, 4C] ─ GELU ─ x·W_fc_proj + b ─────────────── (+) ─
//! x''
//! ```
//!
//! after token and position embeddings, and followed by a final LayerNorm and the output
//! layer, whose weights are the token embedding's (tied, as in GPT-2).
// [step 08]
//!
//! With grouped heads (`kv_heads` < `H`), k and v have `kv_heads` heads each: the fused
//! product is `[B·T, C + 2·kv_heads·D]`, and each kv head is repeated for its group of
//! `H / kv_heads` query heads before attention.
// [/step 08]

use flash_core::inputs::SplitMix64;
use ndarray::{Array1, Array2, Array4, ArrayView2, ArrayViewD, ArrayViewMutD, Axis};
use serde::{Deserialize, Serialize};

use crate::TrainError;
use crate::layers::{
    Float, Norm, cross_entropy, cross_entropy_backward, from_heads, gelu, gelu_grad,
    join_qkv, layernorm, layernorm_backward, linear, linear_backward, softmax_rows,
    split_qkv, to_heads,
};
use crate::layers::{repeat_kv, sum_groups}; // [step 08]
use step09_masks::{Documents, Mask}; // [step 09]

/// The shape of a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "ConfigFields")] // [step 08]
pub struct Config {
    /// Transformer blocks.
    pub layers: usize,
    /// Width of the residual stream, `C`.
    pub d_model: usize,
    /// Attention heads; each has `d_model / heads` dimensions.
    pub heads: usize,
    // [step 08]
    /// Heads of keys and values, each shared by `heads / kv_heads` query heads
    /// (grouped-query attention): `heads` is plain multi-head attention, 1 multi-query.
    pub kv_heads: usize,
    // [/step 08]
    /// The most tokens the model sees at once: the rows of its position embedding.
    pub context: usize,
    /// Distinct tokens: 256 for bytes.
    pub vocab: usize,
}

// [step 08]
/// A [`Config`] as checkpoints and run records hold it; one written before grouped heads
/// has no `kv_heads`, and had as many as `heads`.
#[derive(Deserialize)]
struct ConfigFields {
    layers: usize,
    d_model: usize,
    heads: usize,
    kv_heads: Option<usize>,
    context: usize,
    vocab: usize,
}

impl From<ConfigFields> for Config {
    fn from(c: ConfigFields) -> Config {
        Config {
            layers: c.layers,
            d_model: c.d_model,
            heads: c.heads,
            kv_heads: c.kv_heads.unwrap_or(c.heads),
            context: c.context,
            vocab: c.vocab,
        }
    }
}
// [/step 08]

impl Config {
    /// Checks that the numbers make a model: every one at least 1, `d_model` a multiple of
    /// `heads`, and a vocabulary of bytes (at most 256).
    // [step 08]
    /// And `kv_heads` a divisor of `heads`.
    // [/step 08]
    pub fn check(&self) -> Result<(), TrainError> {
        let Config {
            layers,
            d_model,
            heads,
            kv_heads, // [step 08]
            context,
            vocab,
        } = *self;
        if layers == 0 || d_model == 0 || heads == 0 || context == 0 || vocab == 0 {
            return Err(TrainError::Config(format!(
                "{self:?}: layers, d_model, heads, context and vocab must each be at least 1"
            )));
        }
        if !d_model.is_multiple_of(heads) {
            return Err(TrainError::Config(format!(
                "d_model {d_model} is not a multiple of heads {heads}: each head takes d_model / heads dimensions"
            )));
        }
        if vocab > 256 {
            return Err(TrainError::Config(format!(
                "vocab {vocab}: the tokens are bytes, so at most 256"
            )));
        }
        // [step 08]
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(TrainError::Config(format!(
                "kv_heads {kv_heads} does not divide heads {heads}: each key and value head \
                 is shared by heads / kv_heads query heads; accepted for {heads} heads: {}",
                flash_core::check::divisors(heads)
            )));
        }
        // [/step 08]
        Ok(())
    }

    pub fn head_dim(&self) -> usize {
        self.d_model / self.heads
    }

    /// Columns of the fused q, k and v projection: q's heads, then k's, then v's.
    pub fn qkv_width(&self) -> usize {
        let kv_width = self.d_model;
        // [step 08]
        // k and v have kv_heads heads each, as wide as q's
        let kv_width = kv_width / self.heads * self.kv_heads;
        // [/step 08]
        self.d_model + 2 * kv_width
    }
}

/// A model's shape by name, as `--model` takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Preset {
    /// 4 layers, d_model 128, 4 heads, context 128: trains on a CPU in minutes
    Small,
    /// GPT-2 small's shape (12 layers, d_model 768, 12 heads) with a context of 2048 and
    /// the 256 bytes as its vocabulary: 86.8M parameters, for the GPU
    Gpt2,
}

impl Preset {
    pub const fn config(self) -> Config {
        match self {
            Preset::Small => Config {
                layers: 4,
                d_model: 128,
                heads: 4,
                kv_heads: 4, // [step 08]
                context: 128,
                vocab: 256,
            },
            Preset::Gpt2 => Config {
                layers: 12,
                d_model: 768,
                heads: 12,
                kv_heads: 12, // [step 08]
                context: 2048,
                vocab: 256,
            },
        }
    }
}

/// One transformer block's weights, named as in GPT-2 (Hugging Face's `GPT2Model`), with
/// matrices `[in, out]` as its `Conv1D` keeps them.
#[derive(Clone, Debug, PartialEq)]
pub struct Block<A> {
    pub ln_1_w: Array1<A>,
    pub ln_1_b: Array1<A>,
    /// `[C, qkv_width]`: q, k and v in one product, their columns in that order
    /// ([`Config::qkv_width`]).
    pub attn_w: Array2<A>,
    pub attn_b: Array1<A>,
    /// `[C, C]`: the attention's output projection, into the residual stream.
    pub proj_w: Array2<A>,
    pub proj_b: Array1<A>,
    pub ln_2_w: Array1<A>,
    pub ln_2_b: Array1<A>,
    /// `[C, 4C]`
    pub fc_w: Array2<A>,
    pub fc_b: Array1<A>,
    /// `[4C, C]`: the MLP's output projection, into the residual stream.
    pub fc_proj_w: Array2<A>,
    pub fc_proj_b: Array1<A>,
}

/// Every weight of a model (and, the same shape, its gradients and the optimizer's
/// moments).
#[derive(Clone, Debug, PartialEq)]
pub struct Params<A> {
    pub config: Config,
    /// `[vocab, C]`: a row per token; also the output layer, `logits = h · wteᵀ`.
    pub wte: Array2<A>,
    /// `[context, C]`: a row per position.
    pub wpe: Array2<A>,
    pub blocks: Vec<Block<A>>,
    pub ln_f_w: Array1<A>,
    pub ln_f_b: Array1<A>,
}

/// Every tensor of a [`Params`] in one fixed order, with its name: the flat view the
/// optimizer, the gradient norm and the checkpoints walk.
macro_rules! tensors {
    ($p:expr, $view:ident, $iter:ident) => {{
        let p = $p;
        let mut all = Vec::with_capacity(4 + 12 * p.blocks.len());
        all.push(("wte.weight".to_string(), p.wte.$view().into_dyn()));
        all.push(("wpe.weight".to_string(), p.wpe.$view().into_dyn()));
        for (i, b) in p.blocks.$iter().enumerate() {
            let name = |what: &str| format!("h.{i}.{what}");
            all.push((name("ln_1.weight"), b.ln_1_w.$view().into_dyn()));
            all.push((name("ln_1.bias"), b.ln_1_b.$view().into_dyn()));
            all.push((name("attn.c_attn.weight"), b.attn_w.$view().into_dyn()));
            all.push((name("attn.c_attn.bias"), b.attn_b.$view().into_dyn()));
            all.push((name("attn.c_proj.weight"), b.proj_w.$view().into_dyn()));
            all.push((name("attn.c_proj.bias"), b.proj_b.$view().into_dyn()));
            all.push((name("ln_2.weight"), b.ln_2_w.$view().into_dyn()));
            all.push((name("ln_2.bias"), b.ln_2_b.$view().into_dyn()));
            all.push((name("mlp.c_fc.weight"), b.fc_w.$view().into_dyn()));
            all.push((name("mlp.c_fc.bias"), b.fc_b.$view().into_dyn()));
            all.push((name("mlp.c_proj.weight"), b.fc_proj_w.$view().into_dyn()));
            all.push((name("mlp.c_proj.bias"), b.fc_proj_b.$view().into_dyn()));
        }
        all.push(("ln_f.weight".to_string(), p.ln_f_w.$view().into_dyn()));
        all.push(("ln_f.bias".to_string(), p.ln_f_b.$view().into_dyn()));
        all
    }};
}

impl<A: Float> Params<A> {
    /// All zeros: the start of a gradient or of a moment of the optimizer.
    pub fn zeros(config: Config) -> Self {
        let (c, v, t) = (config.d_model, config.vocab, config.context);
        let qkv = config.qkv_width();
        let block = || Block {
            ln_1_w: Array1::zeros(c),
            ln_1_b: Array1::zeros(c),
            attn_w: Array2::zeros((c, qkv)),
            attn_b: Array1::zeros(qkv),
            proj_w: Array2::zeros((c, c)),
            proj_b: Array1::zeros(c),
            ln_2_w: Array1::zeros(c),
            ln_2_b: Array1::zeros(c),
            fc_w: Array2::zeros((c, 4 * c)),
            fc_b: Array1::zeros(4 * c),
            fc_proj_w: Array2::zeros((4 * c, c)),
            fc_proj_b: Array1::zeros(c),
        };
        Params {
            config,
            wte: Array2::zeros((v, c)),
            wpe: Array2::zeros((t, c)),
            blocks: (0..config.layers).map(|_| block()).collect(),
            ln_f_w: Array1::zeros(c),
            ln_f_b: Array1::zeros(c),
        }
    }

    /// GPT-2's initialisation (Radford et al. 2019, §2.3; Hugging Face's `_init_weights`):
    /// every matrix normal with σ = 0.02, and the two projections that add into the
    /// residual stream with σ = 0.02/√(2·layers), so the stream's variance does not grow
    /// with depth; biases 0, LayerNorm gains 1. One stream of the seed, tensor after
    /// tensor.
    pub fn init(config: Config, seed: u64) -> Result<Self, TrainError> {
        config.check()?;
        let mut p = Self::zeros(config);
        let mut rng = SplitMix64::new(seed);
        let residual = 0.02 / (2.0 * config.layers as f64).sqrt();
        for (name, mut t) in p.tensors_mut() {
            let sigma = if name.ends_with("c_proj.weight") {
                residual
            } else if name.ends_with(".weight") && t.ndim() == 2 {
                0.02
            } else if name.contains("ln_") && name.ends_with(".weight") {
                t.fill(A::one());
                continue;
            } else {
                continue;
            };
            t.mapv_inplace(|_| A::of(sigma * rng.next_normal()));
        }
        Ok(p)
    }

    /// Every tensor by name, in one fixed order.
    pub fn tensors(&self) -> Vec<(String, ArrayViewD<'_, A>)> {
        tensors!(self, view, iter)
    }

    /// Every tensor by name, to write into, in the order of [`Params::tensors`].
    pub fn tensors_mut(&mut self) -> Vec<(String, ArrayViewMutD<'_, A>)> {
        tensors!(self, view_mut, iter_mut)
    }

    /// How many numbers the model has.
    pub fn count(&self) -> usize {
        self.tensors().iter().map(|(_, t)| t.len()).sum()
    }

    /// The same weights in another float type (`f32` → `f64` to check gradients).
    pub fn cast<B: Float>(&self, to: impl Fn(A) -> B) -> Params<B> {
        let mut out = Params::<B>::zeros(self.config);
        for ((_, src), (_, mut dst)) in self.tensors().into_iter().zip(out.tensors_mut()) {
            dst.zip_mut_with(&src, |d, &s| *d = to(s));
        }
        out
    }
}

/// What one block's forward keeps for its backward.
pub struct BlockActs<A: Float> {
    /// The block's input, `[B·T, C]`.
    pub x: Array2<A>,
    pub ln_1: Norm<A>,
    /// `[B, H, T, D]` each, as the attention kernels take them.
    // [step 08]
    /// With grouped heads, k and v have each kv head repeated for its group.
    // [/step 08]
    pub q: Array4<A>,
    pub k: Array4<A>,
    pub v: Array4<A>,
    /// The attention's output and each row's log-sum-exp: all its backward needs besides q,
    /// k and v.
    pub att: A::Saved,
    /// The attention's output back in rows, `[B·T, C]`.
    pub att_rows: Array2<A>,
    /// `x + attention`, the input of the MLP's half.
    pub x_mid: Array2<A>,
    pub ln_2: Norm<A>,
    /// Before the GELU, `[B·T, 4C]`.
    pub fc: Array2<A>,
    /// After the GELU.
    pub fc_gelu: Array2<A>,
}

/// What the forward keeps: every block's activations, the last LayerNorm and the
/// probabilities.
pub struct Activations<A: Float> {
    pub batch: usize,
    pub tokens: usize,
    pub blocks: Vec<BlockActs<A>>,
    /// The residual stream after the last block, `[B·T, C]`.
    pub x_final: Array2<A>,
    pub ln_f: Norm<A>,
    /// `[B·T, vocab]`: the model's distribution of the next token at every position.
    pub probs: Array2<A>,
    // [step 09]
    /// The keys each token's attention saw in every block, for the backward: `None` is
    /// causal, a document mask each token's own file only (`train --documents`).
    pub mask: Option<Mask>,
    // [/step 09]
}

/// Checks that a batch of tokens fits the model: no longer than its context, every token
/// in its vocabulary.
pub(crate) fn check_inputs(cfg: &Config, inputs: ArrayView2<u8>) -> Result<(), TrainError> {
    let tokens = inputs.ncols();
    if tokens > cfg.context {
        return Err(TrainError::Config(format!(
            "{tokens} tokens in a row, but the model's context is {}: it has a position \
             embedding for {} positions only",
            cfg.context, cfg.context
        )));
    }
    if let Some(&t) = inputs.iter().find(|&&t| t as usize >= cfg.vocab) {
        return Err(TrainError::Config(format!(
            "token {t} is outside the model's vocabulary of {}",
            cfg.vocab
        )));
    }
    Ok(())
}

// ANCHOR: forward
/// The forward pass over `inputs` (`[B, T]` tokens), keeping what the backward needs.
pub fn forward<A: Float>(
    p: &Params<A>,
    inputs: ArrayView2<u8>,
) -> Result<Activations<A>, TrainError> {
    // [step 09]
    forward_documents(p, inputs, None)
}

/// [`forward`] with documents packed in each sequence (`train --documents`): with
/// `documents` (`[B, T]` ids, or one row for every sequence alike), a token attends to the
/// earlier tokens of its own document only, through step 09's document mask; `None` is
/// [`forward`]. The mask is kept for the backward.
pub fn forward_documents<A: Float>(
    p: &Params<A>,
    inputs: ArrayView2<u8>,
    documents: Option<&Documents>,
) -> Result<Activations<A>, TrainError> {
    let mask = documents.map(|d| Mask::Documents(d.clone()));
    // [/step 09]
    let cfg = p.config;
    let (batch, tokens) = inputs.dim();
    check_inputs(&cfg, inputs)?;
    // x[b·T + t] = wte[token] + wpe[t]
    let mut x = Array2::zeros((batch * tokens, cfg.d_model));
    for ((b, t), &tok) in inputs.indexed_iter() {
        let mut row = x.row_mut(b * tokens + t);
        row.assign(&p.wte.row(tok as usize));
        row += &p.wpe.row(t);
    }
    let mut blocks = Vec::with_capacity(cfg.layers);
    for w in &p.blocks {
        let ln_1 = layernorm(x.view(), w.ln_1_w.view(), w.ln_1_b.view());
        let qkv = linear(ln_1.out.view(), w.attn_w.view(), w.attn_b.view());
        let [q, k, v] = split_qkv(
            qkv.view(),
            batch,
            cfg.heads,
            cfg.kv_heads, // [step 08]
        );
        // [step 08]
        // each key and value head serves `groups` query heads
        let groups = cfg.heads / cfg.kv_heads;
        let (k, v) = (repeat_kv(k, groups), repeat_kv(v, groups));
        // [/step 08]
        let att = A::attention(
            q.view(),
            k.view(),
            v.view(),
            mask.as_ref(), // [step 09]
        )?;
        let att_rows = from_heads(A::attention_out(&att));
        let x_mid = &x + &linear(att_rows.view(), w.proj_w.view(), w.proj_b.view());
        let ln_2 = layernorm(x_mid.view(), w.ln_2_w.view(), w.ln_2_b.view());
        let fc = linear(ln_2.out.view(), w.fc_w.view(), w.fc_b.view());
        let fc_gelu = fc.mapv(gelu);
        let x_out =
            &x_mid + &linear(fc_gelu.view(), w.fc_proj_w.view(), w.fc_proj_b.view());
        blocks.push(BlockActs {
            x,
            ln_1,
            q,
            k,
            v,
            att,
            att_rows,
            x_mid,
            ln_2,
            fc,
            fc_gelu,
        });
        x = x_out;
    }
    let ln_f = layernorm(x.view(), p.ln_f_w.view(), p.ln_f_b.view());
    // the output layer is the token embedding, transposed
    let mut probs = ln_f.out.dot(&p.wte.t());
    softmax_rows(&mut probs);
    Ok(Activations {
        batch,
        tokens,
        blocks,
        x_final: x,
        ln_f,
        probs,
        mask, // [step 09]
    })
}
// ANCHOR_END: forward

/// The mean cross-entropy of the forward's predictions against `targets` (`[B, T]`).
pub fn loss<A: Float>(acts: &Activations<A>, targets: ArrayView2<u8>) -> A {
    let targets: Vec<u8> = targets.iter().copied().collect();
    cross_entropy(acts.probs.view(), &targets)
}

// ANCHOR: backward
/// The gradient of the mean cross-entropy with respect to every weight, by hand: each
/// layer's backward in the reverse order of the forward.
pub fn backward<A: Float>(
    p: &Params<A>,
    acts: &Activations<A>,
    inputs: ArrayView2<u8>,
    targets: ArrayView2<u8>,
) -> Result<Params<A>, TrainError> {
    let cfg = p.config;
    let (batch, tokens) = (acts.batch, acts.tokens);
    let mut g = Params::<A>::zeros(cfg);
    let targets: Vec<u8> = targets.iter().copied().collect();
    let dlogits = cross_entropy_backward(acts.probs.view(), &targets);
    // logits = h · wteᵀ: dwte += dlogitsᵀ · h, dh = dlogits · wte
    g.wte += &dlogits.t().dot(&acts.ln_f.out);
    let dln_f = dlogits.dot(&p.wte);
    let mut dx = Array2::zeros(acts.x_final.dim());
    layernorm_backward(
        dln_f.view(),
        acts.x_final.view(),
        p.ln_f_w.view(),
        &acts.ln_f,
        dx.view_mut(),
        g.ln_f_w.view_mut(),
        g.ln_f_b.view_mut(),
    );
    for ((w, a), gw) in p.blocks.iter().zip(&acts.blocks).zip(&mut g.blocks).rev() {
        // dx: the gradient of the block's output; the residual passes it straight through
        // to x_mid, and the MLP adds its own share
        let mut dmid = dx.clone();
        let mut dgelu = Array2::zeros(a.fc_gelu.dim());
        linear_backward(
            dx.view(),
            a.fc_gelu.view(),
            w.fc_proj_w.view(),
            &mut dgelu.view_mut(),
            &mut gw.fc_proj_w.view_mut(),
            gw.fc_proj_b.view_mut(),
        );
        let dfc = &dgelu * &a.fc.mapv(gelu_grad);
        let mut dln_2 = Array2::zeros(a.ln_2.out.dim());
        linear_backward(
            dfc.view(),
            a.ln_2.out.view(),
            w.fc_w.view(),
            &mut dln_2.view_mut(),
            &mut gw.fc_w.view_mut(),
            gw.fc_b.view_mut(),
        );
        layernorm_backward(
            dln_2.view(),
            a.x_mid.view(),
            w.ln_2_w.view(),
            &a.ln_2,
            dmid.view_mut(),
            gw.ln_2_w.view_mut(),
            gw.ln_2_b.view_mut(),
        );
        // the attention's half, the same way: the residual, then the projection
        let mut dx_in = dmid.clone();
        let mut datt_rows = Array2::zeros(a.att_rows.dim());
        linear_backward(
            dmid.view(),
            a.att_rows.view(),
            w.proj_w.view(),
            &mut datt_rows.view_mut(),
            &mut gw.proj_w.view_mut(),
            gw.proj_b.view_mut(),
        );
        let dout = to_heads(datt_rows.view(), batch, cfg.heads);
        let [dq, dk, dv] = A::attention_backward(
            a.q.view(),
            a.k.view(),
            a.v.view(),
            &a.att,
            dout.view(),
            acts.mask.as_ref(), // [step 09]
        )?;
        // [step 08]
        let groups = cfg.heads / cfg.kv_heads;
        let (dk, dv) = (sum_groups(dk, groups), sum_groups(dv, groups));
        // [/step 08]
        let dqkv = join_qkv(dq.view(), dk.view(), dv.view());
        let mut dln_1 = Array2::zeros(a.ln_1.out.dim());
        linear_backward(
            dqkv.view(),
            a.ln_1.out.view(),
            w.attn_w.view(),
            &mut dln_1.view_mut(),
            &mut gw.attn_w.view_mut(),
            gw.attn_b.view_mut(),
        );
        layernorm_backward(
            dln_1.view(),
            a.x.view(),
            w.ln_1_w.view(),
            &a.ln_1,
            dx_in.view_mut(),
            gw.ln_1_w.view_mut(),
            gw.ln_1_b.view_mut(),
        );
        dx = dx_in;
    }
    // x[b·T + t] = wte[token] + wpe[t]
    for ((b, t), &tok) in inputs.indexed_iter() {
        let row = dx.row(b * tokens + t);
        let mut e = g.wte.row_mut(tok as usize);
        e += &row;
        let mut pos = g.wpe.row_mut(t);
        pos += &row;
    }
    Ok(g)
}
// ANCHOR_END: backward

/// The distribution of the token after the last of `tokens` (at most the context's last
/// `context` are seen).
pub fn next_token_probs(p: &Params<f32>, tokens: &[u8]) -> Result<Array1<f32>, TrainError> {
    let start = tokens.len().saturating_sub(p.config.context);
    let window = &tokens[start..];
    if window.is_empty() {
        return Err(TrainError::Config(
            "an empty prompt: the model needs at least one token to predict the next"
                .into(),
        ));
    }
    let inputs = ArrayView2::from_shape((1, window.len()), window).expect("one row");
    let acts = forward(p, inputs)?;
    Ok(acts.probs.index_axis(Axis(0), window.len() - 1).to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_is_gpt2s_gains_one_biases_zero_matrices_normal() {
        let config = Config {
            layers: 2,
            d_model: 16,
            heads: 2,
            kv_heads: 2, // [step 08]
            context: 8,
            vocab: 256,
        };
        let p = Params::<f32>::init(config, 1).unwrap();
        for (name, t) in p.tensors() {
            let (min, max) = t
                .iter()
                .fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
            if t.ndim() == 2 {
                let rms = (t.iter().map(|x| x * x).sum::<f32>() / t.len() as f32).sqrt();
                let sigma = if name.ends_with("c_proj.weight") {
                    0.01 // 0.02 / √(2 · 2 layers)
                } else {
                    0.02
                };
                assert!(
                    (rms / sigma - 1.0).abs() < 0.2,
                    "{name}: rms {rms}, σ {sigma}"
                );
            } else if name.contains("ln_") && name.ends_with(".weight") {
                assert_eq!((min, max), (1.0, 1.0), "{name}: a LayerNorm gain");
            } else {
                assert_eq!((min, max), (0.0, 0.0), "{name}: a bias");
            }
        }
    }

    // [step 08]
    #[test]
    fn kv_heads_divide_the_heads_and_old_configs_have_one_per_head() {
        let small = Preset::Small.config();
        let old = r#"{"layers":4,"d_model":128,"heads":4,"context":128,"vocab":256}"#;
        assert_eq!(serde_json::from_str::<Config>(old).unwrap(), small);
        let grouped = Config {
            kv_heads: 2,
            ..small
        };
        grouped.check().unwrap();
        let json = serde_json::to_string(&grouped).unwrap();
        assert_eq!(serde_json::from_str::<Config>(&json).unwrap(), grouped);
        // k and v take 2 heads of 32 columns each: 128 + 2·64
        assert_eq!(grouped.qkv_width(), 256);
        assert_eq!(small.qkv_width(), 3 * 128);
        for kv_heads in [0, 3, 8] {
            let e = Config { kv_heads, ..small }
                .check()
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("kv_heads {kv_heads}")) && e.contains("1, 2, 4"),
                "{e}"
            );
        }
    }
    // [/step 08]
}
