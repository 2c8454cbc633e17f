//! Masks and score functions as code: FlexAttention's `mask_mod` and `score_mod`.
//!
//! A [`Mask`] says which keys a query sees; a [`ScoreMod`] changes a scaled score
//! `s = q·k/√d` before the softmax. Both are called with the same four indices,
//! `(b, h, q, k)`: the sequence, the *query* head, the query's absolute position and the
//! key's. The queries are the last `tq` of the `tk` tokens (chunked prefill; `tq == tk` is
//! training), so query row `i` sits at position `q = i + (tk − tq)`.
//!
//! Each built-in has three forms that must agree: a Rust function (the CPU and the `f64`
//! reference call it), CUDA source with its parameters written in as literals (the kernels
//! compile it with NVRTC), and, for the masks, the interval of keys each row sees (the
//! block mask counts with it; [`Mask::row_keys`]).
//!
//! ## Layout
//!
//! - [`Mask`], [`Documents`], [`CustomMask`]: which keys a query sees.
//! - [`ScoreMod`], [`CustomScore`]: the score function and its derivative.
//! - [`MaskSpec`]: the `--mask` flag's text, parsed in one place, then resolved against a
//!   shape ([`MaskSpec::resolve`]).
//! - [`kernel_source`]: the CUDA text a kernel includes for one mask and one score mod.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use flash_core::AttnError;

/// Why a mask or a score function was refused: the value, and what is accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MaskError {
    pub what: String,
}

impl MaskError {
    fn new(what: impl Into<String>) -> MaskError {
        MaskError { what: what.into() }
    }
}

impl fmt::Display for MaskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.what)
    }
}

impl std::error::Error for MaskError {}

impl From<MaskError> for AttnError {
    fn from(e: MaskError) -> AttnError {
        AttnError::Unsupported { what: e.what }
    }
}

/// What `--mask` accepts, for every message that refuses a term.
pub const ACCEPTED: &str = "accepted: comma-separated terms, at most one mask and one \
     score function: causal, full, sliding:W (W ≥ 1), prefix:P, documents:FILE (document \
     lengths, whitespace-separated, adding up to the tokens), softcap:C (C > 0, finite), \
     alibi, cuda:FILE.cu (defining mask_mod, or score_mod and score_mod_grad, or all \
     three)";

/// Whether a mask can differ between the sequences of a batch and between heads: the block
/// mask keeps one table for each value of what it varies with, and one for all otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Varies {
    pub batch: bool,
    pub head: bool,
}

/// A mask's Rust function: `(b, h, q, k)`, `q` the query's absolute position, `h` the query
/// head.
pub type MaskFn = dyn Fn(usize, usize, usize, usize) -> bool + Send + Sync;

/// A score function's value or derivative: `(s, b, h, q, k)`.
pub type ScoreFn = dyn Fn(f64, usize, usize, usize, usize) -> f64 + Send + Sync;

/// Which keys each query sees (FlexAttention's `mask_mod`). `q` below is the query's
/// absolute position.
#[derive(Clone, Debug)]
pub enum Mask {
    /// `k ≤ q`.
    Causal,
    /// Every key.
    Full,
    /// Causal, and the `window` latest keys only: `q − k < window`, `window ≥ 1`
    /// (Mistral's and Gemma's local layers).
    Sliding { window: usize },
    /// Every key before `prefix`, causal after it: `k < prefix` or `k ≤ q` (prefix-LM).
    PrefixLm { prefix: usize },
    /// Causal within each document of a packed sequence: the same document and `k ≤ q`.
    Documents(Documents),
    /// The user's own.
    Custom(CustomMask),
}

/// The document of every token of every sequence: `[rows, tokens]` row-major, ids
/// non-decreasing along the tokens. `rows` is the batch, or 1 when every sequence is packed
/// alike (then the mask does not vary with the batch and the block mask keeps one table).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Documents {
    rows: usize,
    tokens: usize,
    ids: Vec<i32>,
}

/// A mask the user wrote: a Rust closure for the CPU, CUDA source for the GPU, or both.
#[derive(Clone)]
pub struct CustomMask {
    name: String,
    rust: Option<Arc<MaskFn>>,
    cuda: Option<String>,
    varies: Varies,
}

/// What happens to a scaled score before the softmax (FlexAttention's `score_mod`).
#[derive(Clone, Debug)]
pub enum ScoreMod {
    /// The score as it is.
    None,
    /// `cap · tanh(s / cap)`, `cap > 0` and finite (Gemma 2's soft-capping).
    SoftCap { cap: f64 },
    /// `s + slope_h · (k − q)`, `slope_h = 2^(−8(h+1)/heads)` for query head `h` of
    /// `heads` (Press et al. 2022, ALiBi).
    Alibi { heads: usize },
    /// The user's own.
    Custom(CustomScore),
}

/// A score function the user wrote: the value and its derivative `d/ds` in Rust, CUDA
/// source for the GPU, or both.
#[derive(Clone)]
pub struct CustomScore {
    name: String,
    rust: Option<(Arc<ScoreFn>, Arc<ScoreFn>)>,
    cuda: Option<String>,
}

impl fmt::Debug for CustomMask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CustomMask")
            .field("name", &self.name)
            .field("rust", &self.rust.is_some())
            .field("cuda", &self.cuda.is_some())
            .field("varies", &self.varies)
            .finish()
    }
}

impl fmt::Debug for CustomScore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CustomScore")
            .field("name", &self.name)
            .field("rust", &self.rust.is_some())
            .field("cuda", &self.cuda.is_some())
            .finish()
    }
}

impl Documents {
    /// From a document id per token, `[rows, tokens]` row-major (`rows` the batch, or 1 for
    /// every sequence alike). The ids must not go down along a sequence: a document is one
    /// run of tokens.
    pub fn from_ids(
        rows: usize,
        tokens: usize,
        ids: Vec<i32>,
    ) -> Result<Documents, MaskError> {
        if rows.checked_mul(tokens) != Some(ids.len()) {
            return Err(MaskError::new(format!(
                "document ids: {} ids for {rows} sequences of {tokens} tokens; accepted: \
                 one id per token of each sequence, [rows, tokens] row-major",
                ids.len()
            )));
        }
        for r in 0..rows {
            let row = &ids[r * tokens..(r + 1) * tokens];
            if let Some(t) = (1..tokens).find(|&t| row[t] < row[t - 1]) {
                return Err(MaskError::new(format!(
                    "document ids go down in sequence {r}: token {} has id {} after id {}; \
                     accepted: ids that never go down along a sequence (a document is one \
                     run of tokens)",
                    t,
                    row[t],
                    row[t - 1]
                )));
            }
        }
        Ok(Documents { rows, tokens, ids })
    }

    /// From `cu_seqlens` (`flash_attn_varlen_func`'s): for each sequence, the cumulative
    /// lengths of its documents, starting at 0, strictly increasing, ending at `tokens`.
    pub fn from_cu_seqlens(
        tokens: usize,
        cu: &[Vec<usize>],
    ) -> Result<Documents, MaskError> {
        let mut ids = Vec::with_capacity(cu.len() * tokens);
        for (r, bounds) in cu.iter().enumerate() {
            let bad = |why: &str| {
                MaskError::new(format!(
                    "cu_seqlens of sequence {r}, {bounds:?}: {why}; accepted: cumulative \
                     lengths that start at 0, strictly increase and end at the tokens, \
                     {tokens}"
                ))
            };
            if bounds.first() != Some(&0) {
                return Err(bad("it does not start at 0"));
            }
            if bounds.last() != Some(&tokens) {
                return Err(bad("it does not add up to the tokens"));
            }
            if bounds.windows(2).any(|w| w[1] <= w[0]) && tokens > 0 {
                return Err(bad("it does not strictly increase"));
            }
            for (doc, w) in bounds.windows(2).enumerate() {
                ids.extend(std::iter::repeat_n(doc as i32, w[1] - w[0]));
            }
        }
        Documents::from_ids(cu.len(), tokens, ids)
    }

    /// From the lengths of the documents packed into every sequence alike
    /// (`documents:FILE`).
    pub fn from_lengths(lengths: &[usize]) -> Result<Documents, MaskError> {
        if let Some(i) = lengths.iter().position(|&n| n == 0) {
            return Err(MaskError::new(format!(
                "document {i} has length 0; accepted: lengths of at least 1"
            )));
        }
        let mut cu = vec![0];
        for &n in lengths {
            cu.push(cu.last().unwrap() + n);
        }
        Documents::from_cu_seqlens(*cu.last().unwrap(), &[cu])
    }

    /// Reads a text file of document lengths, whitespace-separated.
    pub fn read(path: &Path) -> Result<Documents, MaskError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            MaskError::new(format!(
                "documents:{}: cannot read it: {e}; accepted: a text file of document \
                 lengths, whitespace-separated",
                path.display()
            ))
        })?;
        let mut lengths = Vec::new();
        for word in text.split_whitespace() {
            match word.parse::<usize>() {
                Ok(n) if n > 0 => lengths.push(n),
                _ => {
                    return Err(MaskError::new(format!(
                        "documents:{}: {word:?} is not a length; accepted: whole numbers \
                         of at least 1, whitespace-separated",
                        path.display()
                    )));
                }
            }
        }
        if lengths.is_empty() {
            return Err(MaskError::new(format!(
                "documents:{}: the file holds no length; accepted: the lengths of the \
                 documents, adding up to the tokens",
                path.display()
            )));
        }
        Documents::from_lengths(&lengths)
    }

    /// Sequences with their own row of ids: the batch, or 1 for every sequence alike.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Tokens of each sequence.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The ids, `[rows, tokens]` row-major: what the GPU's `mask_mod` reads as `data`.
    pub fn ids(&self) -> &[i32] {
        &self.ids
    }

    /// The first token of each token's document, `[rows, tokens]` row-major: with the ids,
    /// what the GPU reads as `data` ([`Mask::gpu_data`]), so that a row's keys are one
    /// interval, from its document's first token to itself.
    pub fn starts(&self) -> Vec<i32> {
        let mut starts = Vec::with_capacity(self.ids.len());
        for row in self.ids.chunks(self.tokens.max(1)) {
            let mut start = 0;
            for (t, &id) in row.iter().enumerate() {
                if t > 0 && id != row[t - 1] {
                    start = t as i32;
                }
                starts.push(start);
            }
        }
        starts
    }

    /// The document of token `t` of sequence `b`.
    pub fn id(&self, b: usize, t: usize) -> i32 {
        let row = if self.rows == 1 { 0 } else { b };
        self.ids[row * self.tokens + t]
    }

    /// The first token of the document that holds token `t` of sequence `b`.
    fn start(&self, b: usize, t: usize) -> usize {
        let row = if self.rows == 1 { 0 } else { b };
        let ids = &self.ids[row * self.tokens..(row + 1) * self.tokens];
        // ids do not go down, so the tokens of t's document before it form one run
        ids[..t].partition_point(|&id| id < ids[t])
    }
}

impl CustomMask {
    /// A mask from a Rust closure; it may vary with the sequence and the head.
    pub fn new(
        name: impl Into<String>,
        f: impl Fn(usize, usize, usize, usize) -> bool + Send + Sync + 'static,
    ) -> CustomMask {
        CustomMask {
            name: name.into(),
            rust: Some(Arc::new(f)),
            cuda: None,
            varies: Varies {
                batch: true,
                head: true,
            },
        }
    }

    /// The same mask as CUDA source for the GPU, defining `mask_mod`.
    pub fn with_cuda(mut self, source: impl Into<String>) -> CustomMask {
        self.cuda = Some(source.into());
        self
    }

    /// Says that the mask is the same for every sequence (`batch: false`) or every head
    /// (`head: false`), so the block mask keeps fewer tables.
    pub fn varying(mut self, varies: Varies) -> CustomMask {
        self.varies = varies;
        self
    }

    /// The CUDA source, if any.
    pub fn cuda(&self) -> Option<&str> {
        self.cuda.as_deref()
    }
}

impl CustomScore {
    /// A score function from Rust closures: its value and its derivative `d/ds`.
    pub fn new(
        name: impl Into<String>,
        value: impl Fn(f64, usize, usize, usize, usize) -> f64 + Send + Sync + 'static,
        grad: impl Fn(f64, usize, usize, usize, usize) -> f64 + Send + Sync + 'static,
    ) -> CustomScore {
        CustomScore {
            name: name.into(),
            rust: Some((Arc::new(value), Arc::new(grad))),
            cuda: None,
        }
    }

    /// The same function as CUDA source, defining `score_mod` and `score_mod_grad`.
    pub fn with_cuda(mut self, source: impl Into<String>) -> CustomScore {
        self.cuda = Some(source.into());
        self
    }

    /// The CUDA source, if any.
    pub fn cuda(&self) -> Option<&str> {
        self.cuda.as_deref()
    }
}

/// The CUDA signature every `mask_mod` has.
const MASK_SIGNATURE: &str = "__device__ __forceinline__ bool mask_mod(int b, int h, int \
                              q, int k, const int* __restrict__ data)";

/// `f` as a CUDA `float` literal that reads back as the same `f32`.
fn float_literal(x: f64) -> String {
    let s = format!("{:?}", x as f32);
    if s.contains(['.', 'e']) {
        format!("{s}f")
    } else {
        format!("{s}.0f")
    }
}

// ANCHOR: mask_mod
impl Mask {
    /// Whether query position `q` of sequence `b`, query head `h`, sees key `k`.
    pub fn allows(&self, b: usize, h: usize, q: usize, k: usize) -> bool {
        match self {
            Mask::Causal => k <= q,
            Mask::Full => true,
            Mask::Sliding { window } => k <= q && q - k < *window,
            Mask::PrefixLm { prefix } => k < *prefix || k <= q,
            Mask::Documents(docs) => k <= q && docs.id(b, k) == docs.id(b, q),
            Mask::Custom(c) => c.rust.as_ref().is_some_and(|f| f(b, h, q, k)),
        }
    }
    // ANCHOR_END: mask_mod

    /// For a built-in mask, the keys `lo..hi` that query position `q` of sequence `b` sees
    /// among `tk` (every built-in's are one interval); `None` for a custom mask.
    pub fn row_keys(&self, b: usize, q: usize, tk: usize) -> Option<(usize, usize)> {
        let causal = (q + 1).min(tk);
        Some(match self {
            Mask::Causal => (0, causal),
            Mask::Full => (0, tk),
            Mask::Sliding { window } => {
                ((q + 1).saturating_sub(*window).min(causal), causal)
            }
            Mask::PrefixLm { prefix } => (0, causal.max((*prefix).min(tk))),
            Mask::Documents(docs) => (docs.start(b, q), causal),
            Mask::Custom(_) => return None,
        })
    }

    /// What the mask varies with, so that the block mask keeps one table where one will do.
    pub fn varies_with(&self) -> Varies {
        match self {
            Mask::Documents(d) => Varies {
                batch: d.rows > 1,
                head: false,
            },
            Mask::Custom(c) => c.varies,
            _ => Varies {
                batch: false,
                head: false,
            },
        }
    }

    /// The name a row of measurements carries: `causal`, `sliding:1024`, …
    pub fn name(&self) -> String {
        match self {
            Mask::Causal => "causal".into(),
            Mask::Full => "full".into(),
            Mask::Sliding { window } => format!("sliding:{window}"),
            Mask::PrefixLm { prefix } => format!("prefix:{prefix}"),
            Mask::Documents(d) => {
                let docs = (0..d.rows)
                    .map(|r| d.id(r, d.tokens.saturating_sub(1)) + 1)
                    .max()
                    .unwrap_or(0);
                format!("documents({docs})")
            }
            Mask::Custom(c) => c.name.clone(),
        }
    }

    /// Whether the mask is the plain causal one.
    pub fn is_causal(&self) -> bool {
        matches!(self, Mask::Causal)
    }

    /// Checks the mask's parameters, and that it fits `batch` sequences of `tk` keys, and
    /// that it can run on the CPU (a mask from a `.cu` file has no Rust function).
    pub fn check(&self, batch: usize, tk: usize) -> Result<(), MaskError> {
        match self {
            Mask::Sliding { window: 0 } => Err(MaskError::new(format!(
                "sliding:0: a window of 0 keys leaves every query without a key; {ACCEPTED}"
            ))),
            Mask::Documents(d) => {
                if d.tokens != tk {
                    return Err(MaskError::new(format!(
                        "the documents add up to {} tokens, but k and v hold {tk}; \
                         accepted: document lengths (or ids, or cu_seqlens) that cover \
                         every key",
                        d.tokens
                    )));
                }
                if d.rows != 1 && d.rows != batch {
                    return Err(MaskError::new(format!(
                        "document ids for {} sequences, but the batch has {batch}; \
                         accepted: one row of ids per sequence, or one for every sequence \
                         alike",
                        d.rows
                    )));
                }
                Ok(())
            }
            Mask::Custom(c) if c.rust.is_none() => Err(MaskError::new(format!(
                "the mask {} is CUDA source only: it runs in the GPU's kernels, not on the \
                 CPU; give a Rust closure (CustomMask::new) to run it here",
                c.name
            ))),
            _ => Ok(()),
        }
    }

    // ANCHOR: mask_cuda
    /// CUDA source defining `mask_mod(b, h, q, k, data)`, its parameters written in as
    /// literals. `data` is [`Documents::ids`] for a document mask (a single row is read for
    /// every sequence), null for the others.
    pub fn cuda(&self) -> Result<String, MaskError> {
        let body = match self {
            Mask::Causal => "return k <= q;".to_string(),
            Mask::Full => "return true;".to_string(),
            Mask::Sliding { window } => format!("return k <= q && q - k < {window};"),
            Mask::PrefixLm { prefix } => format!("return k < {prefix} || k <= q;"),
            Mask::Documents(d) => {
                // a row per sequence, or stride 0: the one row every sequence shares
                let stride = if d.rows == 1 { 0 } else { d.tokens };
                format!(
                    "const int* row = data + (long long)b * {stride};\n    \
                     return k <= q && row[k] == row[q];"
                )
            }
            Mask::Custom(c) => {
                return c.cuda.clone().ok_or_else(|| {
                    MaskError::new(format!(
                        "the mask {} is a Rust closure with no CUDA source; give it \
                         one defining `{MASK_SIGNATURE}` (CustomMask::with_cuda, or \
                         cuda:FILE.cu)",
                        c.name
                    ))
                });
            }
        };
        // a mask whose rows are each one interval of keys says so: the kernels then compare
        // a key with two bounds, as step 06's causal mask compares it with one (keys lo..hi
        // of query q, of tk in all: no bound may pass tk − 1 but q's own)
        let interval = match self {
            Mask::Causal => Some(("0".to_string(), "q".to_string())),
            Mask::Full => Some(("0".to_string(), "tk - 1".to_string())),
            Mask::Sliding { window } => {
                Some((format!("q - {window} + 1"), "q".to_string()))
            }
            Mask::PrefixLm { prefix } => {
                Some(("0".to_string(), format!("max(q, min({prefix}, tk) - 1)")))
            }
            // from the document's first token: the starts follow the ids in `data`
            Mask::Documents(d) => {
                let stride = if d.rows == 1 { 0 } else { d.tokens };
                Some((
                    format!("data[{} + (long long)b * {stride} + q]", d.rows * d.tokens),
                    "q".to_string(),
                ))
            }
            Mask::Custom(_) => None,
        };
        let interval = interval.map_or(String::new(), |(lo, hi)| {
            format!(
                "#define MASK_INTERVAL 1\n\
                 __device__ __forceinline__ void mask_interval(int b, int h, int q, \
                 int tk, const int* __restrict__ data, int& lo, int& hi) {{\n    \
                 lo = {lo};\n    hi = {hi};\n}}\n"
            )
        });
        Ok(format!(
            "// mask {}\n{MASK_SIGNATURE} {{\n    {body}\n}}\n{interval}",
            self.name()
        ))
    }
    // ANCHOR_END: mask_cuda

    /// What the GPU reads as `data`: a document mask's ids, then each token's document's
    /// first token ([`Documents::starts`]); `None` for other masks.
    pub fn gpu_data(&self) -> Option<Vec<i32>> {
        match self {
            Mask::Documents(d) => Some([d.ids(), &d.starts()].concat()),
            _ => None,
        }
    }

    /// The mask's document ids, for the GPU's `data` argument; `None` for other masks.
    pub fn data(&self) -> Option<&[i32]> {
        match self {
            Mask::Documents(d) => Some(d.ids()),
            _ => None,
        }
    }
}

// ANCHOR: score_mod
impl ScoreMod {
    /// The score after the function: `s` is `q·k/√d` of query position `q` of sequence
    /// `b`, query head `h`, and key `k`.
    pub fn apply(&self, s: f64, b: usize, h: usize, q: usize, k: usize) -> f64 {
        match self {
            ScoreMod::None => s,
            ScoreMod::SoftCap { cap } => cap * (s / cap).tanh(),
            ScoreMod::Alibi { heads } => s + alibi_slope(h, *heads) * (k as f64 - q as f64),
            ScoreMod::Custom(c) => {
                c.rust.as_ref().map_or(f64::NAN, |f| (f.0)(s, b, h, q, k))
            }
        }
    }

    /// `d apply / d s`, which the backward multiplies the score's gradient by.
    pub fn grad(&self, s: f64, b: usize, h: usize, q: usize, k: usize) -> f64 {
        match self {
            ScoreMod::None | ScoreMod::Alibi { .. } => 1.0,
            ScoreMod::SoftCap { cap } => 1.0 - (s / cap).tanh().powi(2),
            ScoreMod::Custom(c) => {
                c.rust.as_ref().map_or(f64::NAN, |f| (f.1)(s, b, h, q, k))
            }
        }
    }
    // ANCHOR_END: score_mod

    /// Whether the score is left as it is, so a kernel can skip the call.
    pub fn is_identity(&self) -> bool {
        matches!(self, ScoreMod::None)
    }

    /// The name a row of measurements carries: `none`, `softcap:30`, `alibi`, …
    pub fn name(&self) -> String {
        match self {
            ScoreMod::None => "none".into(),
            ScoreMod::SoftCap { cap } => format!("softcap:{cap}"),
            ScoreMod::Alibi { .. } => "alibi".into(),
            ScoreMod::Custom(c) => c.name.clone(),
        }
    }

    /// Checks the parameters, that ALiBi's head count is q's `heads`, and that the function
    /// can run on the CPU (one from a `.cu` file has no Rust function).
    pub fn check(&self, heads: usize) -> Result<(), MaskError> {
        match self {
            ScoreMod::SoftCap { cap } if !(cap.is_finite() && *cap > 0.0) => {
                Err(MaskError::new(format!(
                    "softcap:{cap}: the cap must be a finite number above 0; {ACCEPTED}"
                )))
            }
            ScoreMod::Alibi { heads: n } if *n != heads => Err(MaskError::new(format!(
                "alibi was built for {n} heads but q has {heads}; its slopes \
                 2^(-8(h+1)/heads) depend on the head count"
            ))),
            ScoreMod::Custom(c) if c.rust.is_none() => Err(MaskError::new(format!(
                "the score function {} is CUDA source only: it runs in the GPU's kernels, \
                 not on the CPU; give Rust closures (CustomScore::new) to run it here",
                c.name
            ))),
            _ => Ok(()),
        }
    }

    // ANCHOR: score_cuda
    /// CUDA source defining `score_mod(s, b, h, q, k)` and `score_mod_grad(s, b, h, q, k)`
    /// (its derivative in `s`), and `SCORE_MOD_IDENTITY` for [`ScoreMod::None`].
    pub fn cuda(&self) -> Result<String, MaskError> {
        let (value, grad) = match self {
            ScoreMod::None => ("return s;".to_string(), "return 1.0f;".to_string()),
            ScoreMod::SoftCap { cap } => {
                let inverse = float_literal(1.0 / cap);
                let cap = float_literal(*cap);
                // tanh in one instruction of the multifunction unit (relative error
                // 2^-11, below a 16-bit score's rounding), as FlashAttention-3's
                // soft-capping: tanhf costs several, and registers the backward does not have
                let t = format!(
                    "float t;\n    asm(\"tanh.approx.f32 %0, %1;\" : \"=f\"(t) : \"f\"(s * {inverse}));"
                );
                (
                    format!("{t}\n    return {cap} * t;"),
                    format!("{t}\n    return 1.0f - t * t;"),
                )
            }
            ScoreMod::Alibi { heads } => (
                // slope_h = 2^(−8(h+1)/heads)
                format!(
                    "const float slope = exp2f(-8.0f * (float)(h + 1) / {heads}.0f);\n    \
                     return s + slope * (float)(k - q);"
                ),
                "return 1.0f;".to_string(),
            ),
            ScoreMod::Custom(c) => {
                return c.cuda.clone().ok_or_else(|| {
                    MaskError::new(format!(
                        "the score function {} is Rust closures with no CUDA source; \
                         give it one defining score_mod and score_mod_grad \
                         (CustomScore::with_cuda, or cuda:FILE.cu)",
                        c.name
                    ))
                });
            }
        };
        let head = "__device__ __forceinline__ float";
        let args = "(float s, int b, int h, int q, int k)";
        let identity = if self.is_identity() {
            "#define SCORE_MOD_IDENTITY 1\n"
        } else {
            ""
        };
        Ok(format!(
            "// score_mod {}\n{identity}{head} score_mod{args} {{\n    {value}\n}}\n\
             {head} score_mod_grad{args} {{\n    {grad}\n}}\n",
            self.name()
        ))
    }
    // ANCHOR_END: score_cuda
}

/// ALiBi's slope of query head `h` of `heads`: `2^(−8(h+1)/heads)`.
pub fn alibi_slope(h: usize, heads: usize) -> f64 {
    (-8.0 * (h + 1) as f64 / heads as f64).exp2()
}

/// The CUDA text a kernel includes for `mask` and `score`: `mask_mod`, then `score_mod` and
/// `score_mod_grad`. A `.cu` file that defines all three is included once.
pub fn kernel_source(mask: &Mask, score: &ScoreMod) -> Result<String, MaskError> {
    let (m, s) = (mask.cuda()?, score.cuda()?);
    Ok(if m == s { m } else { format!("{m}\n{s}") })
}

/// Whether CUDA source `src` defines a function `name`: the name as a whole word followed
/// by `(`, outside comments.
fn defines(src: &str, name: &str) -> bool {
    let code = strip_comments(src);
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    code.match_indices(name).any(|(at, _)| {
        let before = code[..at].chars().next_back();
        let after = code[at + name.len()..].trim_start();
        !before.is_some_and(ident) && after.starts_with('(')
    })
}

fn strip_comments(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix("//") {
            rest = r.find('\n').map_or("", |n| &r[n..]);
        } else if let Some(r) = rest.strip_prefix("/*") {
            rest = r.find("*/").map_or("", |n| &r[n + 2..]);
            out.push(' ');
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// What a `cuda:FILE.cu` term gives: a mask, a score function, or both.
fn from_cuda_file(path: &str) -> Result<(Option<Mask>, Option<ScoreMod>), MaskError> {
    let src = std::fs::read_to_string(path).map_err(|e| {
        MaskError::new(format!(
            "cuda:{path}: cannot read it: {e}; accepted: a CUDA file defining mask_mod, or \
             score_mod and score_mod_grad"
        ))
    })?;
    let name = format!("cuda:{path}");
    let (mask, value, grad) = (
        defines(&src, "mask_mod"),
        defines(&src, "score_mod"),
        defines(&src, "score_mod_grad"),
    );
    if value != grad {
        let missing = if value { "score_mod_grad" } else { "score_mod" };
        return Err(MaskError::new(format!(
            "cuda:{path} defines no {missing}: a score function needs both `__device__ \
             __forceinline__ float score_mod(float s, int b, int h, int q, int k)` and \
             score_mod_grad, its derivative in s, with the same arguments (the backward \
             multiplies by it)"
        )));
    }
    if !mask && !value {
        return Err(MaskError::new(format!(
            "cuda:{path} defines neither mask_mod nor score_mod; accepted: a file defining \
             `{MASK_SIGNATURE}`, or score_mod and score_mod_grad (`__device__ \
             __forceinline__ float score_mod(float s, int b, int h, int q, int k)`), or \
             all three"
        )));
    }
    let mask = mask.then(|| {
        Mask::Custom(CustomMask {
            name: name.clone(),
            rust: None,
            cuda: Some(src.clone()),
            varies: Varies {
                batch: true,
                head: true,
            },
        })
    });
    let score = value.then(|| {
        ScoreMod::Custom(CustomScore {
            name,
            rust: None,
            cuda: Some(src),
        })
    });
    Ok((mask, score))
}

/// The `--mask` flag, parsed: a mask and a score function, with what only a shape can
/// settle (ALiBi's head count, the documents' total) left to [`MaskSpec::resolve`].
#[derive(Clone, Debug)]
pub struct MaskSpec {
    text: String,
    mask: Mask,
    score: Option<ScoreMod>,
    alibi: bool,
}

impl MaskSpec {
    /// Parses comma-separated terms: at most one mask (`causal`, the default, `full`,
    /// `sliding:W`, `prefix:P`, `documents:FILE`) and one score function (`softcap:C`,
    /// `alibi`); `cuda:FILE.cu` is whichever of the two (or both) its file defines.
    pub fn parse(text: &str) -> Result<MaskSpec, MaskError> {
        let mut mask: Option<Mask> = None;
        let mut score: Option<ScoreMod> = None;
        let mut alibi = false;
        let number = |term: &str, value: &str| {
            value.trim().parse::<usize>().map_err(|_| {
                MaskError::new(format!(
                    "{term}: {value:?} is not a whole number; {ACCEPTED}"
                ))
            })
        };
        for term in text.split(',').map(str::trim) {
            let (key, value) = term.split_once(':').unwrap_or((term, ""));
            let (m, s): (Option<Mask>, Option<ScoreMod>) = match (key, value) {
                ("causal", "") => (Some(Mask::Causal), None),
                ("full", "") => (Some(Mask::Full), None),
                ("sliding", w) => {
                    let window = number(term, w)?;
                    let m = Mask::Sliding { window };
                    m.check(0, 0)?;
                    (Some(m), None)
                }
                ("prefix", p) => (
                    Some(Mask::PrefixLm {
                        prefix: number(term, p)?,
                    }),
                    None,
                ),
                ("documents", file) if !file.is_empty() => (
                    Some(Mask::Documents(Documents::read(Path::new(file))?)),
                    None,
                ),
                ("softcap", c) => {
                    let cap = c.trim().parse::<f64>().map_err(|_| {
                        MaskError::new(format!("{term}: {c:?} is not a number; {ACCEPTED}"))
                    })?;
                    let s = ScoreMod::SoftCap { cap };
                    s.check(0)?;
                    (None, Some(s))
                }
                ("alibi", "") => {
                    alibi = true;
                    (None, Some(ScoreMod::Alibi { heads: 0 }))
                }
                ("cuda", file) if !file.is_empty() => from_cuda_file(file)?,
                _ => {
                    return Err(MaskError::new(format!(
                        "--mask {text:?}: unknown term {term:?}; {ACCEPTED}"
                    )));
                }
            };
            if let Some(m) = m {
                if let Some(old) = &mask {
                    return Err(MaskError::new(format!(
                        "--mask {text:?} gives two masks, {} and {}; {ACCEPTED}",
                        old.name(),
                        m.name()
                    )));
                }
                mask = Some(m);
            }
            if let Some(s) = s {
                if let Some(old) = &score {
                    return Err(MaskError::new(format!(
                        "--mask {text:?} gives two score functions, {} and {}; {ACCEPTED}",
                        old.name(),
                        s.name()
                    )));
                }
                score = Some(s);
            }
        }
        Ok(MaskSpec {
            text: text.to_string(),
            mask: mask.unwrap_or(Mask::Causal),
            score,
            alibi,
        })
    }

    /// The text it was parsed from.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The mask and the score function for q of `heads` heads and `batch` sequences against
    /// `tk` keys, checked against that shape (the documents must cover the keys).
    pub fn resolve(
        &self,
        batch: usize,
        heads: usize,
        tk: usize,
    ) -> Result<(Mask, ScoreMod), MaskError> {
        let score = match &self.score {
            None => ScoreMod::None,
            Some(_) if self.alibi => ScoreMod::Alibi { heads },
            Some(s) => s.clone(),
        };
        if let Mask::Documents(_) = &self.mask {
            self.mask.check(batch, tk).map_err(|e| {
                MaskError::new(format!("--mask {:?}: {}", self.text, e.what))
            })?;
        }
        Ok((self.mask.clone(), score))
    }
}

impl std::str::FromStr for MaskSpec {
    type Err = MaskError;
    fn from_str(s: &str) -> Result<MaskSpec, MaskError> {
        MaskSpec::parse(s)
    }
}
