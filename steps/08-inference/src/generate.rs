//! Generating with a key/value cache, on the CPU: step 05's model, run once over the prompt
//! (the prefill) and then one token at a time (a decoding step), each step computing only
//! the new token's row and attending with one query row against the keys and values every
//! earlier token left in the cache.
//!
//! Step 05's [`sample`](step05_train::sample) runs the whole forward again for every new
//! byte, so the `n`-th byte costs `n` tokens' work and a text of `n` bytes costs `n²/2`.
//! Every earlier token's keys and values are the same each time (a token attends only to
//! itself and the tokens before it), so [`generate`] keeps them: a byte then costs one
//! token's projections and MLP, plus one row of attention over the cache.

use flash_core::inputs::SplitMix64;
use ndarray::{Array1, Array2, Array3, ArrayView1, ArrayView2, ArrayView3, Axis, s};
use step02_online_softmax::DEFAULT_BLOCK;
use step05_train::TrainError;
use step05_train::layers::{gelu, layernorm, softmax_rows};
use step05_train::model::{Config, Params, forward};
use step05_train::train::{check_probs, check_temperature, pick};

// ANCHOR: kv_cache
/// A whole model's key/value cache on the CPU, in `f32`: each layer's keys and values of
/// every token the model has read, `[kv_heads, positions, head_dim]` per layer as the
/// attention reads them: with grouped heads, one head for each
/// group of query heads, so the cache is `heads / kv_heads` times smaller.
///
/// The buffers are the model's context long from the start: a token appends a row to each
/// (position [`ModelCache::len`]), and nothing already there moves. The context is also the
/// cap: the model has a position embedding for `context` positions only.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelCache {
    /// Per layer, `[kv_heads, context, head_dim]`; positions `0..len` are filled.
    keys: Vec<Array3<f32>>,
    values: Vec<Array3<f32>>,
    /// Tokens read so far: the next token's position.
    len: usize,
}
// ANCHOR_END: kv_cache

impl ModelCache {
    /// An empty cache for a model of this shape.
    pub fn new(config: Config) -> ModelCache {
        let shape = (config.kv_heads, config.context, config.head_dim());
        let layer = || Array3::zeros(shape);
        ModelCache {
            keys: (0..config.layers).map(|_| layer()).collect(),
            values: (0..config.layers).map(|_| layer()).collect(),
            len: 0,
        }
    }

    /// Tokens in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The most tokens it holds: the model's context.
    pub fn capacity(&self) -> usize {
        self.keys.first().map_or(0, |k| k.dim().1)
    }

    /// Layer `layer`'s keys so far, `[kv_heads, len, head_dim]`.
    pub fn keys(&self, layer: usize) -> ArrayView3<'_, f32> {
        self.keys[layer].slice(s![.., ..self.len, ..])
    }

    /// Layer `layer`'s values so far, `[kv_heads, len, head_dim]`.
    pub fn values(&self, layer: usize) -> ArrayView3<'_, f32> {
        self.values[layer].slice(s![.., ..self.len, ..])
    }

    /// Bytes of keys and values the cache holds now (each decoding step reads all of them).
    pub fn bytes(&self) -> usize {
        let per_token: usize = self.keys.iter().map(|k| k.dim().0 * k.dim().2).sum();
        2 * per_token * self.len * std::mem::size_of::<f32>()
    }

    /// An error unless `more` tokens fit after the ones already here.
    fn check_room(&self, more: usize) -> Result<(), TrainError> {
        let (len, capacity) = (self.len, self.capacity());
        if len + more > capacity {
            return Err(TrainError::Config(format!(
                "the cache holds {len} tokens and {more} more would make {}, but the \
                 model's context is {capacity}: it has position embeddings for positions \
                 0..{capacity} only, so at most {capacity} tokens fit",
                len + more
            )));
        }
        Ok(())
    }
}

/// An error unless `token` is in the model's vocabulary.
fn check_token(config: &Config, token: u8) -> Result<(), TrainError> {
    if token as usize >= config.vocab {
        return Err(TrainError::Config(format!(
            "token {token} is outside the model's vocabulary of {}: tokens 0..{} are \
             accepted",
            config.vocab, config.vocab
        )));
    }
    Ok(())
}

// ANCHOR: prefill
/// Reads `prompt` with step 05's forward, all its tokens at once, and keeps every layer's
/// keys and values in a new cache. Returns the cache and the logits of the token after
/// the prompt.
pub fn prefill(
    params: &Params<f32>,
    prompt: &[u8],
) -> Result<(ModelCache, Array1<f32>), TrainError> {
    let cfg = params.config;
    if prompt.is_empty() {
        return Err(TrainError::Config(
            "an empty prompt: the model needs at least one token to predict the next"
                .into(),
        ));
    }
    let mut cache = ModelCache::new(cfg);
    cache.check_room(prompt.len())?;
    let n = prompt.len();
    let inputs = ArrayView2::from_shape((1, n), prompt).expect("one row");
    // the forward keeps each block's k and v, [1, heads, n, head_dim]: the cache's rows
    // (with grouped heads each kv head is there once for each query head of its group)
    let acts = forward(params, inputs)?;
    let groups = cfg.heads / cfg.kv_heads;
    for (layer, a) in acts.blocks.iter().enumerate() {
        let keys = a.k.slice(s![0, ..;groups, .., ..]);
        let values = a.v.slice(s![0, ..;groups, .., ..]);
        cache.keys[layer].slice_mut(s![.., ..n, ..]).assign(&keys);
        cache.values[layer]
            .slice_mut(s![.., ..n, ..])
            .assign(&values);
    }
    cache.len = n;
    // the output layer on the last row only: logits = h · wteᵀ
    let last = acts.ln_f.out.slice(s![n - 1..n, ..]).dot(&params.wte.t());
    Ok((cache, last.index_axis_move(Axis(0), 0)))
}
// ANCHOR_END: prefill

// ANCHOR: decode_step
/// Reads one more token, the cache's next position: its embedding, and in every layer its
/// LayerNorm, its q, k and v, its k and v appended to the cache, one query row per head
/// against the cache, the projection and the MLP. Returns the logits of the token after
/// it.
pub fn step(
    params: &Params<f32>,
    cache: &mut ModelCache,
    token: u8,
) -> Result<Array1<f32>, TrainError> {
    let cfg = params.config;
    let (heads, kv_heads, d) = (cfg.heads, cfg.kv_heads, cfg.head_dim());
    cache.check_room(1)?;
    check_token(&cfg, token)?;
    let pos = cache.len;
    // x = wte[token] + wpe[pos]: one row of step 05's embedding
    let mut x = &params.wte.row(token as usize) + &params.wpe.row(pos);
    for (layer, w) in params.blocks.iter().enumerate() {
        let ln_1 = norm(x.view(), w.ln_1_w.view(), w.ln_1_b.view());
        let qkv = linear_row(ln_1.view(), w.attn_w.view(), w.attn_b.view());
        // one row of [q's heads | k's heads | v's heads], each head d values
        let qkv = qkv
            .into_shape_with_order((heads + 2 * kv_heads, d))
            .expect("(heads + 2·kv_heads)·head_dim values");
        let (keys, values) = (&mut cache.keys[layer], &mut cache.values[layer]);
        keys.slice_mut(s![.., pos, ..])
            .assign(&qkv.slice(s![heads..heads + kv_heads, ..]));
        values
            .slice_mut(s![.., pos, ..])
            .assign(&qkv.slice(s![heads + kv_heads.., ..]));
        // the new token sees every position up to its own, itself included: no mask;
        // query head h reads kv head h / (heads / kv_heads)
        let mut att = Array2::zeros((heads, d));
        for h in 0..heads {
            let kv = h / (heads / kv_heads);
            attend_one(
                qkv.row(h),
                keys.slice(s![kv, ..=pos, ..]),
                values.slice(s![kv, ..=pos, ..]),
                att.row_mut(h).as_slice_mut().expect("a contiguous row"),
            );
        }
        // [heads, head_dim] is one row with the heads side by side, as from_heads lays it
        let att = att
            .into_shape_with_order(cfg.d_model)
            .expect("heads·head_dim");
        let x_mid = &x + &linear_row(att.view(), w.proj_w.view(), w.proj_b.view());
        let ln_2 = norm(x_mid.view(), w.ln_2_w.view(), w.ln_2_b.view());
        let fc = linear_row(ln_2.view(), w.fc_w.view(), w.fc_b.view());
        let fc_gelu = fc.mapv(gelu);
        x = &x_mid + &linear_row(fc_gelu.view(), w.fc_proj_w.view(), w.fc_proj_b.view());
    }
    cache.len += 1;
    let ln_f = norm(x.view(), params.ln_f_w.view(), params.ln_f_b.view());
    // the output layer, logits = h · wteᵀ: a dot product with each token's row
    Ok(params.wte.dot(&ln_f))
}

/// Step 05's LayerNorm of one row.
fn norm(x: ArrayView1<f32>, w: ArrayView1<f32>, b: ArrayView1<f32>) -> Array1<f32> {
    let n = layernorm(x.insert_axis(Axis(0)), w, b);
    n.out.index_axis_move(Axis(0), 0)
}

/// Step 05's `linear` for one row, `y = x · W + b`, as a sum of `W`'s rows, each scaled by
/// one value of `x`: `W` read once, in order. Step 05's `linear` on a single row would go
/// through a kernel for matrix products, which copies all of `W` into its own layout on
/// every call (most of a step's time, measured).
fn linear_row(x: ArrayView1<f32>, w: ArrayView2<f32>, b: ArrayView1<f32>) -> Array1<f32> {
    let mut y = b.to_owned();
    for (&xi, row) in x.iter().zip(w.rows()) {
        y.scaled_add(xi, &row);
    }
    y
}
// ANCHOR_END: decode_step

// ANCHOR: extend
/// Reads `tokens` into a cache that may already hold some, in one pass, and returns the
/// logits of the token after the last: a conversation's next message read against the
/// turns before it. Each layer computes the new tokens' rows together (their products as
/// matrices), appends their keys and values, and attends with their queries to the whole
/// cache, the causal diagonal at its end: new row `i` of `n` sees positions `0..=len + i`.
/// That attention is [`decode`](crate::decode()), `n` query rows a head against the cache.
pub fn extend(
    params: &Params<f32>,
    cache: &mut ModelCache,
    tokens: &[u8],
) -> Result<Array1<f32>, TrainError> {
    let cfg = params.config;
    let (heads, kv_heads, d, c) = (cfg.heads, cfg.kv_heads, cfg.head_dim(), cfg.d_model);
    if tokens.is_empty() {
        return Err(TrainError::Config(
            "no tokens to read: extend takes at least one".into(),
        ));
    }
    cache.check_room(tokens.len())?;
    for &t in tokens {
        check_token(&cfg, t)?;
    }
    let (start, n) = (cache.len, tokens.len());
    // x = wte[token] + wpe[position], a row a new token
    let mut x = Array2::from_shape_fn((n, c), |(i, j)| {
        params.wte[[tokens[i] as usize, j]] + params.wpe[[start + i, j]]
    });
    for (layer, w) in params.blocks.iter().enumerate() {
        let ln_1 = layernorm(x.view(), w.ln_1_w.view(), w.ln_1_b.view()).out;
        let qkv = ln_1.dot(&w.attn_w) + &w.attn_b;
        // each row [q's heads | k's heads | v's heads]: [n, heads + 2·kv_heads, head_dim]
        let qkv = qkv
            .into_shape_with_order((n, heads + 2 * kv_heads, d))
            .expect("(heads + 2·kv_heads)·head_dim values a row");
        // the heads from `from` on, `count` of them, as [count, n, head_dim]
        let part = |from: usize, count: usize| {
            qkv.slice(s![.., from..from + count, ..])
                .permuted_axes([1, 0, 2])
        };
        let (keys, values) = (&mut cache.keys[layer], &mut cache.values[layer]);
        keys.slice_mut(s![.., start..start + n, ..])
            .assign(&part(heads, kv_heads));
        values
            .slice_mut(s![.., start..start + n, ..])
            .assign(&part(heads + kv_heads, kv_heads));
        // q [1, heads, n, head_dim] against the cache [1, kv_heads, start + n, head_dim]
        let seen = s![.., ..start + n, ..];
        let att = crate::decode(
            part(0, heads).insert_axis(Axis(0)),
            keys.slice(seen).insert_axis(Axis(0)),
            values.slice(seen).insert_axis(Axis(0)),
        )?;
        // [1, heads, n, head_dim] back to rows, the heads side by side
        let att = att.out.index_axis_move(Axis(0), 0);
        let att = att
            .permuted_axes([1, 0, 2])
            .as_standard_layout()
            .into_owned();
        let att = att.into_shape_with_order((n, c)).expect("heads·head_dim");
        let x_mid = &x + &(att.dot(&w.proj_w) + &w.proj_b);
        let ln_2 = layernorm(x_mid.view(), w.ln_2_w.view(), w.ln_2_b.view()).out;
        let fc = (ln_2.dot(&w.fc_w) + &w.fc_b).mapv(gelu);
        x = &x_mid + &(fc.dot(&w.fc_proj_w) + &w.fc_proj_b);
    }
    cache.len += n;
    let ln_f = norm(x.row(n - 1), params.ln_f_w.view(), params.ln_f_b.view());
    Ok(params.wte.dot(&ln_f))
}
// ANCHOR_END: extend

// ANCHOR: attend_one
/// One query row `q` (`[head_dim]`) against `keys` and `values` (`[tokens, head_dim]`),
/// written to `out`: step 02's online softmax (`attention_blocked`) with a single row. The
/// keys come in blocks of [`DEFAULT_BLOCK`], and the row keeps its three running values;
/// no key comes after the query, so there is no mask and no block to skip.
pub fn attend_one(
    q: ArrayView1<f32>,
    keys: ArrayView2<f32>,
    values: ArrayView2<f32>,
    out: &mut [f32],
) {
    let (tokens, d) = keys.dim();
    let scale = (1.0 / (d as f64).sqrt()) as f32;
    let mut scores = [0.0f32; DEFAULT_BLOCK];
    let mut m = f32::NEG_INFINITY; // the largest score seen so far
    let mut l = 0.0f32; // Σ e^(s_j − m) over the keys seen so far
    out.fill(0.0); // Σ e^(s_j − m)·v_j, not yet divided by ℓ
    for k0 in (0..tokens).step_by(DEFAULT_BLOCK) {
        let cols = DEFAULT_BLOCK.min(tokens - k0);
        let scores = &mut scores[..cols];
        // s_j = q·k_j/√d, the scale after the dot product as in steps 01 and 02
        for (j, s) in scores.iter_mut().enumerate() {
            *s = q.dot(&keys.row(k0 + j)) * scale;
        }
        let m_new = scores.iter().fold(m, |a, &s| a.max(s));
        // what was summed so far is relative to the old maximum: e^(m_old − m_new) moves
        // it to the new one (0 on the first block, where m_old = −∞)
        let correction = (m - m_new).exp();
        l *= correction;
        out.iter_mut().for_each(|o| *o *= correction);
        for (j, &s) in scores.iter().enumerate() {
            let p = (s - m_new).exp();
            l += p;
            for (o, &v) in out.iter_mut().zip(values.row(k0 + j)) {
                *o += p * v;
            }
        }
        m = m_new;
    }
    // after the last block ℓ is the whole row's sum
    out.iter_mut().for_each(|o| *o /= l);
}
// ANCHOR_END: attend_one

// ANCHOR: generate
/// `count` tokens after `prompt`, the same as step 05's [`sample`](step05_train::sample)
/// returns (the same distribution, sharpened by `temperature`, and the same draws from a
/// stream of `seed`), with the cache: the prompt read once, then one [`step`] a token.
///
/// The prompt and the new tokens must fit in the model's context together; `sample` slides
/// its window past the context instead, which moves every token to a new position, and so
/// changes every key and value a cache would hold.
pub fn generate(
    params: &Params<f32>,
    prompt: &[u8],
    count: usize,
    temperature: f32,
    seed: u64,
) -> Result<Vec<u8>, TrainError> {
    let context = params.config.context;
    if prompt.len() + count > context {
        return Err(TrainError::Config(format!(
            "a prompt of {} tokens and {count} new ones make {}, but the model's context \
             is {context}: with a cache, the prompt and the new tokens together must fit \
             in the context (at most {context})",
            prompt.len(),
            prompt.len() + count
        )));
    }
    check_temperature(temperature)?;
    if count == 0 {
        return Ok(Vec::new());
    }
    let mut rng = SplitMix64::new(seed);
    let (mut cache, mut logits) = prefill(params, prompt)?;
    let mut out = Vec::with_capacity(count);
    loop {
        // the probabilities as step 05's forward makes them, then its sampling rule
        let mut probs = logits.insert_axis(Axis(0));
        softmax_rows(&mut probs);
        let probs = probs.as_slice().expect("one row");
        check_probs(probs)?;
        let next = pick(probs, temperature, &mut rng);
        out.push(next);
        if out.len() == count {
            return Ok(out);
        }
        logits = step(params, &mut cache, next)?;
    }
}
// ANCHOR_END: generate
