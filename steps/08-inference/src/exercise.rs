//! Chapter 8's exercise, on the CPU: where a token of a paged cache lives in the pool, as
//! the decoding kernel's `key_rows` finds it (`kernels/decode.cu`), written by the reader
//! in `exercises/key_offset.rs`. The checker asks it for every token, kv head and sequence
//! of page tables laid out as a server's would be (pages taken from the pool in the pool's
//! order and shuffled, sequences of no token, of a page exactly and with a partial last
//! page) and holds each answer to the rules the kernel relies on, in an order that says
//! which one breaks, then to [`key_offset`], the kernel's lookup in Rust, which a test
//! holds to the `.cu` file's text. The `decode-exercise` binary runs it on the reader's
//! file.
//!
//! And the cache's exercise, also on the CPU: a prompt read into a new [`ModelCache`] one
//! token at a time with [`step`], written by the reader in `exercises/prefill_by_steps.rs`
//! and held to [`prefill`], which reads it in one pass ([`check_prefill`]). And chapter
//! 8.2's: each group's gradient summed into its kv head, written in
//! `exercises/sum_groups.rs` and held to the sum in `f64` ([`check_sum_groups`]).

use flash_core::Shape;
use flash_core::exercise::{NotYet, attempt, twice};
use flash_core::inputs::{SplitMix64, random_normal};
use ndarray::{Array1, Array4, ArrayView4};
use step05_train::model::Preset;
use step05_train::{Config, Params, TrainError};

use crate::generate::{ModelCache, prefill, step};

/// The template the reader fills in.
pub const TEMPLATE: &str = "steps/08-inference/exercises/key_offset.rs";

/// Where the solution is.
pub const SOLUTION: &str = "key_offset in steps/08-inference/src/exercise.rs, and key_rows \
     in steps/08-inference/kernels/decode.cu (chapter 8, Exercises, under Solution)";

/// A pool of pages, `[pages, kv_heads, page_size, head_dim]` values, row-major.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool {
    pub pages: usize,
    pub kv_heads: usize,
    /// Tokens a page holds.
    pub page_size: usize,
    pub head_dim: usize,
}

impl Pool {
    /// Values in the pool.
    pub fn len(&self) -> usize {
        self.pages * self.kv_heads * self.page_size * self.head_dim
    }

    /// Whether the pool holds no value.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A page table: `entries` is `[batch, max_pages]`, row-major, entry `p` of sequence `b` the
/// page that holds its tokens `p · page_size` to `(p + 1) · page_size − 1`, `-1` where it has
/// none; `lens[b]` is how many tokens sequence `b` holds.
#[derive(Clone, Copy, Debug)]
pub struct Table<'a> {
    pub entries: &'a [i32],
    pub max_pages: usize,
    pub lens: &'a [usize],
}

/// The signature of the exercise: `(pool, table, b, kvh, t) -> offset`.
pub type KeyOffset<'a> = dyn Fn(&Pool, &Table, usize, usize, usize) -> Option<usize> + 'a;

// ANCHOR: key_offset
/// `key_rows` of `kernels/decode.cu` for one token, in values from the pool's start: the
/// table's entry for the token's page, then the kv head's rows of that page, then the
/// token's row among them.
pub fn key_offset(
    pool: &Pool,
    table: &Table,
    b: usize,
    kvh: usize,
    t: usize,
) -> Option<usize> {
    if t >= table.lens[b] {
        return None;
    }
    let page = table.entries[b * table.max_pages + t / pool.page_size] as usize;
    Some(
        ((page * pool.kv_heads + kvh) * pool.page_size + t % pool.page_size)
            * pool.head_dim,
    )
}
// ANCHOR_END: key_offset

/// One case: a name, the pool, each sequence's length, and whether the pool's pages are
/// handed out shuffled (as in a server that has run a while) or in order.
#[derive(Clone, Debug)]
pub struct Case {
    pub name: &'static str,
    pub pool: Pool,
    pub lens: Vec<usize>,
    pub shuffled: bool,
}

/// One sequence in pages taken in the pool's order, where a lookup that ignores the table
/// still lands right; chapter 8's figure, two sequences of 150 and 100 tokens in pages 3, 0,
/// 5 and 6, 1 of 8; 8 kv heads in pages of 16 tokens, with a sequence of no token and one
/// of exactly one page; and 5 sequences of seeded lengths in a pool with pages to spare.
pub fn cases() -> Vec<Case> {
    let pool = |pages, kv_heads, page_size, head_dim| Pool {
        pages,
        kv_heads,
        page_size,
        head_dim,
    };
    let mut rng = SplitMix64::new(8800);
    let seeded: Vec<usize> = (0..5).map(|_| (rng.next_u64() % 200) as usize).collect();
    vec![
        Case {
            name: "one sequence, pages in the pool's order",
            pool: pool(4, 1, 64, 64),
            lens: vec![150],
            shuffled: false,
        },
        Case {
            name: "the chapter's figure: 150 and 100 tokens in pages 3, 0, 5 and 6, 1",
            pool: pool(8, 1, 64, 64),
            lens: vec![150, 100],
            shuffled: true,
        },
        Case {
            name: "8 kv heads, pages of 16, sequences of 0, 16 and 77 tokens",
            pool: pool(12, 8, 16, 128),
            lens: vec![0, 16, 77],
            shuffled: true,
        },
        Case {
            name: "5 sequences of seeded lengths, pages of 16",
            pool: pool(80, 2, 16, 32),
            lens: seeded,
            shuffled: true,
        },
    ]
}

/// The table of `case`: each sequence takes the pages its length needs from the free list,
/// in order, `-1` after them. Shuffled, the free list is the figure's order for the figure's
/// pool (3, 0, 5, 6, 1, then the rest) and a seeded permutation otherwise.
pub fn table_of(case: &Case) -> (Vec<i32>, usize) {
    let pool = case.pool;
    let max_len = case.lens.iter().copied().max().unwrap_or(0).max(1);
    let max_pages = max_len.div_ceil(pool.page_size) + 1;
    let mut free: Vec<i32> = (0..pool.pages as i32).collect();
    if case.shuffled {
        if pool.pages == 8 {
            free = vec![3, 0, 5, 6, 1, 2, 4, 7];
        } else {
            let mut rng = SplitMix64::new(8801);
            for i in (1..free.len()).rev() {
                free.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
        }
    }
    let mut free = free.into_iter();
    let mut entries = vec![-1; case.lens.len() * max_pages];
    for (b, &len) in case.lens.iter().enumerate() {
        for p in 0..len.div_ceil(pool.page_size) {
            entries[b * max_pages + p] =
                free.next().expect("a pool with a page for every token");
        }
    }
    (entries, max_pages)
}

/// Checks `key_offset` (the reader's) on every token of every kv head and sequence of each
/// case, and on the tokens past each sequence's end up to its table row's reach. For each,
/// in order: `None` exactly where the sequence does not hold the token; the offset is the
/// start of a row of the pool; the row is in a page of the sequence's own; it belongs to
/// kv head `kvh`; its page is the table's entry for the token's page (`t / page_size`); it
/// is row `t % page_size` of that page, which is where the kernel reads it. The number of
/// cases, or the first token that fails and why.
pub fn check(key_offset_of: &KeyOffset) -> Result<usize, NotYet> {
    let all = cases();
    for case in &all {
        let (entries, max_pages) = table_of(case);
        let table = Table {
            entries: &entries,
            max_pages,
            lens: &case.lens,
        };
        let pool = case.pool;
        let row_values = pool.head_dim;
        let page_values = pool.kv_heads * pool.page_size * pool.head_dim;
        for (b, &len) in case.lens.iter().enumerate() {
            let pages = &entries[b * max_pages..(b + 1) * max_pages];
            for kvh in 0..pool.kv_heads {
                for t in 0..max_pages * pool.page_size {
                    let at =
                        format!("{}: sequence {b}, kv head {kvh}, token {t}", case.name);
                    let got = attempt(&at, || key_offset_of(&pool, &table, b, kvh, t))?;
                    let not_yet = |why: String| Err(NotYet::new(at.clone(), why));
                    let offset = match (got, t < len) {
                        (None, false) => continue,
                        (Some(o), false) => {
                            return not_yet(format!(
                                "{o}, where the sequence holds {len} tokens: None past its \
                                 end (the page there is -1, or another token's)"
                            ));
                        }
                        (None, true) => {
                            return not_yet(format!(
                                "None, where the sequence holds {len} tokens, this one among them"
                            ));
                        }
                        (Some(o), true) => o,
                    };
                    if offset % row_values != 0 || offset + row_values > pool.len() {
                        return not_yet(format!(
                            "{offset}, which is not the start of a row of the pool: a \
                             multiple of head_dim ({row_values}) below {}",
                            pool.len()
                        ));
                    }
                    let page = offset / page_values;
                    if !pages.contains(&(page as i32)) {
                        return not_yet(format!(
                            "{offset}, in page {page}, which is not one of the sequence's \
                             pages {:?}: the table says where its tokens are",
                            pages.iter().filter(|&&p| p >= 0).collect::<Vec<_>>()
                        ));
                    }
                    let head = offset % page_values / (pool.page_size * row_values);
                    if head != kvh {
                        return not_yet(format!(
                            "{offset}, in kv head {head}'s rows of page {page}: a page holds \
                             kv head 0's {} rows, then kv head 1's, …",
                            pool.page_size
                        ));
                    }
                    let entry = t / pool.page_size;
                    if page as i32 != pages[entry] {
                        return not_yet(format!(
                            "{offset}, in page {page}, where the token is in the sequence's \
                             page {entry} (t / page_size), which the table puts in page {}",
                            pages[entry]
                        ));
                    }
                    let row = offset % (pool.page_size * row_values) / row_values;
                    if row != t % pool.page_size {
                        return not_yet(format!(
                            "{offset}, row {row} of the page, where the token is row {} \
                             (t % page_size)",
                            t % pool.page_size
                        ));
                    }
                    // every rule holds, so this is the kernel's place; say so if it is not
                    if Some(offset) != key_offset(&pool, &table, b, kvh, t) {
                        return not_yet(format!(
                            "{offset}, which is not where the kernel reads"
                        ));
                    }
                }
            }
        }
    }
    Ok(all.len())
}

// The cache's exercise: a prompt read one token at a time.

/// The template of the cache's exercise.
pub const PREFILL_TEMPLATE: &str = "steps/08-inference/exercises/prefill_by_steps.rs";

/// Where its solution is.
pub const PREFILL_SOLUTION: &str = "prefill_by_steps in steps/08-inference/src/exercise.rs \
     (chapter 8, Exercises, under Solution)";

/// The signature of the cache's exercise: `(params, prompt) -> (cache, logits)`.
pub type PrefillBySteps<'a> =
    dyn Fn(&Params<f32>, &[u8]) -> Result<(ModelCache, Array1<f32>), TrainError> + 'a;

// ANCHOR: prefill_by_steps
/// [`prefill`]'s cache and logits from [`step`] alone, one call a token: `step` works on
/// an empty cache (the first token goes to position 0), and the last call's logits are
/// those of the token after the prompt.
pub fn prefill_by_steps(
    params: &Params<f32>,
    prompt: &[u8],
) -> Result<(ModelCache, Array1<f32>), TrainError> {
    let mut cache = ModelCache::new(params.config);
    let (last, rest) = prompt.split_last().ok_or_else(|| {
        TrainError::Config("an empty prompt: at least one token is needed".into())
    })?;
    for &t in rest {
        step(params, &mut cache, t)?;
    }
    let logits = step(params, &mut cache, *last)?;
    Ok((cache, logits))
}
// ANCHOR_END: prefill_by_steps

/// The models and prompts of the cache's exercise: chapter 5's `small` model (context 128)
/// with prompts of 1, 64 and 128 bytes, the last filling the cache, and the same shape with
/// 2 kv heads for its 4 query heads and a prompt of 77 bytes.
pub fn prefill_cases() -> Vec<(String, Config, Vec<u8>)> {
    let small = Preset::Small.config();
    let grouped = Config {
        kv_heads: 2,
        ..small
    };
    let mut rng = SplitMix64::new(8900);
    let mut text = |n: usize| -> Vec<u8> { (0..n).map(|_| rng.next_u64() as u8).collect() };
    let mut all = Vec::new();
    for n in [1, 64, 128] {
        let bytes = if n == 1 { "byte" } else { "bytes" };
        all.push((
            format!("the small model, a prompt of {n} {bytes}"),
            small,
            text(n),
        ));
    }
    all.push((
        "the small model with 2 kv heads, 77 bytes".into(),
        grouped,
        text(77),
    ));
    all
}

/// The largest difference between two caches' keys and values, and the number of tokens
/// they hold where those differ.
fn cache_difference(a: &ModelCache, b: &ModelCache, layers: usize) -> Result<f32, String> {
    if a.len() != b.len() {
        return Err(format!(
            "the cache holds {} tokens, where the prompt has {}",
            a.len(),
            b.len()
        ));
    }
    let mut worst = 0.0f32;
    for layer in 0..layers {
        for (x, y) in [
            (a.keys(layer), b.keys(layer)),
            (a.values(layer), b.values(layer)),
        ] {
            let d = x
                .iter()
                .zip(y.iter())
                .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
            worst = worst.max(if d.is_nan() { f32::INFINITY } else { d });
        }
    }
    Ok(worst)
}

/// Checks `prefill_by` (the reader's) on every case against [`prefill`]: the cache holds the
/// prompt's tokens, and every layer's keys and values and the logits are within twice what
/// [`prefill_by_steps`] differs from `prefill` by (or of one rounding, where that is smaller):
/// the same model, rounded in another order. An empty prompt must be an error. The number of
/// cases, or the first that fails and why.
pub fn check_prefill(prefill_by: &PrefillBySteps) -> Result<usize, NotYet> {
    let all = prefill_cases();
    for (n, (name, config, prompt)) in all.iter().enumerate() {
        let params = Params::init(*config, 8901 + n as u64).expect("a valid shape");
        let (want, want_logits) = prefill(&params, prompt).expect("a prompt that fits");
        let (ours, ours_logits) =
            prefill_by_steps(&params, prompt).expect("a prompt that fits");
        let layers = config.layers;
        let logits_error = |l: &Array1<f32>| {
            l.iter().zip(&want_logits).fold(0.0f32, |m, (x, y)| {
                let d = (x - y).abs();
                m.max(if d.is_nan() { f32::INFINITY } else { d })
            })
        };
        let step_cache = cache_difference(&ours, &want, layers).expect("the same tokens");
        let allowed_cache = twice(f64::from(step_cache), 1.0);
        let allowed_logits = twice(f64::from(logits_error(&ours_logits)), 1.0);
        let got = attempt(name, || prefill_by(&params, prompt))?;
        let (cache, logits) = got.map_err(|e| {
            NotYet::new(
                name,
                format!("an error, where the prompt fits the context: {e}"),
            )
        })?;
        let cache_error =
            cache_difference(&cache, &want, layers).map_err(|w| NotYet::new(name, w))?;
        if f64::from(cache_error) > allowed_cache {
            return Err(NotYet::new(
                name,
                format!(
                    "a key or value differs from prefill's by {cache_error:.2e}, allowed \
                     {allowed_cache:.2e} (twice the step's own difference)"
                ),
            ));
        }
        if logits.len() != want_logits.len() {
            return Err(NotYet::new(
                name,
                format!(
                    "{} logits, where the vocabulary has {}",
                    logits.len(),
                    want_logits.len()
                ),
            ));
        }
        let error = logits_error(&logits);
        if f64::from(error) > allowed_logits {
            return Err(NotYet::new(
                name,
                format!(
                    "the logits differ from prefill's by {error:.2e}, allowed \
                     {allowed_logits:.2e}: are they the last token's?"
                ),
            ));
        }
    }
    let empty = "an empty prompt";
    let params = Params::init(prefill_cases()[0].1, 8900).expect("a valid shape");
    if attempt(empty, || prefill_by(&params, &[]))?.is_ok() {
        return Err(NotYet::new(
            empty,
            "a cache and logits, where there is no token to predict from: an error is wanted",
        ));
    }
    Ok(all.len() + 1)
}

// Chapter 8.2's exercise: each group's dK (or dV) summed into its kv head.

/// The template of the group sum's exercise.
pub const GROUPS_TEMPLATE: &str = "steps/08-inference/exercises/sum_groups.rs";

/// Where its solution is.
pub const GROUPS_SOLUTION: &str = "sum_groups in steps/05-train/src/layers.rs \
     (chapter 8.2, Exercises, under Solution)";

/// The signature of the group sum's exercise: `(dk, kv_heads) -> dk summed by group`.
pub type SumGroups<'a> = dyn Fn(ArrayView4<f32>, usize) -> Array4<f32> + 'a;

/// Sequences, query heads, kv heads, tokens and head dim of each case: 4 query heads on 2
/// kv heads; 8 on 2; 6 on 1 (multi-query attention); 4 on 4, where the sum is the gradient
/// itself; and 12 on 4, GPT-2 small's heads grouped as in chapter 8.2.
pub const GROUP_CASES: [(usize, usize, usize, usize, usize); 5] = [
    (1, 4, 2, 5, 8),
    (2, 8, 2, 3, 4),
    (1, 6, 1, 4, 8),
    (2, 4, 4, 3, 4),
    (3, 12, 4, 7, 16),
];

/// Checks `sum_of` (the reader's) on every case: the shape `[batch, kv_heads, tokens,
/// head_dim]`, then every value within twice the error of step 05's `sum_groups` against the
/// sum in `f64` (or of one rounding, where that is smaller); where the answer is the sum of
/// other heads, it says which. The number of cases, or the first that fails and why.
pub fn check_sum_groups(sum_of: &SumGroups) -> Result<usize, NotYet> {
    for (n, &(batch, heads, kv_heads, tokens, head_dim)) in GROUP_CASES.iter().enumerate() {
        let g = heads / kv_heads;
        let case = format!(
            "{heads} query heads on {kv_heads} kv heads, {batch} × {tokens} tokens"
        );
        let dk = random_normal(Shape::new(batch, heads, tokens, head_dim), 8800 + n as u64);
        let exact = |group_of: &dyn Fn(usize) -> usize| {
            let mut out = Array4::<f64>::zeros((batch, kv_heads, tokens, head_dim));
            for ((b, h, t, d), &x) in dk.indexed_iter() {
                out[[b, group_of(h), t, d]] += f64::from(x);
            }
            out
        };
        let want = exact(&|h| h / g);
        let ours = step05_train::layers::sum_groups(dk.clone(), g);
        let error = |got: &Array4<f32>, want: &Array4<f64>| {
            got.iter().zip(want).fold(0.0f64, |m, (&x, &y)| {
                let d = (f64::from(x) - y).abs();
                m.max(if d.is_nan() { f64::INFINITY } else { d })
            })
        };
        let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let allowed = twice(error(&ours, &want), scale);
        let got = attempt(&case, || sum_of(dk.view(), kv_heads))?;
        let dims = [batch, kv_heads, tokens, head_dim];
        if got.shape() != dims {
            return Err(NotYet::new(
                case,
                format!(
                    "a result of shape {:?}, where it is {dims:?}: one gradient for each kv head",
                    got.shape()
                ),
            ));
        }
        let e = error(&got, &want);
        if e > allowed {
            let interleaved = exact(&|h| h % kv_heads);
            let why = if error(&got, &interleaved) <= allowed {
                "the sums of query heads h with the same h % kv_heads: query head h reads kv \
                 head h / g, so a group is g neighbouring heads"
                    .to_string()
            } else {
                format!("a value off the group's sum by {e:.2e}, allowed {allowed:.2e}")
            };
            return Err(NotYet::new(case, why));
        }
    }
    Ok(GROUP_CASES.len())
}
