//! Step 09's masks measured, from `charts/data/masks-dD.json` (step 09's `mask-bench
//! --head-dims D --out`: the masked kernels for every mask, and step 06's `cuda_hopper`
//! beside them for the causal mask) and `charts/data/masks-peers-dD.json` (the peer script
//! `steps/09-masks/peers/flex_attention.py --head-dims D`: FlexAttention for every mask,
//! SDPA's FlashAttention-2 and cuDNN for the causal one). A head dim's two files come from
//! one device call, so the ratios within a head dim compare runs on one machine.
//!
//! - `masks-dD.md`: a row per mask, length and pass: FlexAttention's time over ours first,
//!   then ours over step 06's for the causal mask, our TFLOP/s over the scores the mask
//!   keeps, the density, and the times;
//! - `masks-dD.svg`: at the longest length, the TFLOP/s of ours and of FlexAttention for
//!   each mask, forward and forward with backward. FlexAttention computes the same scores,
//!   so its rate is our row's FLOP count over its time.

use std::fs;
use std::path::Path;

use flash_core::Device;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::Deserialize;

use crate::train::chart;
use crate::{draw_marker, failure, look, thousands, three_digits};

/// One row of `masks-dD.json` or `masks-peers-dD.json`: the fields the table and the chart
/// read.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct MaskRow {
    /// `masked`, `cuda_hopper`; the peers' `flex_attention`, `sdpa_flash`, `sdpa_cudnn`
    pub method: String,
    pub device: String,
    /// the mask as `--mask` takes it (`documents`: the benchmark's packed documents)
    pub mask: String,
    pub batch: usize,
    pub heads: usize,
    pub tokens: usize,
    pub head_dim: usize,
    pub dtype: String,
    /// `fwd` or `fwd+bwd`
    pub pass: String,
    pub ms: Option<f64>,
    /// ours only: over the scores the mask lets through
    #[serde(default)]
    pub tflops: Option<f64>,
    /// ours only: the share of the batch · heads · tokens² scores the mask lets through
    #[serde(default)]
    pub density: Option<f64>,
    /// ours only: the timed runs a row is the median of
    #[serde(default)]
    pub runs: Option<usize>,
    pub error: Option<String>,
}

/// One head dim's rows: ours and the peers', measured in one device call.
pub struct Measured {
    pub head_dim: usize,
    pub ours: Vec<MaskRow>,
    pub peers: Vec<MaskRow>,
}

/// Whether a file of `charts/data/` is one of these (its rows have keys of their own, not
/// the main set's).
pub fn is_mask_file(p: &Path) -> bool {
    p.file_name()
        .is_some_and(|f| f.to_string_lossy().starts_with("masks-"))
}

/// Each head dim's rows, from `dir/masks-dD.json` and `dir/masks-peers-dD.json`, in the
/// order of the head dims; empty where there are none (a stage before step 09).
pub fn read(dir: &Path) -> Result<Vec<Measured>, String> {
    let rows = |path: &Path| -> Result<Vec<MaskRow>, String> {
        if !path.exists() {
            return Ok(Vec::new());
        }
        let text =
            fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    };
    let mut head_dims: Vec<usize> = fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| {
            let name = e.ok()?.file_name().to_string_lossy().to_string();
            name.strip_prefix("masks-d")?
                .strip_suffix(".json")?
                .parse()
                .ok()
        })
        .collect();
    head_dims.sort_unstable();
    let mut all = Vec::new();
    for head_dim in head_dims {
        let ours = rows(&dir.join(format!("masks-d{head_dim}.json")))?;
        let peers = rows(&dir.join(format!("masks-peers-d{head_dim}.json")))?;
        if let Some(r) = ours.iter().chain(&peers).find(|r| r.head_dim != head_dim) {
            return Err(format!(
                "masks-d{head_dim}.json or masks-peers-d{head_dim}.json holds a row of head dim {}",
                r.head_dim
            ));
        }
        all.push(Measured {
            head_dim,
            ours,
            peers,
        });
    }
    Ok(all)
}

/// `(mask, tokens, pass)`
type Key<'a> = (&'a str, usize, &'a str);

impl Measured {
    fn find<'a>(
        rows: &'a [MaskRow],
        method: &str,
        (mask, tokens, pass): Key,
    ) -> Option<&'a MaskRow> {
        rows.iter().find(|r| {
            r.method == method && r.mask == mask && r.tokens == tokens && r.pass == pass
        })
    }

    fn ours(&self, key: Key) -> Option<&MaskRow> {
        Measured::find(&self.ours, "masked", key)
    }

    /// A method's milliseconds: ours (`cuda_hopper`) or a peer's.
    fn ms(&self, method: &str, key: Key) -> Option<f64> {
        Measured::find(&self.ours, method, key)
            .or_else(|| Measured::find(&self.peers, method, key))
            .and_then(|r| r.ms)
    }

    /// The masks in the order the benchmark ran them.
    fn masks(&self) -> Vec<&str> {
        let mut masks: Vec<&str> = Vec::new();
        for r in &self.ours {
            if !masks.contains(&r.mask.as_str()) {
                masks.push(&r.mask);
            }
        }
        masks
    }

    fn lengths(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.ours.iter().map(|r| r.tokens).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The GPU, by name, as the rows give it.
    fn device(&self) -> &str {
        let d = self.ours.first().map_or("", |r| r.device.as_str());
        d.split(" (").next().unwrap_or(d)
    }

    /// What every row of ours shares, for the provenance line: batch, heads, dtype, runs.
    fn shared<T: PartialEq + Copy>(&self, f: impl Fn(&MaskRow) -> T) -> Option<T> {
        let first = f(self.ours.first()?);
        self.ours.iter().all(|r| f(r) == first).then_some(first)
    }
}

/// A ratio as the tables write it.
fn times(a: Option<f64>, b: Option<f64>) -> String {
    a.zip(b)
        .filter(|(a, b)| *a > 0.0 && *b > 0.0)
        .map_or(String::new(), |(a, b)| format!("{:.2}×", a / b))
}

fn ms(v: Option<f64>) -> String {
    v.map_or(String::new(), |v| format!("{v:.3}"))
}

/// The table of one head dim, its key under it and the line that says where it comes from.
fn table(m: &Measured) -> String {
    let d = m.head_dim;
    let mut t = format!(
        "<!-- written by `cargo run -p charts` from charts/data/masks-d{d}.json and \
         charts/data/masks-peers-d{d}.json: {} -->\n\n",
        m.device()
    );
    // the answers first, so that a narrow screen shows them before the times
    t += "| mask | tokens | pass | Flex ÷ ours | ours ÷ step 06 | TFLOP/s | density \
          | ours, ms | FlexAttention, ms | FA-2, ms | cuDNN, ms |\n";
    t += &format!("|{}\n", " --- |".repeat(11));
    for mask in m.masks() {
        for tokens in m.lengths() {
            for pass in ["fwd", "fwd+bwd"] {
                let key = (mask, tokens, pass);
                let Some(ours) = m.ours(key) else {
                    continue;
                };
                let flex = m.ms("flex_attention", key);
                // step 06's kernel and SDPA's run the causal mask alone
                let causal = mask == "causal";
                let only_causal = |method: &str| {
                    if causal {
                        ms(m.ms(method, key))
                    } else {
                        String::new()
                    }
                };
                let our_ms = match (&ours.ms, &ours.error) {
                    (Some(v), _) => format!("{v:.3}"),
                    (None, Some(e)) => failure(e).to_string(),
                    (None, None) => String::new(),
                };
                t += &format!(
                    "| `{mask}` | {} | {pass} | {} | {} | {} | {} | {our_ms} | {} | {} | {} |\n",
                    thousands(&tokens.to_string()),
                    times(flex, ours.ms),
                    if causal {
                        times(ours.ms, m.ms("cuda_hopper", key))
                    } else {
                        String::new()
                    },
                    ours.tflops.map_or(String::new(), three_digits),
                    ours.density
                        .map_or(String::new(), |x| format!("{:.1}%", 100.0 * x)),
                    ms(flex),
                    only_causal("sdpa_flash"),
                    only_causal("sdpa_cudnn"),
                );
            }
        }
    }
    t += "\n*Flex ÷ ours*: FlexAttention's time over ours, above 1× ours is faster; \
          *ours ÷ step 06*: for the causal mask, our time over step 06's `cuda_hopper`, \
          what taking the mask as code costs; *TFLOP/s*: ours, counting only the scores the \
          mask lets through (4 · head dim FLOPs each forward, 3.5 times that with the \
          backward); *density*: the share of the batch · heads · tokens² scores the mask \
          lets through; *FA-2*, *cuDNN*: SDPA's FlashAttention-2 and cuDNN backends, causal \
          only; `documents`: documents of 256 + (397·i mod 1792) tokens, the i-th, packed \
          in every sequence.\n\n";
    let runs = m
        .shared(|r| r.runs)
        .flatten()
        .map_or(String::new(), |r| format!(" --runs {r}"));
    let shape = match (m.shared(|r| r.batch), m.shared(|r| r.heads)) {
        (Some(b), Some(h)) => format!("batch {b}, {h} heads, head dim {d}"),
        _ => format!("head dim {d}"),
    };
    let dtype = m
        .ours
        .first()
        .map_or(String::new(), |r| format!(", {}", r.dtype));
    t += &format!(
        "Data: `charts/data/masks-d{d}.json` and `charts/data/masks-peers-d{d}.json`, one \
         after the other on one {} ({shape}{dtype}): `cargo run --release -p step09-masks \
         --bin mask-bench -- --head-dims {d}{runs} --out charts/data/masks-d{d}.json`, then \
         `python3 steps/09-masks/peers/flex_attention.py --head-dims {d} --out \
         charts/data/masks-peers-d{d}.json`.\n",
        m.device()
    );
    t
}

/// Each panel's height: a row of markers per mask, the panel's caption and the x axis.
fn panel_height(masks: usize) -> u32 {
    40 + 36 * masks as u32 + 60
}

/// At the longest length, the TFLOP/s of ours and FlexAttention's for each mask: a panel for
/// the forward and one for the forward with the backward, on one scale.
fn rate_chart(m: &Measured) -> Result<String, String> {
    let masks = m.masks();
    let tokens = m.lengths().last().copied().unwrap_or(0);
    let (ours, flex) = (
        look("masked", Device::Cuda),
        look("flex_attention", Device::Cuda),
    );
    // each point: (mask's row, ours, FlexAttention's); FlexAttention's rate counts the
    // same scores as ours, over its own time
    let points = |pass: &str| -> Vec<(usize, Option<f64>, Option<f64>)> {
        masks
            .iter()
            .enumerate()
            .map(|(i, &mask)| {
                let key = (mask, tokens, pass);
                let ours = m.ours(key).and_then(|r| r.tflops.zip(r.ms));
                let flex = m.ms("flex_attention", key);
                let flex_rate = ours.zip(flex).map(|((rate, ms), f)| rate * ms / f);
                (i, ours.map(|(rate, _)| rate), flex_rate)
            })
            .collect()
    };
    let panels = [
        ("forward", points("fwd")),
        ("forward + backward", points("fwd+bwd")),
    ];
    let x_hi = panels
        .iter()
        .flat_map(|(_, p)| p.iter().flat_map(|&(_, a, b)| [a, b]))
        .flatten()
        .fold(1.0f64, f64::max)
        * 1.1;
    let (b, h) = (
        m.shared(|r| r.batch).unwrap_or(0),
        m.shared(|r| r.heads).unwrap_or(0),
    );
    let entries = vec![
        (ours.clone(), ours.label(flash_core::Pass::ForwardBackward)),
        (flex.clone(), flex.words.clone()),
    ];
    let n = masks.len();
    chart(
        &format!(
            "Masks as code against FlexAttention, head dim {}",
            m.head_dim
        ),
        &format!(
            "{}, batch {b} × {h} heads × {} tokens, {}",
            m.device(),
            thousands(&tokens.to_string()),
            m.ours.first().map_or("", |r| r.dtype.as_str())
        ),
        2 * panel_height(n),
        &entries,
        |root, body| {
            let e = |e: &dyn std::fmt::Display| e.to_string();
            let (top, bottom) = body.split_vertically(panel_height(n));
            for (area, (caption, points)) in [top, bottom].iter().zip(&panels) {
                let mut plot = ChartBuilder::on(area)
                    .caption(*caption, ("sans-serif", 22))
                    .margin_left(10)
                    .margin_right(30)
                    .x_label_area_size(55)
                    .y_label_area_size(200)
                    .build_cartesian_2d(0.0..x_hi, -0.6..(n as f64 - 0.4))
                    .map_err(|x| e(&x))?;
                plot.configure_mesh()
                    .disable_y_mesh()
                    .y_labels(0)
                    .x_desc("TFLOP/s over the kept scores (4 · head dim FLOPs each forward, ×3.5 with backward)")
                    .x_label_formatter(&|x: &f64| format!("{x:.0}"))
                    .light_line_style(RGBColor(0xee, 0xee, 0xee))
                    .label_style(("sans-serif", 20))
                    .axis_desc_style(("sans-serif", 20))
                    .draw()
                    .map_err(|x| e(&x))?;
                for &(i, a, f) in points {
                    // the first mask at the top
                    let y = (n - 1 - i) as f64;
                    let (lx, ly) = plot.backend_coord(&(0.0, y));
                    root.draw_text(
                        masks[i],
                        &TextStyle::from(("sans-serif", 20).into_font())
                            .color(&BLACK)
                            .pos(Pos::new(HPos::Right, VPos::Center)),
                        (lx - 12, ly),
                    )
                    .map_err(|x| e(&x))?;
                    // a thin line between the two: the gap is what the chart is read for
                    if let (Some(a), Some(f)) = (a, f) {
                        plot.draw_series(LineSeries::new(
                            [(a, y), (f, y)],
                            RGBColor(0xbb, 0xbb, 0xbb).stroke_width(2),
                        ))
                        .map_err(|x| e(&x))?;
                    }
                    for (v, l) in [(f, &flex), (a, &ours)] {
                        if let Some(v) = v {
                            let p = plot.backend_coord(&(v, y));
                            draw_marker(root, l.marker, p, l.colour, l.ours)?;
                        }
                    }
                }
            }
            Ok(())
        },
    )
}

/// Each head dim's table and chart, as `(file name, text)`.
pub fn render_all(measured: &[Measured]) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    for m in measured {
        out.push((format!("masks-d{}.md", m.head_dim), table(m)));
        out.push((format!("masks-d{}.svg", m.head_dim), rate_chart(m)?));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Look;

    fn row(method: &str, mask: &str, pass: &str, ms: f64, tflops: Option<f64>) -> MaskRow {
        MaskRow {
            method: method.into(),
            device: "Test GPU (sm_90, 132 SMs)".into(),
            mask: mask.into(),
            batch: 4,
            heads: 12,
            tokens: 16384,
            head_dim: 64,
            dtype: "bf16".into(),
            pass: pass.into(),
            ms: Some(ms),
            tflops,
            density: tflops.map(|_| if mask == "causal" { 0.5 } else { 0.06 }),
            runs: tflops.map(|_| 10),
            error: None,
        }
    }

    fn sample() -> Measured {
        Measured {
            head_dim: 64,
            ours: vec![
                row("masked", "causal", "fwd", 4.0, Some(400.0)),
                row("cuda_hopper", "causal", "fwd", 3.2, Some(500.0)),
                row("masked", "sliding:1024", "fwd", 1.0, Some(200.0)),
            ],
            peers: vec![
                row("flex_attention", "causal", "fwd", 5.0, None),
                row("sdpa_flash", "causal", "fwd", 6.0, None),
                row("sdpa_cudnn", "causal", "fwd", 3.0, None),
                row("flex_attention", "sliding:1024", "fwd", 0.5, None),
            ],
        }
    }

    #[test]
    fn the_table_puts_the_ratios_first_and_says_where_it_comes_from() {
        let t = table(&sample());
        let lines: Vec<&str> = t.lines().filter(|l| l.starts_with('|')).collect();
        assert_eq!(lines.len(), 4, "{t}");
        assert!(lines[0].starts_with("| mask | tokens | pass | Flex ÷ ours |"));
        assert_eq!(lines[0].matches('|').count(), lines[1].matches('|').count());
        assert_eq!(lines[0].matches('|').count(), lines[2].matches('|').count());
        // FlexAttention 5 ms over our 4: 1.25×; ours over step 06's 3.2 ms: 1.25×
        assert!(
            lines[2].starts_with(
                "| `causal` | 16,384 | fwd | 1.25× | 1.25× | 400 | 50.0% | 4.000 | 5.000 | \
                 6.000 | 3.000 |"
            ),
            "{t}"
        );
        // behind FlexAttention where it is, and no step 06 or SDPA beside a sliding window
        assert!(
            lines[3]
                .starts_with("| `sliding:1024` | 16,384 | fwd | 0.50× |  | 200 | 6.0% |"),
            "{t}"
        );
        assert!(lines[3].ends_with("| 1.000 | 0.500 |  |  |"), "{t}");
        assert!(
            t.contains("--head-dims 64 --runs 10 --out charts/data/masks-d64.json")
                && t.contains("flex_attention.py --head-dims 64 --out")
                && t.contains("one Test GPU (batch 4, 12 heads, head dim 64, bf16)"),
            "{t}"
        );
    }

    #[test]
    fn the_chart_draws_flexattention_at_our_count_of_the_scores() {
        let m = sample();
        let svg = rate_chart(&m).unwrap();
        assert!(
            svg.starts_with("<svg width=\"100%\" viewBox=\"0 0 900 "),
            "{}",
            &svg[..80]
        );
        for text in [
            "sliding:1024",
            "causal",
            "forward + backward",
            "FlexAttention",
        ] {
            assert!(svg.contains(text), "{text:?} missing");
        }
        // one colour for each, ours filled and FlexAttention's hollow
        let hex =
            |l: &Look| format!("#{:02X}{:02X}{:02X}", l.colour.0, l.colour.1, l.colour.2);
        let (ours, flex) = (
            look("masked", Device::Cuda),
            look("flex_attention", Device::Cuda),
        );
        assert!(ours.ours && !flex.ours);
        assert!(svg.contains(&hex(&ours)) && svg.contains(&hex(&flex)));
    }

    #[test]
    fn the_head_dims_files_are_read_together() {
        let dir = std::env::temp_dir().join(format!("charts-masks-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        assert!(read(&dir).unwrap().is_empty(), "no files: nothing to draw");
        let m = sample();
        let json = |rows: &[MaskRow]| {
            let items: Vec<String> = rows
                .iter()
                .map(|r| {
                    format!(
                        r#"{{"method":"{}","device":"{}","mask":"{}","batch":4,"heads":12,
                           "tokens":16384,"head_dim":64,"dtype":"bf16","pass":"{}","ms":{},
                           "error":null}}"#,
                        r.method,
                        r.device,
                        r.mask,
                        r.pass,
                        r.ms.unwrap()
                    )
                })
                .collect();
            format!("[{}]", items.join(",\n"))
        };
        fs::write(dir.join("masks-d64.json"), json(&m.ours)).unwrap();
        fs::write(dir.join("masks-peers-d64.json"), json(&m.peers)).unwrap();
        let read = read(&dir).unwrap();
        assert_eq!(read.len(), 1);
        assert_eq!(
            (read[0].head_dim, read[0].ours.len(), read[0].peers.len()),
            (64, 3, 4)
        );
        // a row of another head dim in a head dim's file is refused
        fs::write(dir.join("masks-d128.json"), json(&m.ours)).unwrap();
        let err = super::read(&dir).err().unwrap();
        assert!(
            err.contains("masks-d128.json") && err.contains("head dim 64"),
            "{err}"
        );
        fs::remove_dir_all(dir).unwrap();
    }
}
