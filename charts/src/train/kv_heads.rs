//! Step 08's charts of training with grouped heads, from `charts/data/train-kv-heads-*.json`
//! (written by `step05-train train --kv-heads N --out`): the same model, batches and rates
//! with 4 key and value heads for its 4 query heads, with 2 and with 1.
//!
//! - `train-kv-heads-loss.svg`: the loss against the step, a line a run, and below it each
//!   grouped run's relative difference from the run with a kv head per query head;
//! - `train-kv-heads.md`: a row per run: kv heads, the query heads that share each, the
//!   model's weights, its key/value cache a token, the last held-out loss and how far it is
//!   from the run with a kv head per query head.
//!
//! These files are not among step 05's runs ([`super::read_runs`] leaves them here).

use std::path::Path;

use flash_core::Device;
use plotters::prelude::*;
use serde::Deserialize;

use super::{Eval, Line, Run, render_loss_and_difference};
use crate::{Look, Marker, look, three_digits};

/// A run of `train-kv-heads-*.json`: step 05's record, and what step 08 adds to it.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct KvRun {
    #[serde(flatten)]
    pub run: Run,
    /// The model's weights.
    pub params: usize,
}

/// A grouped-heads run's file: `train-kv-heads-*.json`.
pub fn is_kv_file(path: &Path) -> bool {
    super::is_named(path, "train-kv-heads-")
}

/// Every run of `dir/train-kv-heads-*.json` with its kv heads, the files taken in name
/// order.
pub fn read_runs(dir: &Path) -> Result<Vec<(KvRun, usize)>, String> {
    let runs: Vec<KvRun> = super::read_records(dir, is_kv_file)?;
    Ok(runs
        .into_iter()
        .map(|r| {
            let kv = r.run.config.kv_heads.unwrap_or(r.run.config.heads);
            (r, kv)
        })
        .collect())
}

/// A kv head for every query head looks as our CPU attention does everywhere; fewer in
/// colours and markers of ours of their own.
fn kv_look(kv_heads: usize, heads: usize) -> Look {
    let base = look("online", Device::Cpu);
    let (colour, marker) = match heads / kv_heads.max(1) {
        1 => return base,
        2 => (RGBColor(0x1d, 0x91, 0xc0), Marker::Diamond),
        _ => (RGBColor(0x08, 0x30, 0x6b), Marker::Triangle),
    };
    Look {
        colour,
        marker,
        words: label(kv_heads, heads),
        ..base
    }
}

fn label(kv_heads: usize, heads: usize) -> String {
    match (heads / kv_heads.max(1), kv_heads) {
        (1, _) => format!("{kv_heads} kv heads, one a query head"),
        (g, 1) => format!("1 kv head, shared by all {g} query heads"),
        (g, _) => format!("{kv_heads} kv heads, each shared by {g} query heads"),
    }
}

/// Bytes of keys and values a token adds to the cache, in `f32`: `2 · layers · kv_heads ·
/// head_dim · 4`.
fn cache_bytes(run: &Run, kv_heads: usize) -> usize {
    let c = &run.config;
    2 * c.layers * kv_heads * (c.d_model / c.heads.max(1)) * 4
}

/// The chart and the table of the grouped runs, as `(file name, text)`; none without runs.
pub fn render_all(runs: &[(KvRun, usize)]) -> Result<Vec<(String, String)>, String> {
    if runs.is_empty() {
        return Ok(Vec::new());
    }
    let mut runs = runs.to_vec();
    // the most kv heads first: plain attention, then ever more shared
    runs.sort_by_key(|(_, kv)| std::cmp::Reverse(*kv));
    let c = &runs[0].0.run.config;
    let subtitle = format!(
        "CPU · {} layers, d_model {}, {} query heads · batch {} × {} tokens · f32",
        c.layers,
        c.d_model,
        c.heads,
        runs[0].0.run.settings.batch,
        runs[0].0.run.settings.seq_len
    );
    let lines: Vec<Line> = runs
        .iter()
        .map(|(r, kv)| Line {
            run: &r.run,
            look: kv_look(*kv, r.run.config.heads),
            label: label(*kv, r.run.config.heads),
        })
        .collect();
    // every run against the one with a kv head per query head, where there is one
    let plain = runs.iter().position(|(r, kv)| *kv == r.run.config.heads);
    let pairs: Vec<(usize, usize)> = plain
        .map(|p| {
            (0..runs.len())
                .filter(|&i| i != p)
                .map(|i| (p, i))
                .collect()
        })
        .unwrap_or_default();
    let chart = render_loss_and_difference(
        "Loss with grouped heads, same batches",
        &subtitle,
        &lines,
        &pairs,
        "vs a kv head a query head, %",
        1.0,
    )?;
    Ok(vec![
        ("train-kv-heads-loss.svg".into(), chart),
        ("train-kv-heads.md".into(), table(&runs, &subtitle)),
    ])
}

fn last(evals: &[Eval]) -> Option<&Eval> {
    evals.iter().max_by_key(|e| e.step)
}

/// A row per run: kv heads, the last held-out loss's difference from the run with a kv head
/// per query head (in view on a phone before the table scrolls), the group, weights, cache
/// a token and the last held-out loss.
fn table(runs: &[(KvRun, usize)], subtitle: &str) -> String {
    let mut md = format!(
        "<!-- written by `cargo run -p charts` from charts/data/train-kv-heads-*.json: {subtitle} -->\n\n\
         | kv heads | against one kv head a query head | query heads a kv head | weights | cache a token, bytes | steps | held-out loss |\n\
         | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    );
    let plain = runs
        .iter()
        .find(|(r, kv)| *kv == r.run.config.heads)
        .and_then(|(r, _)| last(&r.run.evals));
    for (r, kv) in runs {
        let heads = r.run.config.heads;
        let end = last(&r.run.evals);
        let against = match (end, plain) {
            (Some(e), Some(p)) if *kv != heads => {
                format!("{:+.2}%", 100.0 * (e.loss - p.loss) / p.loss)
            }
            _ => "–".into(),
        };
        md.push_str(&format!(
            "| {kv} | {against} | {} | {} | {} | {} | {} |\n",
            heads / kv.max(&1),
            three_digits(r.params as f64),
            three_digits(cache_bytes(&r.run, *kv) as f64),
            end.map_or_else(|| "–".into(), |e| three_digits(e.step as f64)),
            end.map_or_else(|| "–".into(), |e| format!("{:.4}", e.loss)),
        ));
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(kv_heads: usize, losses: &[f64]) -> (KvRun, usize) {
        let json = serde_json::json!({
            "config": {"layers": 4, "d_model": 128, "heads": 4, "kv_heads": kv_heads,
                       "context": 128, "vocab": 256},
            "settings": {"batch": 16, "seq_len": 128, "steps": 200},
            "params": 800_000,
            "steps": [{"step": 1, "loss": 5.0, "ms": 10.0}],
            "evals": losses.iter().enumerate()
                .map(|(i, l)| serde_json::json!({"step": 100 * i, "loss": l}))
                .collect::<Vec<_>>(),
        });
        (serde_json::from_value(json).unwrap(), kv_heads)
    }

    #[test]
    fn the_table_holds_each_run_against_one_kv_head_a_query_head() {
        let runs = [run(1, &[5.5, 3.0, 2.2]), run(4, &[5.5, 2.9, 2.0])];
        let out = render_all(&runs).unwrap();
        let md = &out
            .iter()
            .find(|(n, _)| n == "train-kv-heads.md")
            .unwrap()
            .1;
        // plain first, then 1 kv head: 4 query heads each, 2·4·1·32·4 bytes, 10% worse
        let rows: Vec<&str> = md.lines().filter(|l| l.starts_with("| 4 |")).collect();
        assert_eq!(rows.len(), 1, "{md}");
        assert!(
            rows[0].contains("| 4,096 |") && rows[0].starts_with("| 4 | – |"),
            "{md}"
        );
        let grouped = md.lines().find(|l| l.starts_with("| 1 |")).unwrap();
        assert!(
            grouped.contains("| 1,024 |") && grouped.starts_with("| 1 | +10.00% |"),
            "{md}"
        );
        assert!(
            md.find("| 4 |").unwrap() < md.find("| 1 |").unwrap(),
            "{md}"
        );
        let svg = &out.iter().find(|(n, _)| n.ends_with(".svg")).unwrap().1;
        assert!(
            svg.contains("1 kv head, shared by all 4 query heads"),
            "{svg}"
        );
    }
}
