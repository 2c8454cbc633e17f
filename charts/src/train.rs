//! Step 05's charts: training runs, ours and PyTorch's, from their run records
//! (`charts/data/train-*.json`, written by `step05-train train --out` and by
//! `steps/05-train/peers/gpt_pytorch.py --out`, in the one schema of `RunRecord`).
//!
//! For each device the runs were made on (`train-cpu-*`, `train-gpu-*`):
//!
//! - the loss against the step: the training loss of every step as a line, the held-out
//!   losses as markers; ours with our flash attention beside PyTorch's with
//!   FlashAttention-2 and with its default attention (eager), the runs that share weights
//!   and batches;
//! - tokens a second, a bar per run; and peak memory, a bar per run that measured it;
//! - a table with a row per run (`train-cpu.md`, ...): speed, against ours, memory, the
//!   last held-out loss, and how far its losses are from ours at the same steps.
//!
//! A run looks as its attention does in every other chart: ours in blues and greens,
//! filled; PyTorch's in oranges, reds and greys, hollow (the looks of `STYLES` in
//! `lib.rs`).
//!
//! ## Layout
//!
//! - [`read_runs`]: the run records of `charts/data/train-*.json`.
//! - [`render_all`]: every training chart and table the runs call for.
//! - [`precision`]: our GPU run beside PyTorch's rounded three ways
//!   (`train-precision-*.json`).
//! - [`parallel`]: step 07's, of the runs on one GPU and on several (`train-dp-*.json`). // [step 07]
//! - [`kv_heads`]: step 08's, of the model with grouped heads (`train-kv-heads-*.json`). // [step 08]

use std::fs;
use std::path::Path;

use flash_core::timing::median;
use flash_core::{Device, Pass};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::Deserialize;
use serde::de::DeserializeOwned;

use super::{
    LEGEND_ROW, Look, PLOT_HEIGHT, WIDTH, dashed, draw_legend_entry, draw_marker, look,
    scalable,
};

pub mod kv_heads; // [step 08]
pub mod parallel; // [step 07]
pub mod precision;

/// The model's shape, as `Config` in `steps/05-train/src/model.rs`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Config {
    pub layers: usize,
    pub d_model: usize,
    pub heads: usize,
    // [step 08]
    /// Heads of keys and values; absent from a record from before grouped heads.
    #[serde(default)]
    pub kv_heads: Option<usize>,
    // [/step 08]
    pub context: usize,
}

/// What the charts read of a run's `Settings`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Settings {
    pub batch: usize,
    pub seq_len: usize,
    pub steps: usize,
    #[serde(default)]
    pub seed: u64,
    #[serde(default)]
    pub schedule: Option<Schedule>,
}

/// The learning rate's schedule (`Schedule` in `steps/05-train/src/optim.rs`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Schedule {
    pub max: f64,
    pub min: f64,
    pub warmup: usize,
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Step {
    pub step: usize,
    pub loss: f64,
    pub ms: f64,
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Eval {
    pub step: usize,
    pub loss: f64,
}

/// What the charts read of a `RunRecord` (`steps/05-train/src/train.rs`); the other fields
/// are left alone. A record from before the GPU trainer lacks the fields after `evals`: it
/// is our trainer's, on the CPU, with our flash attention in `f32`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Run {
    pub config: Config,
    pub settings: Settings,
    /// Bytes of training text: with the seed, what decides the batches.
    #[serde(default)]
    pub train_bytes: usize,
    pub steps: Vec<Step>,
    pub evals: Vec<Eval>,
    /// `step05-train` (ours), `pytorch-eager` or `pytorch-compiled`.
    #[serde(default = "ours")]
    pub trainer: String,
    /// `cpu` or `cuda`.
    #[serde(default = "cpu")]
    pub device: String,
    /// The GPU's name, or `cpu`.
    #[serde(default = "cpu")]
    pub device_name: String,
    /// Ours: `flash` or `by-hand`; PyTorch's: `sdpa-default`, `flash-attention-2`, `cudnn`,
    /// `memory-efficient`, `math` or `by-hand`.
    #[serde(default = "flash")]
    pub attention: String,
    /// `f32` or `bf16-mixed`.
    #[serde(default = "f32")]
    pub precision: String,
    /// Every step's tokens but the first's over their seconds; 0 where the record lacks it.
    #[serde(default)]
    pub tokens_per_s: f64,
    #[serde(default)]
    pub peak_memory_bytes: Option<u64>,
    /// PyTorch's version, in a PyTorch run.
    #[serde(default)]
    pub framework: Option<String>,
}

fn ours() -> String {
    "step05-train".into()
}
fn cpu() -> String {
    "cpu".into()
}
fn flash() -> String {
    "flash".into()
}
fn f32() -> String {
    "f32".into()
}

/// A training run's file: `train-*.json`, which the benchmark's rows leave to this module.
pub fn is_run_file(path: &Path) -> bool {
    is_named(path, "train-")
}

/// Whether a file is named `{prefix}*.json`.
pub(crate) fn is_named(path: &Path, prefix: &str) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with(prefix) && n.ends_with(".json"))
}

/// Every run of `dir/train-*.json` but the ones the submodules draw, the files taken in
/// name order.
pub fn read_runs(dir: &Path) -> Result<Vec<Run>, String> {
    read_records(dir, |p| {
        let theirs = precision::is_precision_file(p);
        let theirs = theirs || parallel::is_dp_file(p); // [step 07]
        let theirs = theirs || kv_heads::is_kv_file(p); // [step 08]
        // [step 09]
        // chapter 9's packed documents: measured against PyTorch, drawn nowhere
        let theirs = theirs || is_named(p, "train-cpu-documents-");
        // [/step 09]
        is_run_file(p) && !theirs
    })
}

/// The record of every file of `dir` that `keep` keeps, the files taken in name order.
pub(crate) fn read_records<T: DeserializeOwned>(
    dir: &Path,
    keep: impl Fn(&Path) -> bool,
) -> Result<Vec<T>, String> {
    let mut files: Vec<_> = fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| keep(p))
        .collect();
    files.sort();
    files
        .iter()
        .map(|f| {
            let text =
                fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
            serde_json::from_str(&text)
                .map_err(|e| format!("{}: not a training run's record: {e}", f.display()))
        })
        .collect()
}

impl Run {
    fn is_ours(&self) -> bool {
        !self.trainer.starts_with("pytorch")
    }

    /// Ours on the CPU's fast path (`train --cpu-path fast`), the CPU's default trainer.
    fn is_fast_path(&self) -> bool {
        self.trainer == "step05-train-fast"
    }

    fn device_kind(&self) -> Device {
        if self.device == "cuda" {
            Device::Cuda
        } else {
            Device::Cpu
        }
    }

    /// The method of the benchmark's charts whose attention this run's is, so it looks the
    /// same.
    fn method(&self) -> &'static str {
        let gpu = self.device == "cuda";
        match (self.is_ours(), self.attention.as_str()) {
            (true, "by-hand") if gpu => "cuda_naive",
            (true, "by-hand") => "naive",
            (true, _) if self.is_fast_path() => "cpu_fast_path",
            (true, _) if gpu => "cuda_flash",
            (true, _) => "online",
            _ if self.trainer == "pytorch-compiled" => "pytorch_compiled",
            (false, "flash-attention-2") => "pytorch_sdpa_flash",
            (false, "cudnn") => "pytorch_sdpa_cudnn",
            (false, "memory-efficient") => "pytorch_sdpa_efficient",
            (false, "by-hand") => "pytorch_by_hand",
            (false, "math") => "pytorch_sdpa_math",
            (false, _) => "pytorch_sdpa",
        }
    }

    fn look(&self) -> Look {
        look(self.method(), self.device_kind())
    }

    /// The legend's words: ours with the steps that bring our attention (on the CPU, the
    /// readable model apart from the fast path), PyTorch's with its attention, and
    /// `torch.compile` where it compiled.
    fn label(&self) -> String {
        let l = self.look();
        if self.is_ours() {
            let which = match self.device == "cpu" && !self.is_fast_path() {
                true => ", readable model",
                false => "",
            };
            return format!("ours{which}: {}", l.label(Pass::ForwardBackward));
        }
        if self.trainer == "pytorch-compiled" && self.attention != "sdpa-default" {
            let base = Run {
                trainer: "pytorch-eager".into(),
                ..self.clone()
            };
            return format!("{}, torch.compile", base.look().words);
        }
        l.words
    }

    /// Whether the two runs trained the same model from the same weights on the same
    /// batches at the same rates: the model, the batch, the steps, the seed, the schedule
    /// (its rates as `f32`, as the trainers keep them) and the training text's length.
    fn same_setup(&self, other: &Run) -> bool {
        let (a, b) = (&self.settings, &other.settings);
        let rates = |s: &Option<Schedule>| {
            s.as_ref().map(|s| (s.max as f32, s.min as f32, s.warmup))
        };
        self.config == other.config
            && (a.batch, a.seq_len, a.steps, a.seed)
                == (b.batch, b.seq_len, b.steps, b.seed)
            && rates(&a.schedule) == rates(&b.schedule)
            && self.train_bytes == other.train_bytes
    }

    /// Ours with our flash attention, PyTorch's FlashAttention-2 and its default, eager:
    /// the runs the loss chart compares.
    fn in_loss_chart(&self) -> bool {
        if self.is_ours() {
            return self.attention == "flash";
        }
        self.trainer == "pytorch-eager"
            && matches!(
                self.attention.as_str(),
                "flash-attention-2" | "sdpa-default"
            )
    }

    /// Tokens a second over every step but the first, as `RunRecord::tokens_per_s`;
    /// computed from the steps where the record lacks it.
    fn throughput(&self) -> f64 {
        if self.tokens_per_s > 0.0 {
            return self.tokens_per_s;
        }
        if self.steps.len() < 2 {
            return 0.0;
        }
        let seconds: f64 = self.steps[1..].iter().map(|s| s.ms / 1e3).sum();
        ((self.steps.len() - 1) * self.settings.batch * self.settings.seq_len) as f64
            / seconds
    }

    /// The median milliseconds of a step, every step but the first.
    fn median_ms(&self) -> Option<f64> {
        let ms: Vec<f64> = self.steps.iter().skip(1).map(|s| s.ms).collect();
        (!ms.is_empty()).then(|| median(ms))
    }

    /// The largest relative difference of this run's losses from `other`'s at the steps
    /// both have (training losses and held-out losses), and how many steps it is over.
    fn loss_difference(&self, other: &Run) -> Option<(f64, usize)> {
        let mut worst: Option<f64> = None;
        let mut count = 0;
        for s in &self.steps {
            if let Some(o) = other.steps.iter().find(|o| o.step == s.step) {
                let d = (s.loss - o.loss).abs() / o.loss.abs();
                worst = Some(worst.map_or(d, |w: f64| w.max(d)));
                count += 1;
            }
        }
        for e in &self.evals {
            if let Some(o) = other.evals.iter().find(|o| o.step == e.step) {
                let d = (e.loss - o.loss).abs() / o.loss.abs();
                worst = Some(worst.map_or(d, |w: f64| w.max(d)));
            }
        }
        worst.map(|w| (w, count))
    }
}

/// The runs in the order of the looks, ours first and our flash attention first of ours,
/// the CPU's fast path before the readable model (the first is the run the others are
/// compared with), eager before compiled.
fn ordered(runs: &[&Run]) -> Vec<Run> {
    let mut out: Vec<Run> = runs.iter().map(|&r| r.clone()).collect();
    out.sort_by_key(|r| {
        let l = r.look();
        (
            !l.ours,
            !(l.ours && r.attention == "flash"),
            !r.is_fast_path(),
            l.rank,
            r.trainer.clone(),
            r.attention.clone(),
            r.steps.len(),
        )
    });
    out
}

/// Every training chart and table the runs call for, as `(file name, text)`: for the CPU
/// runs and for the GPU runs, the loss, the throughput, the peak memory (where measured)
/// and the table.
pub fn render_all(runs: &[Run]) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    for (kind, name) in [("cpu", "cpu"), ("cuda", "gpu")] {
        let group: Vec<&Run> = runs.iter().filter(|r| r.device == kind).collect();
        if group.is_empty() {
            continue;
        }
        let group = ordered(&group);
        let subtitle = subtitle(&group);
        // the runs that share our flash attention's weights, batches and rates
        let reference = group.iter().find(|r| r.is_ours() && r.attention == "flash");
        let losses: Vec<&Run> = group
            .iter()
            .filter(|r| r.in_loss_chart() && reference.is_none_or(|o| r.same_setup(o)))
            .collect();
        if !losses.is_empty() {
            out.push((
                format!("train-{name}-loss.svg"),
                render_loss(&losses, &subtitle)?,
            ));
        }
        let speeds: Vec<(&Run, f64)> = group
            .iter()
            .map(|r| (r, r.throughput()))
            .filter(|(_, v)| *v > 0.0)
            .collect();
        if !speeds.is_empty() {
            out.push((
                format!("train-{name}-throughput.svg"),
                render_bars(
                    "Training throughput",
                    &subtitle,
                    "tokens a second (every step but the first)",
                    &speeds,
                    |v| format!("{} tokens/s", super::three_digits(v)),
                )?,
            ));
        }
        let memory: Vec<(&Run, f64)> = group
            .iter()
            .filter_map(|r| r.peak_memory_bytes.map(|b| (r, b as f64 / 1e9)))
            .collect();
        if !memory.is_empty() {
            out.push((
                format!("train-{name}-peak-memory.svg"),
                render_bars(
                    "Peak memory of a training run",
                    &subtitle,
                    "GB allocated at most: weights, gradients, AdamW, activations",
                    &memory,
                    |v| format!("{} GB", super::three_digits(v)),
                )?,
            ));
        }
        out.push((format!("train-{name}.md"), table(&group)));
    }
    Ok(out)
}

/// The distinct values of a field, in first-seen order, joined.
fn distinct(runs: &[Run], field: impl Fn(&Run) -> String) -> String {
    let mut seen: Vec<String> = Vec::new();
    for r in runs {
        let v = field(r);
        if !seen.contains(&v) {
            seen.push(v);
        }
    }
    seen.join(" / ")
}

/// The model, the batch, the precision and the device, as the runs have them.
fn subtitle(runs: &[Run]) -> String {
    format!(
        "{} · {} · batch {} × {} tokens · {}",
        distinct(runs, |r| if r.device == "cuda" {
            r.device_name.clone()
        } else {
            "CPU".into()
        }),
        distinct(runs, |r| {
            let c = &r.config;
            format!(
                "{} layers, d_model {}, {} heads",
                c.layers, c.d_model, c.heads
            )
        }),
        distinct(runs, |r| r.settings.batch.to_string()),
        distinct(runs, |r| r.settings.seq_len.to_string()),
        distinct(runs, |r| r.precision.clone()),
    )
}

/// The title, the subtitle and a legend of `entries` (look, words: a stretch of line with
/// the marker on it) under a plot: the drawing areas of the whole chart and of the plot,
/// through `draw`.
pub(crate) fn chart(
    title: &str,
    subtitle: &str,
    plot_height: u32,
    entries: &[(Look, String)],
    draw: impl FnOnce(
        &DrawingArea<SVGBackend, plotters::coord::Shift>,
        &DrawingArea<SVGBackend, plotters::coord::Shift>,
    ) -> Result<(), String>,
) -> Result<String, String> {
    let height = 62 + plot_height + 10 + entries.len() as u32 * LEGEND_ROW + 10;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        let e = |e: &dyn std::fmt::Display| e.to_string();
        root.fill(&WHITE).map_err(|x| e(&x))?;
        let (top, rest) = root.split_vertically(62);
        let (body, legend) = rest.split_vertically(plot_height);
        top.draw_text(
            title,
            &TextStyle::from(("sans-serif", 28).into_font()).color(&BLACK),
            (20, 8),
        )
        .map_err(|x| e(&x))?;
        top.draw_text(
            subtitle,
            &TextStyle::from(("sans-serif", 21).into_font())
                .color(&RGBColor(0x44, 0x44, 0x44)),
            (20, 38),
        )
        .map_err(|x| e(&x))?;
        draw(&root, &body)?;
        let (legend_x, legend_y) = legend.get_base_pixel();
        for (i, (l, label)) in entries.iter().enumerate() {
            let x = legend_x + 30;
            let y = legend_y + 10 + (i as u32 * LEGEND_ROW + LEGEND_ROW / 2) as i32;
            draw_legend_entry(&root, l, label, (x, y))?;
        }
        root.present().map_err(|x| e(&x))?;
    }
    Ok(scalable(svg))
}

/// The axes of a chart of the loss against the step: steps across, nats a byte up.
fn draw_loss_axes<DB: DrawingBackend>(
    chart: &mut ChartContext<
        '_,
        DB,
        Cartesian2d<
            plotters::coord::types::RangedCoordf64,
            plotters::coord::types::RangedCoordf64,
        >,
    >,
) -> Result<(), String> {
    chart
        .configure_mesh()
        .x_desc("step (lines: training loss of every step; markers: held-out loss)")
        .y_desc("cross-entropy (nats a byte)")
        .x_label_formatter(&|x: &f64| format!("{x:.0}"))
        .y_label_formatter(&|y: &f64| format!("{y:.1}"))
        .light_line_style(RGBColor(0xee, 0xee, 0xee))
        .label_style(("sans-serif", 20))
        .axis_desc_style(("sans-serif", 20))
        .draw()
        .map_err(|e| e.to_string())
}

/// The loss against the step: each run's training loss at every step as a line (ours solid,
/// PyTorch's dashed), its held-out losses as markers on top.
fn render_loss(runs: &[&Run], subtitle: &str) -> Result<String, String> {
    let entries: Vec<(Look, String)> = runs.iter().map(|r| (r.look(), r.label())).collect();
    let x_hi = runs
        .iter()
        .flat_map(|r| r.steps.iter().map(|s| s.step))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let losses: Vec<f64> = runs
        .iter()
        .flat_map(|r| {
            r.steps
                .iter()
                .map(|s| s.loss)
                .chain(r.evals.iter().map(|e| e.loss))
        })
        .filter(|v| v.is_finite())
        .collect();
    let y_lo = losses.iter().copied().fold(f64::INFINITY, f64::min);
    let y_hi = losses.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let (y_lo, y_hi) = if losses.is_empty() {
        (0.0, 6.0)
    } else {
        let pad = (y_hi - y_lo).max(0.1) * 0.05;
        ((y_lo - pad).max(0.0), y_hi + pad)
    };
    chart(
        "Loss against step, same weights and batches",
        subtitle,
        PLOT_HEIGHT,
        &entries,
        |root, body| {
            let e = |e: &dyn std::fmt::Display| e.to_string();
            let mut chart = ChartBuilder::on(body)
                .margin_left(10)
                .margin_right(30)
                .margin_bottom(10)
                .x_label_area_size(55)
                .y_label_area_size(85)
                .build_cartesian_2d(0.0..x_hi, y_lo..y_hi)
                .map_err(|x| e(&x))?;
            draw_loss_axes(&mut chart)?;
            let mut markers: Vec<(Look, Vec<(i32, i32)>)> = Vec::new();
            for r in runs {
                let l = r.look();
                let points: Vec<(f64, f64)> =
                    r.steps.iter().map(|s| (s.step as f64, s.loss)).collect();
                draw_line(&mut chart, points, &l)?;
                let evals = r
                    .evals
                    .iter()
                    .map(|ev| chart.backend_coord(&(ev.step as f64, ev.loss)))
                    .collect();
                markers.push((l, evals));
            }
            for (l, points) in &markers {
                for &p in points {
                    draw_marker(root, l.marker, p, l.colour, l.ours)?;
                }
            }
            Ok(())
        },
    )
}

/// A run as a loss chart draws it: its look and its legend's words.
pub(crate) struct Line<'a> {
    pub run: &'a Run,
    pub look: Look,
    pub label: String,
}

/// Relative difference, `(a − b) / b`.
fn rel(a: f64, b: f64) -> f64 {
    (a - b) / b
}

/// Above: each line's training loss at every step (ours solid, PyTorch's dashed) and
/// held-out losses (markers); below: for each pair `(reference, other)` of indices into
/// `lines`, the other's relative difference from the reference at every step, in percent
/// (`below` names it), with dashed lines at ±`goal` percent and the scale at least that
/// wide either way, so a small difference looks small.
pub(crate) fn render_loss_and_difference(
    title: &str,
    subtitle: &str,
    lines: &[Line],
    pairs: &[(usize, usize)],
    below: &str,
    goal: f64,
) -> Result<String, String> {
    let entries: Vec<(Look, String)> = lines
        .iter()
        .map(|l| (l.look.clone(), l.label.clone()))
        .collect();
    let x_hi = lines
        .iter()
        .flat_map(|l| l.run.steps.iter().map(|s| s.step))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let losses: Vec<f64> = lines
        .iter()
        .flat_map(|l| l.run.steps.iter().map(|s| s.loss))
        .filter(|v| v.is_finite())
        .collect();
    let y_lo = losses.iter().copied().fold(f64::INFINITY, f64::min);
    let y_hi = losses.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let pad = (y_hi - y_lo).max(0.1) * 0.05;
    let (y_lo, y_hi) = ((y_lo - pad).max(0.0), y_hi + pad);
    let diffs: Vec<(&Line, Vec<(f64, f64)>)> = pairs
        .iter()
        .map(|&(reference, other)| {
            let (one, many) = (&lines[reference], &lines[other]);
            let d = many
                .run
                .steps
                .iter()
                .filter_map(|s| {
                    let o = one.run.steps.iter().find(|o| o.step == s.step)?;
                    Some((s.step as f64, 100.0 * rel(s.loss, o.loss)))
                })
                .collect();
            (many, d)
        })
        .collect();
    let d_lo = diffs
        .iter()
        .flat_map(|(_, d)| d.iter().map(|p| p.1))
        .fold(-goal, f64::min)
        * 1.1;
    let d_hi = diffs
        .iter()
        .flat_map(|(_, d)| d.iter().map(|p| p.1))
        .fold(goal, f64::max)
        * 1.1;
    chart(
        title,
        subtitle,
        PLOT_HEIGHT + 260,
        &entries,
        |root, body| {
            let e = |e: &dyn std::fmt::Display| e.to_string();
            let (top, bottom) = body.split_vertically(PLOT_HEIGHT - 20);
            let mut chart = ChartBuilder::on(&top)
                .margin_left(10)
                .margin_right(30)
                .margin_bottom(15)
                .x_label_area_size(55)
                .y_label_area_size(85)
                .build_cartesian_2d(0.0..x_hi, y_lo..y_hi)
                .map_err(|x| e(&x))?;
            draw_loss_axes(&mut chart)?;
            let mut markers = Vec::new();
            for line in lines {
                let l = &line.look;
                let points: Vec<(f64, f64)> = line
                    .run
                    .steps
                    .iter()
                    .map(|s| (s.step as f64, s.loss))
                    .collect();
                draw_line(&mut chart, points, l)?;
                for ev in &line.run.evals {
                    let at = chart.backend_coord(&(ev.step as f64, ev.loss));
                    markers.push((l, at));
                }
            }
            for &(l, at) in &markers {
                draw_marker(root, l.marker, at, l.colour, l.ours)?;
            }
            let mut under = ChartBuilder::on(&bottom)
                .margin_left(10)
                .margin_right(30)
                .margin_bottom(10)
                .x_label_area_size(55)
                .y_label_area_size(85)
                .build_cartesian_2d(0.0..x_hi, d_lo..d_hi)
                .map_err(|x| e(&x))?;
            under
                .configure_mesh()
                .x_desc("step")
                .y_desc(below)
                .x_label_formatter(&|x: &f64| format!("{x:.0}"))
                .y_label_formatter(&|y: &f64| format!("{y:+.1}"))
                .light_line_style(RGBColor(0xee, 0xee, 0xee))
                .label_style(("sans-serif", 20))
                .axis_desc_style(("sans-serif", 20))
                .draw()
                .map_err(|x| e(&x))?;
            let grey = RGBColor(0x99, 0x99, 0x99);
            for y in [-goal, goal] {
                under
                    .draw_series(LineSeries::new([(0.0, y), (x_hi, y)], dashed(grey, 1)))
                    .map_err(|x| e(&x))?;
            }
            for (line, d) in &diffs {
                draw_line(&mut under, d.clone(), &line.look)?;
            }
            Ok(())
        },
    )
}

/// A run's line: ours solid, PyTorch's dashed.
fn draw_line<DB: DrawingBackend>(
    chart: &mut ChartContext<
        '_,
        DB,
        Cartesian2d<
            plotters::coord::types::RangedCoordf64,
            plotters::coord::types::RangedCoordf64,
        >,
    >,
    points: Vec<(f64, f64)>,
    l: &Look,
) -> Result<(), String> {
    let style = l.colour.stroke_width(2);
    let drawn = if l.ours {
        chart
            .draw_series(LineSeries::new(points, style))
            .map(|_| ())
    } else {
        chart
            .draw_series(LineSeries::new(points, dashed(l.colour, 2)))
            .map(|_| ())
    };
    drawn.map_err(|e| e.to_string())
}

/// A bar per run, `value` long, its words above it and `text(value)` after its end (so no
/// legend); ours filled, PyTorch's pale with an outline.
fn render_bars(
    title: &str,
    subtitle: &str,
    axis: &str,
    bars: &[(&Run, f64)],
    text: impl Fn(f64) -> String,
) -> Result<String, String> {
    let x_hi = bars.iter().map(|(_, v)| *v).fold(0.0, f64::max) * 1.3;
    let n = bars.len() as f64;
    // a row of 75 pixels a bar, and the axis
    let plot_height = 75 * bars.len() as u32 + 75;
    chart(title, subtitle, plot_height, &[], |root, body| {
        let e = |e: &dyn std::fmt::Display| e.to_string();
        let mut chart = ChartBuilder::on(body)
            .margin_top(15)
            .margin_left(30)
            .margin_right(30)
            .margin_bottom(10)
            .x_label_area_size(55)
            .y_label_area_size(0)
            .build_cartesian_2d(0.0..x_hi, 0.0..n)
            .map_err(|x| e(&x))?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .disable_y_axis()
            .x_desc(axis)
            .x_label_formatter(&|x: &f64| super::short_number(*x))
            .light_line_style(TRANSPARENT)
            .label_style(("sans-serif", 20))
            .axis_desc_style(("sans-serif", 20))
            .draw()
            .map_err(|x| e(&x))?;
        for (i, (r, v)) in bars.iter().enumerate() {
            let l = r.look();
            // the first bar at the top
            let y = n - i as f64;
            let (lo, hi) = (y - 0.8, y - 0.35);
            let fill = if l.ours {
                l.colour.filled()
            } else {
                // a quarter of the colour on white, opaque so the grid stays behind it
                let pale = |c: u8| 255 - (255 - c) / 4;
                RGBColor(pale(l.colour.0), pale(l.colour.1), pale(l.colour.2)).filled()
            };
            chart
                .draw_series([Rectangle::new([(0.0, lo), (*v, hi)], fill)])
                .map_err(|x| e(&x))?;
            chart
                .draw_series([Rectangle::new(
                    [(0.0, lo), (*v, hi)],
                    l.colour.stroke_width(2),
                )])
                .map_err(|x| e(&x))?;
            let (bx, by) = chart.backend_coord(&(0.0, y - 0.2));
            root.draw_text(
                &r.label(),
                &TextStyle::from(("sans-serif", 19).into_font())
                    .color(&RGBColor(0x33, 0x33, 0x33))
                    .pos(Pos::new(HPos::Left, VPos::Center)),
                (bx, by),
            )
            .map_err(|x| e(&x))?;
            let (ex, ey) = chart.backend_coord(&(*v, (lo + hi) / 2.0));
            root.draw_text(
                &text(*v),
                &TextStyle::from(("sans-serif", 20).into_font())
                    .color(&BLACK)
                    .pos(Pos::new(HPos::Left, VPos::Center)),
                (ex + 8, ey),
            )
            .map_err(|x| e(&x))?;
        }
        Ok(())
    })
}

/// The runs as the book's table: a row per run, its speed against ours (our flash attention
/// on the same device) right after its name, so that on a phone the ratio is in view before
/// the table scrolls, then its speed, its memory, its last held-out loss and how far its
/// losses are from ours.
fn table(runs: &[Run]) -> String {
    let reference = runs.iter().find(|r| r.is_ours() && r.attention == "flash");
    let mut md = format!(
        "<!-- written by `cargo run -p charts` from charts/data/train-*.json: {} -->\n\n",
        subtitle(runs)
    );
    // a column of peak memory where a run measured it (the GPU's runs)
    let memory = runs.iter().any(|r| r.peak_memory_bytes.is_some());
    md.push_str(&format!(
        "| run | vs ours | steps | tokens/s | ms a step |{} held-out loss | loss vs ours |\n\
         | :--- | ---: | ---: | ---: | ---: |{} ---: | ---: |\n",
        if memory { " peak memory, GB |" } else { "" },
        if memory { " ---: |" } else { "" },
    ));
    for r in runs {
        let speed = r.throughput();
        let versus = reference
            .filter(|o| o.throughput() > 0.0 && speed > 0.0)
            .map_or("–".to_string(), |o| {
                format!("{:.2}×", speed / o.throughput())
            });
        let held_out = r.evals.last().map_or("–".to_string(), |e| {
            format!("{:.4} (step {})", e.loss, e.step)
        });
        let difference = match reference {
            Some(o) if std::ptr::eq(o, r) => "–".to_string(),
            Some(o) if !r.same_setup(o) => "other settings".to_string(),
            Some(o) => r.loss_difference(o).map_or("–".to_string(), |(d, n)| {
                format!("{d:.1e} over {n} steps")
            }),
            None => "–".to_string(),
        };
        let peak = if memory {
            format!(
                " {} |",
                r.peak_memory_bytes
                    .map_or("–".into(), |b| super::three_digits(b as f64 / 1e9))
            )
        } else {
            String::new()
        };
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} |{peak} {} | {} |\n",
            r.label(),
            versus,
            r.steps.len(),
            if speed > 0.0 {
                super::three_digits(speed)
            } else {
                "–".into()
            },
            r.median_ms().map_or("–".into(), super::three_digits),
            held_out,
            difference,
        ));
    }
    md.push_str(
        "\n*tokens/s*: every step's tokens but the first's over their seconds; *ms a step*: the \
         median, the first step left out; *vs ours*: the run's tokens/s over ours (the first \
         row: our flash attention, on the CPU our fast path), above 1× the run is faster; \
         *held-out loss*: the last one measured; *loss \
         vs ours*: the largest relative difference between the run's losses and ours at the \
         same steps (training and held-out), from the same initial weights and batches (*other \
         settings*: a run of another model, batch, schedule, seed or text, not compared).\n",
    );
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run record as the trainers write it; `extra` adds the fields a newer record has.
    fn run(
        trainer: &str,
        attention: &str,
        device: &str,
        speed: f64,
        extra: &str,
    ) -> String {
        let steps: Vec<String> = (1..=20)
            .map(|s| {
                let loss = 5.5 - 0.1 * s as f64 + if trainer == "step05-train" { 0.0 } else { 1e-6 };
                format!(r#"{{"step":{s},"loss":{loss},"lr":0.001,"grad_norm":1.0,"ms":{},"tokens_per_s":1.0}}"#, 512.0 / speed * 1e3)
            })
            .collect();
        format!(
            r#"{{"config":{{"layers":2,"d_model":64,"heads":4,"context":64,"vocab":256}},
               "settings":{{"batch":8,"seq_len":64,"steps":20}},"params":120576,
               "steps":[{}],"evals":[{{"step":0,"loss":5.55}},{{"step":20,"loss":3.5}}],
               "trainer":"{trainer}","device":"{device}","attention":"{attention}"{extra}}}"#,
            steps.join(",")
        )
    }

    fn sample() -> Vec<Run> {
        [
            // a record from before the GPU trainer: no trainer, device or attention
            r#"{"config":{"layers":2,"d_model":64,"heads":4,"context":64,"vocab":256},
                "settings":{"batch":8,"seq_len":64,"steps":20},"params":1,
                "steps":[{"step":1,"loss":5.0,"ms":2.0},{"step":2,"loss":4.0,"ms":1.0}],
                "evals":[{"step":0,"loss":5.5}]}"#
                .to_string(),
            run("pytorch-eager", "sdpa-default", "cpu", 8000.0, ""),
            run("pytorch-eager", "by-hand", "cpu", 9000.0, ""),
            run(
                "step05-train",
                "flash",
                "cuda",
                400_000.0,
                r#","device_name":"NVIDIA H200","precision":"bf16-mixed","peak_memory_bytes":30000000000"#,
            ),
            run(
                "pytorch-compiled",
                "sdpa-default",
                "cuda",
                500_000.0,
                r#","device_name":"NVIDIA H200","precision":"bf16-mixed","peak_memory_bytes":20000000000"#,
            ),
            run(
                "pytorch-eager",
                "flash-attention-2",
                "cuda",
                450_000.0,
                r#","device_name":"NVIDIA H200","precision":"bf16-mixed","peak_memory_bytes":25000000000"#,
            ),
        ]
        .iter()
        .map(|t| serde_json::from_str(t).unwrap())
        .collect()
    }

    #[test]
    fn same_runs_give_byte_identical_charts() {
        let runs = sample();
        let a = render_all(&runs).unwrap();
        let names: Vec<&str> = a.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "train-cpu-loss.svg",
                "train-cpu-throughput.svg",
                "train-cpu.md",
                "train-gpu-loss.svg",
                "train-gpu-throughput.svg",
                "train-gpu-peak-memory.svg",
                "train-gpu.md",
            ]
        );
        assert_eq!(a, render_all(&runs).unwrap());
        // the order of the files does not change a chart
        let reversed: Vec<Run> = runs.iter().rev().cloned().collect();
        assert_eq!(a, render_all(&reversed).unwrap());
    }

    #[test]
    fn training_charts_scale_to_the_column() {
        let mut svgs = 0;
        for (name, svg) in render_all(&sample()).unwrap() {
            if name.ends_with(".svg") {
                svgs += 1;
                let root = svg.lines().next().unwrap();
                assert!(
                    root.starts_with("<svg width=\"100%\" viewBox=\"0 0 900 "),
                    "{name}: {root}"
                );
                assert!(
                    !root.contains("height="),
                    "{name}: a fixed height in {root}"
                );
            }
        }
        assert!(svgs > 0, "the sample runs give no SVG chart");
    }

    #[test]
    fn a_run_looks_as_its_attention_does_in_every_chart() {
        let runs = sample();
        let colour = |m: &str, d: Device| {
            let c = look(m, d).colour;
            format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
        };
        let charts = render_all(&runs).unwrap();
        let get = |n: &str| &charts.iter().find(|(name, _)| name == n).unwrap().1;
        // ours on the CPU is step 02's online softmax and step 04's backward
        let ours_cpu = colour("online", Device::Cpu);
        let sdpa_cpu = colour("pytorch_sdpa", Device::Cpu);
        for chart in ["train-cpu-loss.svg", "train-cpu-throughput.svg"] {
            assert!(get(chart).contains(&ours_cpu), "{chart}: no {ours_cpu}");
            assert!(get(chart).contains(&sdpa_cpu), "{chart}: no {sdpa_cpu}");
        }
        assert!(
            get("train-cpu-loss.svg")
                .contains("ours, readable model: online softmax, SIMD (steps 02 and 04)")
        );
        // PyTorch by hand is in the throughput, not in the loss chart
        let by_hand = colour("pytorch_by_hand", Device::Cpu);
        assert!(get("train-cpu-throughput.svg").contains(&by_hand));
        assert!(!get("train-cpu-loss.svg").contains(&by_hand));
        // on the GPU: our FlashAttention kernel, FlashAttention-2 via PyTorch, compiled
        let flash = colour("cuda_flash", Device::Cuda);
        let fa2 = colour("pytorch_sdpa_flash", Device::Cuda);
        let compiled = colour("pytorch_compiled", Device::Cuda);
        let memory = get("train-gpu-peak-memory.svg");
        for c in [&flash, &fa2, &compiled] {
            assert!(memory.contains(c.as_str()), "no {c} in the memory chart");
        }
        assert!(memory.contains("ours: FlashAttention kernel (steps 03–04)"));
        assert!(memory.contains("30.0 GB"));
        assert!(!get("train-gpu-loss.svg").contains(&compiled));
    }

    #[test]
    fn the_table_compares_each_run_with_ours() {
        let charts = render_all(&sample()).unwrap();
        let md = &charts.iter().find(|(n, _)| n == "train-gpu.md").unwrap().1;
        assert!(
            md.starts_with("<!-- written by `cargo run -p charts`"),
            "{md}"
        );
        assert!(
            md.contains("NVIDIA H200 · 2 layers, d_model 64, 4 heads"),
            "{md}"
        );
        // 450,000 tokens/s against our 400,000, 512 tokens in 1.14 ms; losses 1e-6 apart
        assert!(
            md.contains(
                "| FlashAttention-2 via PyTorch | 1.12× | 20 | 450,000 | 1.14 | 25.0 |"
            ),
            "{md}"
        );
        assert!(md.contains("over 20 steps |"), "{md}");
        let cpu = &charts.iter().find(|(n, _)| n == "train-cpu.md").unwrap().1;
        // the old record: two steps, the second alone timed, 512 tokens in 1 ms
        assert!(
            cpu.contains("| ours, readable model: online softmax, SIMD (steps 02 and 04) | 1.00× | 2 | 512,000 | 1.00 | 5.5000 (step 0) | – |"),
            "{cpu}"
        );
    }

    #[test]
    fn the_cpus_fast_path_is_the_run_the_others_are_compared_with() {
        let mut runs = sample();
        let fast = run("step05-train-fast", "flash", "cpu", 16000.0, "");
        runs.push(serde_json::from_str(&fast).unwrap());
        let charts = render_all(&runs).unwrap();
        let cpu = &charts.iter().find(|(n, _)| n == "train-cpu.md").unwrap().1;
        let rows: Vec<&str> = cpu.lines().filter(|l| l.starts_with("| ours")).collect();
        assert!(
            rows[0].starts_with(
                "| ours: fast path: a shard per core, faer's products (step 05) | 1.00× | 20 | 16,000 |"
            ),
            "{cpu}"
        );
        // PyTorch's 8,000 tokens/s against the fast path's 16,000
        assert!(
            cpu.contains(
                "| PyTorch SDPA (CPU flash attention) | 0.50× | 20 | 8,000 | 64.0 |"
            ),
            "{cpu}"
        );
        let loss = &charts
            .iter()
            .find(|(n, _)| n == "train-cpu-loss.svg")
            .unwrap()
            .1;
        assert!(
            loss.contains("ours: fast path"),
            "the fast path is in the loss chart"
        );
    }

    #[test]
    fn runs_of_other_settings_are_not_compared_with_ours() {
        let mut runs = sample();
        let fa2 = colour_of("pytorch_sdpa_flash");
        let loss_chart = |runs: &[Run]| {
            let charts = render_all(runs).unwrap();
            charts
                .into_iter()
                .find(|(n, _)| n == "train-gpu-loss.svg")
                .unwrap()
                .1
        };
        assert!(loss_chart(&runs).contains(&fa2));
        // FlashAttention-2's run from another seed: other batches, nothing to compare
        let other = runs
            .iter_mut()
            .find(|r| r.attention == "flash-attention-2")
            .unwrap();
        other.settings.seed = 2;
        assert!(!loss_chart(&runs).contains(&fa2));
        let charts = render_all(&runs).unwrap();
        let md = &charts.iter().find(|(n, _)| n == "train-gpu.md").unwrap().1;
        assert!(
            md.contains("| FlashAttention-2 via PyTorch | 1.12× | 20 | 450,000 | 1.14 | 25.0 | 3.5000 (step 20) | other settings |"),
            "{md}"
        );
    }

    fn colour_of(method: &str) -> String {
        let c = look(method, Device::Cuda).colour;
        format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
    }

    #[test]
    fn committed_training_charts_are_regenerated_from_committed_data() {
        let dir = Path::new(".");
        let runs = read_runs(&dir.join("data")).unwrap();
        let charts = render_all(&runs).unwrap();
        assert!(
            !charts.is_empty(),
            "charts/data/train-*.json gives no charts: the committed ones are checked against \
             nothing"
        );
        for (name, text) in charts {
            let committed = fs::read_to_string(dir.join(&name)).unwrap_or_default();
            assert!(
                committed == text,
                "charts/{name} is not what charts/data/train-*.json gives: run `cargo run -p charts`"
            );
        }
    }
}
