//! Step 08's tables and chart: decoding measured, from `charts/data/decode.json` (step 08's
//! `decode-bench --out`: the decoding kernel on a contiguous and on a paged cache, and the
//! read kernel over the same bytes) and `charts/data/decode-pytorch.json` (the PyTorch
//! peer's `--decode`: `scaled_dot_product_attention` with one query row a head).
//!
//! - `decode-d128.md`, `decode-d64.md`: at each head dim, a row per kv heads, batch and
//!   context of [`CONTEXTS`]: our time, GB/s, its share of the read kernel's speed, the
//!   paged cache's share, the read kernel's GB/s, PyTorch's time and its time over ours;
//! - `decode-bandwidth.svg`: at head dim 128 with 8 kv heads, the share of the read
//!   kernel's speed against the context, ours and PyTorch's, at each batch.

use std::fs;
use std::path::Path;

use plotters::prelude::*;
use serde::Deserialize;

use crate::train::chart;
use crate::{Look, Marker, PLOT_HEIGHT, dashed, draw_marker, thousands};

/// The contexts the tables show (the files hold every power of two from 1k to 128k).
pub const CONTEXTS: [usize; 4] = [1024, 8192, 32768, 131072];

/// One row of `decode.json` or `decode-pytorch.json`: the fields the tables read.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct DecodeRow {
    /// `decode`, `decode_paged`, `read`; PyTorch's rows name their own
    pub method: String,
    pub batch: usize,
    pub kv_heads: usize,
    pub context: usize,
    pub head_dim: usize,
    pub splits: Option<usize>,
    pub us: Option<f64>,
    pub gb_s: Option<f64>,
    pub fraction_of_read: Option<f64>,
    pub error: Option<String>,
    /// The GPU and its software, as the benchmark wrote them ("NVIDIA H200 (sm_90, ...)")
    #[serde(default)]
    pub device: Option<String>,
}

/// Our rows and PyTorch's.
pub struct Decoding {
    pub ours: Vec<DecodeRow>,
    pub pytorch: Vec<DecodeRow>,
}

/// The rows of `dir/decode.json` and `dir/decode-pytorch.json`, or `None` where there are
/// none (a stage before step 08).
pub fn read(dir: &Path) -> Result<Option<Decoding>, String> {
    let rows = |name: &str| -> Result<Vec<DecodeRow>, String> {
        let path = dir.join(name);
        if !path.exists() {
            return Ok(Vec::new());
        }
        let text =
            fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    };
    let (ours, pytorch) = (rows("decode.json")?, rows("decode-pytorch.json")?);
    Ok((!ours.is_empty()).then_some(Decoding { ours, pytorch }))
}

impl Decoding {
    /// The GPU our rows ran on, as its name's first word after "NVIDIA" ("H200"), or "GPU"
    /// where the rows do not say.
    pub fn gpu(&self) -> String {
        self.ours
            .iter()
            .find_map(|r| r.device.as_deref())
            .and_then(|d| d.trim_start_matches("NVIDIA ").split([' ', '(']).next())
            .filter(|name| !name.is_empty())
            .unwrap_or("GPU")
            .to_string()
    }

    fn ours(&self, method: &str, key: (usize, usize, usize, usize)) -> Option<&DecodeRow> {
        let (batch, kv_heads, context, head_dim) = key;
        self.ours.iter().find(|r| {
            r.method == method
                && (r.batch, r.kv_heads, r.context, r.head_dim)
                    == (batch, kv_heads, context, head_dim)
        })
    }

    fn pytorch(&self, key: (usize, usize, usize, usize)) -> Option<&DecodeRow> {
        let (batch, kv_heads, context, head_dim) = key;
        self.pytorch.iter().find(|r| {
            (r.batch, r.kv_heads, r.context, r.head_dim)
                == (batch, kv_heads, context, head_dim)
        })
    }

    /// Sorted distinct values of a field of our rows.
    fn values(&self, f: impl Fn(&DecodeRow) -> usize) -> Vec<usize> {
        let mut v: Vec<usize> = self.ours.iter().map(f).collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// `v` with `decimals` decimals and its thousands separated by commas.
fn number(v: f64, decimals: usize) -> String {
    let s = format!("{v:.decimals$}");
    match s.split_once('.') {
        Some((whole, frac)) => format!("{}.{frac}", thousands(whole)),
        None => thousands(&s),
    }
}

fn percent(f: Option<f64>) -> String {
    f.map_or(String::new(), |f| format!("{:.0}%", f * 100.0))
}

/// The table of one head dim: the shape, then PyTorch's time over ours, so that the ratio
/// stays in view where the table scrolls on a phone, then the measurements. A shape ours
/// could not run says so in a word, and why under the table: a sentence in a cell would
/// stretch its row to a column of words.
fn table(d: &Decoding, head_dim: usize) -> String {
    let mut t = String::from(
        "| kv heads | batch | context | PyTorch's time ÷ ours | splits | ours, µs | GB/s | of the \
         read kernel | paged, of the read kernel | read kernel, GB/s | PyTorch SDPA, µs |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    let mut not_run = Vec::new();
    // grouped heads (fewer kv heads) first, as the chapter reads them
    for kv in d.values(|r| r.kv_heads) {
        for batch in d.values(|r| r.batch) {
            for context in CONTEXTS {
                let key = (batch, kv, context, head_dim);
                let Some(ours) = d.ours("decode", key) else {
                    continue;
                };
                let pt = d.pytorch(key).and_then(|r| r.us);
                let head = format!("| {kv} | {batch} | {} |", number(context as f64, 0));
                let Some(us) = ours.us else {
                    let why = ours.error.as_deref().unwrap_or("no time");
                    let pt = pt.map_or("does not fit".into(), |p| number(p, 1));
                    t += &format!("{head} | | not run | | | | | {pt} |\n");
                    not_run.push(format!(
                        "{kv} kv heads, batch {batch}, {} tokens: {why}",
                        number(context as f64, 0)
                    ));
                    continue;
                };
                let paged = d.ours("decode_paged", key).and_then(|r| r.fraction_of_read);
                let read = d.ours("read", key).and_then(|r| r.gb_s);
                t += &format!(
                    "{head} {} | {} | {} | {} | {} | {} | {} | {} |\n",
                    pt.map_or(String::new(), |p| format!("{:.2}×", p / us)),
                    ours.splits.map_or(String::new(), |s| s.to_string()),
                    number(us, 1),
                    ours.gb_s.map_or(String::new(), |g| number(g, 0)),
                    percent(ours.fraction_of_read),
                    percent(paged),
                    read.map_or(String::new(), |g| number(g, 0)),
                    pt.map_or(String::new(), |p| number(p, 1)),
                );
            }
        }
    }
    if !not_run.is_empty() {
        t += &format!("\n*Not run*: {}.\n", not_run.join("; "));
    }
    t
}

/// The chart's series: ours (solid, filled) and PyTorch's (dashed, hollow) at each batch.
fn looks(batch: usize, ours: bool) -> Look {
    let (colour, marker) = match (ours, batch) {
        (true, 1) => (RGBColor(0x08, 0x51, 0x9c), Marker::Circle),
        (true, 8) => (RGBColor(0x31, 0x82, 0xbd), Marker::Square),
        (true, _) => (RGBColor(0x31, 0xa3, 0x54), Marker::Triangle),
        (false, 1) => (RGBColor(0xd9, 0x48, 0x01), Marker::Circle),
        (false, 8) => (RGBColor(0xfd, 0x8d, 0x3c), Marker::Square),
        (false, _) => (RGBColor(0x99, 0x99, 0x99), Marker::Triangle),
    };
    let who = if ours {
        "flash_decode (step 08)"
    } else {
        "PyTorch SDPA (cuDNN)"
    };
    let words = format!("{who}, batch {batch}");
    Look {
        rank: 0,
        ours,
        colour,
        marker,
        short: words.clone(),
        words,
        step: ours.then_some(8),
        same_memory_as: None,
    }
}

/// The share of the read kernel's speed against the context at head dim 128, 8 kv heads.
fn bandwidth_chart(d: &Decoding) -> Result<String, String> {
    let (head_dim, kv) = (128, 8);
    let contexts = d.values(|r| r.context);
    let mut series: Vec<(Look, Vec<(f64, f64)>)> = Vec::new();
    for ours in [true, false] {
        for batch in d.values(|r| r.batch) {
            let points: Vec<(f64, f64)> = contexts
                .iter()
                .filter_map(|&t| {
                    let key = (batch, kv, t, head_dim);
                    let read = d.ours("read", key)?.us?;
                    let us = if ours {
                        d.ours("decode", key)?.us?
                    } else {
                        d.pytorch(key)?.us?
                    };
                    Some(((t as f64).log2(), 100.0 * read / us))
                })
                .collect();
            if !points.is_empty() {
                series.push((looks(batch, ours), points));
            }
        }
    }
    let (x_lo, x_hi) = contexts.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &t| {
        let x = (t as f64).log2();
        (lo.min(x), hi.max(x))
    });
    let entries: Vec<(Look, String)> = series
        .iter()
        .map(|(l, _)| (l.clone(), l.words.clone()))
        .collect();
    chart(
        &format!("Decoding against the memory's speed ({}, bf16)", d.gpu()),
        "32 query heads on 8 kv heads, head dim 128, one query row a head",
        PLOT_HEIGHT,
        &entries,
        |root, body| {
            let e = |e: &dyn std::fmt::Display| e.to_string();
            let x_label = |x: &f64| {
                if (x - x.round()).abs() < 1e-9 {
                    format!("{}k", (2f64.powf(x.round()) as u64) / 1024)
                } else {
                    String::new()
                }
            };
            let mut plot = ChartBuilder::on(body)
                .margin_left(10)
                .margin_right(30)
                .margin_bottom(10)
                .x_label_area_size(55)
                .y_label_area_size(85)
                .build_cartesian_2d(x_lo - 0.2..x_hi + 0.2, 0.0..110.0)
                .map_err(|x| e(&x))?;
            plot.configure_mesh()
                .x_desc("tokens in the cache (log scale)")
                .y_desc("% of the read kernel's speed over the same bytes")
                .x_labels((x_hi - x_lo) as usize + 1)
                .x_label_formatter(&x_label)
                .y_label_formatter(&|y: &f64| format!("{y:.0}"))
                .light_line_style(RGBColor(0xee, 0xee, 0xee))
                .label_style(("sans-serif", 20))
                .axis_desc_style(("sans-serif", 20))
                .draw()
                .map_err(|x| e(&x))?;
            for (l, points) in &series {
                let style = if l.ours {
                    l.colour.stroke_width(2)
                } else {
                    dashed(l.colour, 2)
                };
                plot.draw_series(LineSeries::new(points.iter().copied(), style))
                    .map_err(|x| e(&x))?;
                for p in points {
                    draw_marker(root, l.marker, plot.backend_coord(p), l.colour, l.ours)?;
                }
            }
            Ok(())
        },
    )
}

/// The tables and the chart, as `(file name, text)`.
pub fn render_all(d: &Decoding) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    for head_dim in d.values(|r| r.head_dim).into_iter().rev() {
        out.push((format!("decode-d{head_dim}.md"), table(d, head_dim)));
    }
    out.push(("decode-bandwidth.svg".into(), bandwidth_chart(d)?));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(device: Option<&str>) -> DecodeRow {
        DecodeRow {
            method: "decode".into(),
            batch: 1,
            kv_heads: 8,
            context: 1024,
            head_dim: 128,
            splits: Some(8),
            us: Some(8.4),
            gb_s: Some(500.0),
            fraction_of_read: Some(0.55),
            error: None,
            device: device.map(str::to_string),
        }
    }

    #[test]
    fn the_chart_names_the_gpu_the_rows_ran_on() {
        let on = |device| Decoding {
            ours: vec![row(None), row(device)],
            pytorch: Vec::new(),
        };
        assert_eq!(
            on(Some("NVIDIA H200 (sm_90, 132 SMs, CUDA driver 13.0)")).gpu(),
            "H200"
        );
        assert_eq!(
            on(Some("NVIDIA H100 80GB HBM3 (sm_90, 132 SMs)")).gpu(),
            "H100"
        );
        assert_eq!(on(None).gpu(), "GPU");
    }

    #[test]
    fn the_table_puts_the_ratio_after_the_shape_and_a_shape_not_run_under_it() {
        let pytorch = DecodeRow {
            method: "pytorch_sdpa".into(),
            us: Some(12.6),
            ..row(None)
        };
        let too_big = DecodeRow {
            context: 8192,
            us: None,
            error: Some("the cache needs 137.4 GB and the GPU has 80.8 GB free".into()),
            ..row(None)
        };
        let d = Decoding {
            ours: vec![row(None), too_big],
            pytorch: vec![pytorch],
        };
        let t = table(&d, 128);
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[0].starts_with("| kv heads | batch | context | PyTorch's time ÷ ours |"),
            "{t}"
        );
        // 12.6 µs over 8.4 µs, then the splits and our time
        assert!(
            lines[2].starts_with("| 8 | 1 | 1,024 | 1.50× | 8 | 8.4 |"),
            "{t}"
        );
        // every row has the header's cells: the one not run says so in a word
        let cells = |l: &str| l.matches('|').count();
        assert_eq!(cells(lines[3]), cells(lines[0]), "{t}");
        assert!(lines[3].contains("| not run |"), "{t}");
        assert!(
            t.contains(
                "*Not run*: 8 kv heads, batch 1, 8,192 tokens: the cache needs 137.4 GB"
            ),
            "{t}"
        );
    }
}
