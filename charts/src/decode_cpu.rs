//! Step 08's decoding on the CPU, from `charts/data/decode-cpu.json` (step 08's `decode-cpu
//! --out`: each rung of CPU decoding and the read loop over the same bytes) and
//! `charts/data/decode-cpu-pytorch.json` (the PyTorch peer's `--decode --device cpu`).
//!
//! - `decode-cpu.md`: a row per head dim, kv heads and context: each rung's time, the last
//!   rung's GB/s and share of the read loop's speed, the read loop's GB/s, PyTorch's time
//!   and its time over the last rung's;
//! - `decode-cpu.svg`: at each head dim and kv head count, the share of the read loop's
//!   speed against the context, each rung and PyTorch.

use std::fs;
use std::path::Path;

use plotters::prelude::*;
use serde::Deserialize;

use crate::train::chart;
use crate::{Look, Marker, PLOT_HEIGHT, dashed, draw_marker, thousands};

/// The rungs, in the order the chapter climbs them: the method their rows carry, and the
/// words of the table's header and the chart's legend.
pub const RUNGS: [(&str, &str); 4] = [
    ("decode", "1 `decode`"),
    ("decode_grouped", "2 `decode_grouped`"),
    ("decode_simd", "3 `decode_simd`"),
    ("decode_threads", "4 `decode_threads`"),
];

/// One row of `decode-cpu.json` or `decode-cpu-pytorch.json`: the fields the table and the
/// chart read.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct DecodeRow {
    /// a rung's name, `read_cpu`; PyTorch's rows name their own
    pub method: String,
    pub batch: usize,
    pub kv_heads: usize,
    pub context: usize,
    pub head_dim: usize,
    /// bytes of k and v
    pub bytes: u64,
    pub us: Option<f64>,
    pub gb_s: Option<f64>,
    pub fraction_of_read: Option<f64>,
    pub error: Option<String>,
}

/// Our rows and PyTorch's.
pub struct CpuDecoding {
    pub ours: Vec<DecodeRow>,
    pub pytorch: Vec<DecodeRow>,
}

/// The rows of `dir/decode-cpu.json` and `dir/decode-cpu-pytorch.json`, or `None` where
/// there are none (a stage before step 08).
pub fn read(dir: &Path) -> Result<Option<CpuDecoding>, String> {
    let rows = |name: &str| -> Result<Vec<DecodeRow>, String> {
        let path = dir.join(name);
        if !path.exists() {
            return Ok(Vec::new());
        }
        let text =
            fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    };
    let (ours, pytorch) = (rows("decode-cpu.json")?, rows("decode-cpu-pytorch.json")?);
    Ok((!ours.is_empty()).then_some(CpuDecoding { ours, pytorch }))
}

/// `(batch, kv heads, context, head dim)`
type Key = (usize, usize, usize, usize);

impl CpuDecoding {
    fn ours(&self, method: &str, key: Key) -> Option<&DecodeRow> {
        self.ours.iter().find(|r| {
            r.method == method && (r.batch, r.kv_heads, r.context, r.head_dim) == key
        })
    }

    fn pytorch(&self, key: Key) -> Option<&DecodeRow> {
        self.pytorch
            .iter()
            .find(|r| (r.batch, r.kv_heads, r.context, r.head_dim) == key)
    }

    /// Sorted distinct values of a field of our rows.
    fn values(&self, f: impl Fn(&DecodeRow) -> usize) -> Vec<usize> {
        let mut v: Vec<usize> = self.ours.iter().map(f).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The rungs that have rows.
    fn rungs(&self) -> Vec<(&'static str, &'static str)> {
        RUNGS
            .into_iter()
            .filter(|(m, _)| self.ours.iter().any(|r| r.method == *m))
            .collect()
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

/// The table: a row per head dim, kv heads, batch and context.
fn table(d: &CpuDecoding) -> String {
    let rungs = d.rungs();
    let Some(&(last, _)) = rungs.last() else {
        return String::new();
    };
    // a column for the batch only where the rows hold several
    let batches = d.values(|r| r.batch).len() > 1;
    let mut t = String::from("| head dim | kv heads |");
    if batches {
        t += " batch |";
    }
    // the two answers first, so that a narrow screen shows them before the times
    t += " context | PyTorch's time ÷ ours | of the read loop | cache, MB |";
    for (_, words) in &rungs {
        t += &format!(" {words}, ms |");
    }
    t += " GB/s | read loop, GB/s | PyTorch, ms |\n|";
    t += &" --- |".repeat(4 + usize::from(batches) + rungs.len() + 5);
    t += "\n";
    for head_dim in d.values(|r| r.head_dim) {
        // plain heads first, then grouped ones, as the chapter reads them
        for kv in d.values(|r| r.kv_heads).into_iter().rev() {
            for batch in d.values(|r| r.batch) {
                for context in d.values(|r| r.context) {
                    let key = (batch, kv, context, head_dim);
                    let Some(ours) = d.ours(last, key) else {
                        continue;
                    };
                    t += &format!("| {head_dim} | {kv} |");
                    if batches {
                        t += &format!(" {batch} |");
                    }
                    let read = d.ours("read_cpu", key).and_then(|r| r.gb_s);
                    let pt = d.pytorch(key).and_then(|r| r.us);
                    t += &format!(
                        " {} | {} | {} | {} |",
                        number(context as f64, 0),
                        pt.zip(ours.us)
                            .map_or(String::new(), |(p, us)| format!("{:.2}×", p / us)),
                        ours.fraction_of_read
                            .map_or(String::new(), |f| format!("{:.0}%", f * 100.0)),
                        number(ours.bytes as f64 / 1e6, 1)
                    );
                    for (m, _) in &rungs {
                        let cell = match d.ours(m, key) {
                            Some(r) => match (r.us, &r.error) {
                                (Some(us), _) => number(us / 1e3, 2),
                                (None, Some(e)) => e.clone(),
                                (None, None) => "no time".into(),
                            },
                            None => String::new(),
                        };
                        t += &format!(" {cell} |");
                    }
                    t += &format!(
                        " {} | {} | {} |\n",
                        ours.gb_s.map_or(String::new(), |g| number(g, 1)),
                        read.map_or(String::new(), |g| number(g, 1)),
                        pt.map_or(String::new(), |p| number(p / 1e3, 2)),
                    );
                }
            }
        }
    }
    t
}

/// Each rung in one colour of our family, darker as it climbs; PyTorch in the peers'.
fn look(rung: usize, words: &str) -> Look {
    let (colour, marker, ours) = match rung {
        0 => (RGBColor(0x9e, 0xca, 0xe1), Marker::Circle, true),
        1 => (RGBColor(0x42, 0x92, 0xc6), Marker::Square, true),
        2 => (RGBColor(0x21, 0x71, 0xb5), Marker::Triangle, true),
        3 => (RGBColor(0x08, 0x30, 0x6b), Marker::Diamond, true),
        _ => (RGBColor(0xe6, 0x55, 0x0d), Marker::Square, false),
    };
    Look {
        rank: rung,
        ours,
        colour,
        marker,
        short: words.to_string(),
        words: words.to_string(),
        step: ours.then_some(8),
        same_memory_as: None,
    }
}

/// The share of the read loop's speed against the context, one panel's worth: the rungs
/// and PyTorch at one head dim and kv head count.
fn bandwidth_chart(d: &CpuDecoding, head_dim: usize, kv: usize) -> Result<String, String> {
    let contexts = d.values(|r| r.context);
    let batch = d.values(|r| r.batch).first().copied().unwrap_or(1);
    let read_us = |t: usize| d.ours("read_cpu", (batch, kv, t, head_dim))?.us;
    let mut series: Vec<(Look, Vec<(f64, f64)>)> = Vec::new();
    let rungs = d.rungs();
    for (i, (m, words)) in rungs.iter().enumerate() {
        let points: Vec<(f64, f64)> = contexts
            .iter()
            .filter_map(|&t| {
                let us = d.ours(m, (batch, kv, t, head_dim))?.us?;
                Some(((t as f64).log2(), 100.0 * read_us(t)? / us))
            })
            .collect();
        let words = format!("rung {}", words.replace('`', ""));
        series.push((look(i, &words), points));
    }
    let points: Vec<(f64, f64)> = contexts
        .iter()
        .filter_map(|&t| {
            let us = d.pytorch((batch, kv, t, head_dim))?.us?;
            Some(((t as f64).log2(), 100.0 * read_us(t)? / us))
        })
        .collect();
    if !points.is_empty() {
        series.push((look(RUNGS.len(), "PyTorch SDPA (CPU)"), points));
    }
    let y_hi = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|p| p.1))
        .fold(100.0f64, f64::max)
        * 1.1;
    let (x_lo, x_hi) = contexts.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &t| {
        let x = (t as f64).log2();
        (lo.min(x), hi.max(x))
    });
    let entries: Vec<(Look, String)> = series
        .iter()
        .map(|(l, _)| (l.clone(), l.words.clone()))
        .collect();
    let heads = if kv == 32 {
        "32 query heads, 32 kv heads".to_string()
    } else {
        format!("32 query heads on {kv} kv heads")
    };
    chart(
        "Decoding on the CPU against the memory's speed (f32)",
        &format!("{heads}, head dim {head_dim}, one query row a head, batch {batch}"),
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
                .build_cartesian_2d(x_lo - 0.2..x_hi + 0.2, 0.0..y_hi)
                .map_err(|x| e(&x))?;
            plot.configure_mesh()
                .x_desc("tokens in the cache (log scale)")
                .y_desc("% of the read loop's speed over the same bytes")
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

/// The table, and the chart at the largest head dim with grouped heads, as `(file name,
/// text)`.
pub fn render_all(d: &CpuDecoding) -> Result<Vec<(String, String)>, String> {
    let mut out = vec![("decode-cpu.md".to_string(), table(d))];
    let (head_dim, kv) = (
        d.values(|r| r.head_dim).last().copied().unwrap_or(128),
        // grouped heads: the fewest kv heads above one (one is multi-query attention)
        d.values(|r| r.kv_heads)
            .into_iter()
            .find(|&kv| kv > 1)
            .unwrap_or(1),
    );
    out.push(("decode-cpu.svg".into(), bandwidth_chart(d, head_dim, kv)?));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(method: &str, context: usize, us: f64) -> DecodeRow {
        DecodeRow {
            method: method.into(),
            batch: 1,
            kv_heads: 8,
            context,
            head_dim: 128,
            bytes: 8_388_608 * context as u64 / 1024,
            us: Some(us),
            gb_s: Some(8.4e6 * context as f64 / 1024.0 / us / 1e3),
            fraction_of_read: Some(0.5),
            error: None,
        }
    }

    #[test]
    fn the_table_has_a_column_per_rung_and_the_ratio_to_pytorch() {
        let d = CpuDecoding {
            ours: vec![
                row("decode", 1024, 4000.0),
                row("decode_threads", 1024, 1000.0),
                row("read_cpu", 1024, 500.0),
            ],
            pytorch: vec![row("pytorch_sdpa", 1024, 1500.0)],
        };
        let t = table(&d);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(
            lines[0].contains("1 `decode`, ms")
                && lines[0].contains("4 `decode_threads`, ms")
        );
        assert!(
            !lines[0].contains("decode_simd"),
            "rungs without rows have no column"
        );
        assert_eq!(lines[0].matches('|').count(), lines[1].matches('|').count());
        assert!(
            lines[2].contains("| 1,024 | 1.50× | 50% |")
                && lines[2].contains("| 4.00 | 1.00 |")
                && lines[2].ends_with("| 1.50 |"),
            "the ratio and the share of the read loop first, the times after: {t}"
        );
        let svg = bandwidth_chart(&d, 128, 8).unwrap();
        assert!(
            svg.contains("PyTorch SDPA (CPU)") && svg.contains("rung 4 decode_threads")
        );
    }
}
