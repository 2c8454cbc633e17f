//! # The charts
//!
//! Reads the benchmark's rows (`charts/data/*.json`, written by `cargo run --release -- --out`
//! and by `charts/peers/pytorch_peers.py`) and draws SVG charts with plotters:
//!
//! - CPU: peak memory against length, and time against length, both on log scales (one pair
//!   for each pass found, `fwd` and `fwd+bwd`);
//! - GPU: TFLOP/s against length, one chart for `fwd` and one for `fwd+bwd`;
//! - for each of those groups, the rows as a Markdown table (`cpu.md`, `gpu-fwd.md`, ...) that the
//!   book includes, so the book's numbers are the JSON's.
//!
//! The drawing is a pure function of the rows: the same JSON gives byte-identical SVG, so
//! regenerating the committed charts shows no diff (a test checks both).
//!
//! ## Layout
//!
//! - [`read_dir`]: the rows of every JSON file, as the shared core's [`Row`].
//! - [`render_all`]: every chart and table the rows call for, as `(file name, text)`.

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;

pub use flash_core::Row;
use flash_core::{Device, Pass, row};
use plotters::prelude::*;

/// Every row of every `*.json` file in `dir`, the files taken in name order.
pub fn read_dir(dir: &Path) -> Result<Vec<Row>, String> {
    let mut files: Vec<_> = fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    let mut rows = Vec::new();
    for f in files {
        let text = fs::read_to_string(&f).map_err(|e| format!("{}: {e}", f.display()))?;
        rows.extend(row::from_json(&text, &f.display().to_string())?);
    }
    Ok(rows)
}

/// What one chart plots against the length.
#[derive(Clone, Copy)]
enum Quantity {
    PeakMemory,
    Time,
    Tflops,
}

impl Quantity {
    fn value(self, row: &Row) -> Option<f64> {
        match self {
            Quantity::PeakMemory => row.peak_bytes.map(|b| b as f64 / 1e6),
            Quantity::Time => row.ms,
            Quantity::Tflops => row.tflops,
        }
        .filter(|v| v.is_finite() && *v > 0.0)
    }

    fn title(self) -> &'static str {
        match self {
            Quantity::PeakMemory => "Peak memory above the inputs",
            Quantity::Time => "Time per call",
            Quantity::Tflops => "Throughput",
        }
    }

    fn axis(self) -> &'static str {
        match self {
            Quantity::PeakMemory => "peak memory above the inputs (MB, log scale)",
            Quantity::Time => "time per call (ms, log scale)",
            Quantity::Tflops => "TFLOP/s (4·B·H·T²·D/2 per forward, ×3.5 with backward)",
        }
    }

    fn log(self) -> bool {
        !matches!(self, Quantity::Tflops)
    }
}

/// Every chart the rows call for, as `(file name, SVG)`, and the book's table of each group of
/// rows, as `(file name, Markdown)`, in a fixed order.
pub fn render_all(rows: &[Row]) -> Result<Vec<(String, String)>, String> {
    let mut charts = Vec::new();
    for &pass in Pass::ALL {
        let suffix = if pass == Pass::Forward {
            ""
        } else {
            "-fwd-bwd"
        };
        let cpu: Vec<&Row> = rows
            .iter()
            .filter(|r| r.device_kind == Device::Cpu && r.pass == pass)
            .collect();
        if !cpu.is_empty() {
            charts.push((
                format!("cpu-peak-memory{suffix}.svg"),
                render(&cpu, Quantity::PeakMemory)?,
            ));
            charts.push((
                format!("cpu-time{suffix}.svg"),
                render(&cpu, Quantity::Time)?,
            ));
            charts.push((format!("cpu{suffix}.md"), table(&cpu, "pytorch_sdpa")));
        }
        let gpu: Vec<&Row> = rows
            .iter()
            .filter(|r| r.device_kind != Device::Cpu && r.pass == pass)
            .collect();
        if !gpu.is_empty() {
            let name = if pass == Pass::Forward {
                "fwd"
            } else {
                "fwd-bwd"
            };
            charts.push((
                format!("gpu-tflops-{name}.svg"),
                render(&gpu, Quantity::Tflops)?,
            ));
            charts.push((format!("gpu-{name}.md"), table(&gpu, "pytorch_sdpa_flash")));
        }
    }
    Ok(charts)
}

/// The rows as a Markdown table for the book, first line the command that writes it; `peer` is
/// the method whose time each row is compared with at the same length (above 1: faster).
fn table(rows: &[&Row], peer: &str) -> String {
    let cuda = rows[0].device_kind != Device::Cpu;
    let mut md = format!(
        "<!-- written by `cargo run -p charts` from charts/data/*.json: {} -->\n\n\
         | method | tokens | ms | {} | peak MB | speed vs {peer} | note |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | --- |\n",
        distinct(rows, |r| r.device.clone()),
        if cuda { "TFLOP/s" } else { "GFLOP/s" }
    );
    let order = method_order(rows);
    let mut sorted: Vec<&&Row> = rows.iter().collect();
    sorted.sort_by_key(|r| (r.tokens, order.iter().position(|m| *m == r.method)));
    for r in sorted {
        let peer_ms = rows
            .iter()
            .find(|p| p.method == peer && p.tokens == r.tokens)
            .and_then(|p| p.ms);
        let cell = |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map_or("–".to_string(), f);
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            r.method,
            r.tokens,
            cell(r.ms, &|v| format!("{v:.2}")),
            cell(r.tflops, &|v| format!(
                "{:.1}",
                if cuda { v } else { v * 1e3 }
            )),
            cell(r.peak_bytes.map(|b| b as f64), &|v| format!(
                "{:.1}",
                v / 1e6
            )),
            cell(peer_ms.zip(r.ms).map(|(p, m)| p / m), &|v| format!(
                "{v:.2}×"
            )),
            r.error.as_deref().unwrap_or("").replace('|', "/"),
        ));
    }
    md
}

/// The methods in the order of the data, ours before the peers (`pytorch_*`), so that colours
/// and table rows do not depend on how the files are named.
fn method_order<'a>(rows: &[&'a Row]) -> Vec<&'a str> {
    let mut methods: Vec<&str> = Vec::new();
    for r in rows {
        if !methods.contains(&r.method.as_str()) {
            methods.push(&r.method);
        }
    }
    methods.sort_by_key(|m| m.starts_with("pytorch"));
    methods
}

/// The distinct values of a field, in first-seen order, joined for a title.
fn distinct<'a>(rows: &[&'a Row], field: impl Fn(&'a Row) -> String) -> String {
    let mut seen = Vec::new();
    for r in rows {
        let v = field(r);
        if !seen.contains(&v) {
            seen.push(v);
        }
    }
    seen.join(" / ")
}

// Colours fixed by a method's place in the data, so a chart does not change colour between runs.
const PALETTE: [RGBColor; 8] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
];

/// `1234.5` → `1235`, `12.3` → `12`, `2.5`, `0.12`: enough digits to read, an exponent only
/// below 0.01.
fn short_number(v: f64) -> String {
    if v >= 10.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else if v >= 0.01 {
        format!("{v:.2}")
    } else if v == 0.0 {
        "0".into()
    } else {
        format!("{v:.0e}")
    }
}

fn render(rows: &[&Row], q: Quantity) -> Result<String, String> {
    let pass = &rows[0].pass;
    let title = format!(
        "{}, causal {}",
        q.title(),
        if *pass == Pass::Forward {
            "forward"
        } else {
            "forward + backward"
        }
    );
    let subtitle = format!(
        "{} · batch {}, heads {}, head dim {} · {}",
        // the machine's name; the table under each chart carries the full descriptions
        distinct(rows, |r| r
            .device
            .split(" (")
            .next()
            .unwrap_or(&r.device)
            .to_string()),
        distinct(rows, |r| r.batch.to_string()),
        distinct(rows, |r| r.heads.to_string()),
        distinct(rows, |r| r.head_dim.to_string()),
        distinct(rows, |r| r.dtype.to_string()),
    );

    // one series per method; failed lengths noted in the legend
    let methods = method_order(rows);
    let series: Vec<(String, Vec<(f64, f64)>)> = methods
        .iter()
        .map(|&m| {
            let mine: Vec<&&Row> = rows.iter().filter(|r| r.method == m).collect();
            let mut points: Vec<(f64, f64)> = mine
                .iter()
                .filter_map(|r| q.value(r).map(|v| ((r.tokens as f64).log2(), v)))
                .collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            let failed: BTreeSet<usize> = mine
                .iter()
                .filter(|r| r.error.is_some())
                .map(|r| r.tokens)
                .collect();
            let label = match failed.first() {
                Some(t)
                    if mine.iter().any(|r| {
                        r.error
                            .as_deref()
                            .is_some_and(|e| e.contains("out of memory"))
                    }) =>
                {
                    format!("{m} (out of memory at {t} tokens)")
                }
                Some(t) => format!("{m} (failed at {t} tokens)"),
                None => m.to_string(),
            };
            (label, points)
        })
        .collect();

    let xs: Vec<f64> = rows.iter().map(|r| (r.tokens as f64).log2()).collect();
    let (x_lo, x_hi) = (
        xs.iter().copied().fold(f64::INFINITY, f64::min) - 0.25,
        xs.iter().copied().fold(f64::NEG_INFINITY, f64::max) + 0.25,
    );
    let ys: Vec<f64> = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|&(_, y)| y))
        .collect();
    let (mut y_lo, mut y_hi) = (
        ys.iter().copied().fold(f64::INFINITY, f64::min),
        ys.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    );
    if ys.is_empty() {
        (y_lo, y_hi) = (1.0, 10.0);
    }

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 560)).into_drawing_area();
        let e = |e: &dyn std::fmt::Display| e.to_string();
        root.fill(&WHITE).map_err(|x| e(&x))?;
        let (top, body) = root.split_vertically(62);
        top.draw_text(
            &title,
            &TextStyle::from(("sans-serif", 27).into_font()).color(&BLACK),
            (20, 10),
        )
        .map_err(|x| e(&x))?;
        top.draw_text(
            &subtitle,
            &TextStyle::from(("sans-serif", 19).into_font()).color(&RGBColor(0x44, 0x44, 0x44)),
            (20, 38),
        )
        .map_err(|x| e(&x))?;

        let x_label = |x: &f64| {
            if (x - x.round()).abs() < 1e-9 {
                format!("{}", 2f64.powf(x.round()) as u64)
            } else {
                String::new()
            }
        };
        let ticks = (x_hi.floor() - x_lo.ceil()) as usize + 1;
        macro_rules! draw {
            ($chart:expr) => {{
                let mut chart = $chart;
                chart
                    .configure_mesh()
                    .x_desc("sequence length (tokens, log scale)")
                    .y_desc(q.axis())
                    .x_labels(ticks)
                    .x_label_formatter(&x_label)
                    .y_label_formatter(&|y: &f64| short_number(*y))
                    .light_line_style(RGBColor(0xee, 0xee, 0xee))
                    .label_style(("sans-serif", 17))
                    .axis_desc_style(("sans-serif", 18))
                    .draw()
                    .map_err(|x| e(&x))?;
                for (i, (label, points)) in series.iter().enumerate() {
                    let color = PALETTE[i % PALETTE.len()];
                    chart
                        .draw_series(LineSeries::new(
                            points.iter().copied(),
                            color.stroke_width(2),
                        ))
                        .map_err(|x| e(&x))?
                        .label(label.as_str())
                        .legend(move |(x, y)| {
                            PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                        });
                    chart
                        .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
                        .map_err(|x| e(&x))?;
                }
                chart
                    .configure_series_labels()
                    .position(SeriesLabelPosition::UpperLeft)
                    .background_style(WHITE.mix(0.9))
                    .border_style(RGBColor(0xcc, 0xcc, 0xcc))
                    .label_font(("sans-serif", 17))
                    .draw()
                    .map_err(|x| e(&x))?;
            }};
        }
        let mut builder = ChartBuilder::on(&body);
        builder
            .margin_left(10)
            .margin_right(30)
            .margin_bottom(10)
            .x_label_area_size(50)
            .y_label_area_size(80);
        if q.log() {
            let y = (y_lo / 2.0)..(y_hi * 2.0);
            draw!(
                builder
                    .build_cartesian_2d(x_lo..x_hi, y.log_scale())
                    .map_err(|x| e(&x))?
            );
        } else {
            draw!(
                builder
                    .build_cartesian_2d(x_lo..x_hi, 0.0..y_hi * 1.15)
                    .map_err(|x| e(&x))?
            );
        }
        root.present().map_err(|x| e(&x))?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(method: &str, kind: &str, pass: &str, tokens: u64, v: Option<f64>) -> String {
        let v_int = v.map_or("null".into(), |v| (v as u64).to_string());
        let v = v.map_or("null".into(), |v| v.to_string());
        let error = if v == "null" {
            "\"out of memory: the table needs 3.2 GB\""
        } else {
            "null"
        };
        format!(
            r#"{{"method":"{method}","device":"Test CPU (2 threads)","device_kind":"{kind}",
               "tokens":{tokens},"batch":1,"heads":12,"head_dim":64,"dtype":"f32","pass":"{pass}",
               "ms":{v},"tflops":{v},"peak_bytes":{v_int},"error":{error},"implementation":"",
               "runs":1,"commit":"abc","date":"2026-11-30T00:00:00Z"}}"#
        )
    }

    fn sample() -> Vec<Row> {
        let mut items = Vec::new();
        for t in [1024u64, 2048, 4096, 8192] {
            let x = t as f64;
            items.push(row("naive", "cpu", "fwd", t, (t < 8192).then_some(x * x)));
            items.push(row("online", "cpu", "fwd", t, Some(x * 3.0)));
            // [step 04]
            items.push(row("flash", "cuda", "fwd+bwd", t, Some(x / 100.0)));
            // [/step 04]
        }
        row::from_json(&format!("[{}]", items.join(",")), "sample").unwrap()
    }

    #[test]
    fn same_rows_give_byte_identical_charts() {
        let rows = sample();
        let a = render_all(&rows).unwrap();
        let b = render_all(&rows).unwrap();
        let names: Vec<&str> = a.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "cpu-peak-memory.svg",
                "cpu-time.svg",
                "cpu.md",
                // [step 04]
                "gpu-tflops-fwd-bwd.svg",
                "gpu-fwd-bwd.md",
                // [/step 04]
            ]
        );
        assert_eq!(a, b);
    }

    #[test]
    fn charts_carry_readable_text() {
        let charts = render_all(&sample()).unwrap();
        let (_, memory) = &charts[0];
        for text in [
            "Peak memory above the inputs, causal forward",
            // the machine by name; the full description is in the table under the chart
            "Test CPU · batch 1",
            "batch 1, heads 12, head dim 64",
            "f32",
            "sequence length (tokens, log scale)",
            "MB, log scale",
            "naive (out of memory at 8192 tokens)",
            "\nonline\n",
            "\n4096\n",
        ] {
            assert!(memory.contains(text), "{text:?} missing from the SVG");
        }
        assert!(memory.matches("<text").count() > 10);
        // [step 04]
        assert!(charts[3].1.contains("forward + backward"));
        // [/step 04]
        let md = &charts[2].1;
        assert!(
            md.starts_with("<!-- written by `cargo run -p charts`"),
            "{md}"
        );
        // naive at 4096 in the sample: 4096² ms, and no pytorch_sdpa row to compare with
        assert!(md.contains("| naive | 4096 | 16777216.00 |"), "{md}");
        assert!(md.contains("| – |") && md.contains("out of memory"), "{md}");
    }

    #[test]
    fn committed_charts_are_regenerated_from_committed_data() {
        // tests run in their package's folder: charts/ in this checkout, wherever it was built
        let dir = Path::new(".");
        if !dir.join("data").is_dir() {
            // step 01 measures nothing yet: chapter 2 brings the first measurements
            println!("no charts/data/ in this stage: no charts to regenerate");
            return;
        }
        let rows = read_dir(&dir.join("data")).unwrap();
        for (name, svg) in render_all(&rows).unwrap() {
            let committed = fs::read_to_string(dir.join(&name)).unwrap_or_default();
            assert!(
                committed == svg,
                "charts/{name} is not what charts/data/ gives: run `cargo run -p charts`"
            );
        }
    }
}
