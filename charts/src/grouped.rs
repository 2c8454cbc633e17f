//! Step 08's tables of grouped-query attention in the training kernels, from
//! `charts/data/grouped.json` (step 08's `grouped-bench --out`: step 03's and step 06's
//! forwards, each with its backward) and `charts/data/grouped-pytorch.json` (the PyTorch
//! peer's `--grouped`: SDPA with `enable_gqa`, FlashAttention-2, cuDNN and the default).
//!
//! - `grouped-fwd.md`, `grouped-fwd-bwd.md`: a row per head dim, kv heads and length: our
//!   two kernels' milliseconds, FlashAttention-2's and cuDNN's, and their times over step
//!   06's.

use std::fs;
use std::path::Path;

use serde::Deserialize;

/// One row of `grouped.json` or `grouped-pytorch.json`: the fields the tables read.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct GroupedRow {
    /// `cuda_flash`, `cuda_hopper`; `pytorch_sdpa_flash`, `pytorch_sdpa_cudnn`,
    /// `pytorch_sdpa`
    pub method: String,
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub tokens: usize,
    pub head_dim: usize,
    pub pass: String,
    pub ms: Option<f64>,
    pub error: Option<String>,
}

/// The rows of `dir/grouped.json` and `dir/grouped-pytorch.json` together, or `None` where
/// there are none (a stage before step 08).
pub fn read(dir: &Path) -> Result<Option<Vec<GroupedRow>>, String> {
    let mut all = Vec::new();
    for name in ["grouped.json", "grouped-pytorch.json"] {
        let path = dir.join(name);
        if !path.exists() {
            continue;
        }
        let text =
            fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let rows: Vec<GroupedRow> =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        all.extend(rows);
    }
    Ok((!all.is_empty()).then_some(all))
}

fn ms(rows: &[GroupedRow], method: &str, key: (&str, usize, usize, usize)) -> Option<f64> {
    let (pass, head_dim, kv_heads, tokens) = key;
    rows.iter()
        .find(|r| {
            r.method == method
                && r.pass == pass
                && (r.head_dim, r.kv_heads, r.tokens) == (head_dim, kv_heads, tokens)
        })
        .and_then(|r| r.ms)
}

fn sorted(rows: &[GroupedRow], f: impl Fn(&GroupedRow) -> usize) -> Vec<usize> {
    let mut v: Vec<usize> = rows.iter().map(f).collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// The table of one pass: the shape, then the peers' times over step 06's, so that the
/// ratios stay in view where the table scrolls on a phone, then the times.
fn table(rows: &[GroupedRow], pass: &str) -> String {
    let mut t = String::from(
        "| head dim | kv heads | batch × tokens | FlashAttention-2 ÷ step 06 | cuDNN ÷ step 06 \
         | step 03, ms | step 06, ms | FlashAttention-2, ms | cuDNN, ms |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for d in sorted(rows, |r| r.head_dim) {
        // grouped heads (fewer kv heads) first, as the chapter reads them
        for kv in sorted(rows, |r| r.kv_heads) {
            for tokens in sorted(rows, |r| r.tokens) {
                let key = (pass, d, kv, tokens);
                let Some(hopper) = ms(rows, "cuda_hopper", key) else {
                    continue;
                };
                let batch = rows
                    .iter()
                    .find(|r| (r.head_dim, r.kv_heads, r.tokens) == (d, kv, tokens))
                    .map_or(0, |r| r.batch);
                let cell = |m: Option<f64>| m.map_or("–".into(), |m| format!("{m:.3}"));
                let ratio = |m: Option<f64>| {
                    m.map_or("–".into(), |m| format!("{:.2}×", m / hopper))
                };
                let (fa2, cudnn) = (
                    ms(rows, "pytorch_sdpa_flash", key),
                    ms(rows, "pytorch_sdpa_cudnn", key),
                );
                // no-break spaces: the cell stays on one line
                let size = format!(
                    "{batch}\u{a0}×\u{a0}{}",
                    crate::thousands(&tokens.to_string())
                );
                t += &format!(
                    "| {d} | {kv} | {size} | {} | {} | {} | {hopper:.3} | {} | {} |\n",
                    ratio(fa2),
                    ratio(cudnn),
                    cell(ms(rows, "cuda_flash", key)),
                    cell(fa2),
                    cell(cudnn),
                );
            }
        }
    }
    t
}

/// The two tables, as `(file name, text)`.
pub fn render_all(rows: &[GroupedRow]) -> Vec<(String, String)> {
    vec![
        ("grouped-fwd.md".into(), table(rows, "fwd")),
        ("grouped-fwd-bwd.md".into(), table(rows, "fwd+bwd")),
    ]
}
