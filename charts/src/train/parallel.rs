//! Step 07's charts: data parallelism measured, from `charts/data/train-dp-*.json` (written
//! by `step05-train train --device cuda --gpus N --out`), runs of the same model on one GPU
//! and on several, a replica on each GPU and the step's batch split over them.
//!
//! - `train-dp-loss.svg`: the loss against the step of the runs that share weights, batches
//!   and rates (one GPU and several on the same global batch), and below it their relative
//!   difference from the one-GPU run at every step;
//! - `train-dp-throughput.svg`: tokens a second, a bar per run;
//! - `train-dp.md`: a row per run: GPUs, sequences on each, tokens a second, the scaling
//!   efficiency (tokens a second over the GPUs' count times those of one GPU with one GPU's
//!   share of the batch), the all-reduce's milliseconds, peak memory per GPU, and how far
//!   its losses are from the one-GPU run on the same batches.
//!
//! These files are not among step 05's runs ([`super::read_runs`] leaves them here).

use std::path::Path;

use flash_core::Device;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::Deserialize;

use super::{Line, Run, chart, render_loss_and_difference};
use crate::{Look, Marker, look, three_digits};

/// A run of `train-dp-*.json`: step 05's record and the fields step 07 added.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct DpRun {
    #[serde(flatten)]
    pub run: Run,
    /// GPUs it trained on; 1 where the record lacks it.
    #[serde(default = "one")]
    pub gpus: usize,
    /// Each GPU's all-reduce, milliseconds a step; empty on one GPU.
    #[serde(default)]
    pub allreduce_ms: Vec<f64>,
}

fn one() -> usize {
    1
}

/// A data-parallel run's file: `train-dp-*.json`.
pub fn is_dp_file(path: &Path) -> bool {
    super::is_named(path, "train-dp-")
}

/// Every run of `dir/train-dp-*.json`, the files taken in name order.
pub fn read_runs(dir: &Path) -> Result<Vec<DpRun>, String> {
    super::read_records(dir, is_dp_file)
}

impl DpRun {
    /// Sequences each GPU took a step.
    fn per_gpu(&self) -> usize {
        self.run.settings.batch / self.gpus.max(1)
    }

    /// One GPU looks as our FlashAttention kernel does everywhere; several GPUs in a colour
    /// of ours of their own.
    fn look(&self) -> Look {
        let base = look("cuda_flash", Device::Cuda);
        if self.gpus == 1 {
            return base;
        }
        Look {
            colour: RGBColor(0x1d, 0x91, 0xc0),
            marker: Marker::Diamond,
            words: "data parallel".into(),
            ..base
        }
    }

    fn label(&self) -> String {
        match self.gpus {
            1 => format!("1 GPU, {} sequences a step", self.run.settings.batch),
            n => format!(
                "{n} GPUs, {} sequences each ({} a step)",
                self.per_gpu(),
                self.run.settings.batch
            ),
        }
    }
}

/// The runs in order: by GPUs, then by batch.
fn ordered(runs: &[DpRun]) -> Vec<DpRun> {
    let mut out = runs.to_vec();
    out.sort_by_key(|r| (r.gpus, r.run.settings.batch));
    out
}

/// The one-GPU run with the same weights, batches and rates as `r` (the same global batch).
fn same_batches<'a>(runs: &'a [DpRun], r: &DpRun) -> Option<&'a DpRun> {
    runs.iter()
        .find(|o| o.gpus == 1 && !std::ptr::eq(*o, r) && o.run.same_setup(&r.run))
}

/// The one-GPU run whose batch is one GPU's share of `r`'s: the speed `r` is `N` times of
/// at perfect scaling.
fn one_share<'a>(runs: &'a [DpRun], r: &DpRun) -> Option<&'a DpRun> {
    runs.iter().find(|o| {
        o.gpus == 1
            && o.run.settings.batch == r.per_gpu()
            && o.run.settings.seq_len == r.run.settings.seq_len
            && o.run.config == r.run.config
    })
}

/// `tokens/s(N GPUs) / (N · tokens/s(one GPU with one GPU's share))`.
fn efficiency(runs: &[DpRun], r: &DpRun) -> Option<f64> {
    let base = one_share(runs, r)?.run.throughput();
    let speed = r.run.throughput();
    (base > 0.0 && speed > 0.0).then(|| speed / (r.gpus as f64 * base))
}

/// Every chart and the table of the data-parallel runs, as `(file name, text)`; none
/// without runs.
pub fn render_all(runs: &[DpRun]) -> Result<Vec<(String, String)>, String> {
    if runs.is_empty() {
        return Ok(Vec::new());
    }
    let runs = ordered(runs);
    let plain: Vec<Run> = runs.iter().map(|r| r.run.clone()).collect();
    let subtitle = format!(
        "{} · {} layers, d_model {}, {} heads · {} tokens a sequence · {}",
        super::distinct(&plain, |r| r.device_name.clone()),
        runs[0].run.config.layers,
        runs[0].run.config.d_model,
        runs[0].run.config.heads,
        super::distinct(&plain, |r| r.settings.seq_len.to_string()),
        super::distinct(&plain, |r| r.precision.clone()),
    );
    let mut out = Vec::new();
    // the several-GPU runs with their one-GPU twin on the same batches
    let pairs: Vec<(&DpRun, &DpRun)> = runs
        .iter()
        .filter(|r| r.gpus > 1)
        .filter_map(|r| same_batches(&runs, r).map(|o| (o, r)))
        .collect();
    if !pairs.is_empty() {
        out.push(("train-dp-loss.svg".into(), render_loss(&pairs, &subtitle)?));
    }
    let speeds: Vec<(&DpRun, f64)> = runs
        .iter()
        .map(|r| (r, r.run.throughput()))
        .filter(|(_, v)| *v > 0.0)
        .collect();
    if !speeds.is_empty() {
        out.push((
            "train-dp-throughput.svg".into(),
            render_bars(&speeds, &subtitle)?,
        ));
    }
    out.push(("train-dp.md".into(), table(&runs, &subtitle)));
    Ok(out)
}

/// Above: each run's training loss at every step (a line) and held-out losses (markers);
/// below: each several-GPU run's relative difference from its one-GPU twin at every step,
/// in percent.
fn render_loss(pairs: &[(&DpRun, &DpRun)], subtitle: &str) -> Result<String, String> {
    let mut runs: Vec<&DpRun> = Vec::new();
    for (a, b) in pairs {
        for r in [*a, *b] {
            if !runs.iter().any(|x| std::ptr::eq(*x, r)) {
                runs.push(r);
            }
        }
    }
    let index = |r: &DpRun| runs.iter().position(|x| std::ptr::eq(*x, r)).unwrap_or(0);
    let lines: Vec<Line> = runs
        .iter()
        .map(|r| Line {
            run: &r.run,
            look: r.look(),
            label: r.label(),
        })
        .collect();
    let pairs: Vec<(usize, usize)> =
        pairs.iter().map(|(a, b)| (index(a), index(b))).collect();
    render_loss_and_difference(
        "Loss on one GPU and on several, same batches",
        subtitle,
        &lines,
        &pairs,
        "vs one GPU, %",
        1.0,
    )
}

/// A bar per run, tokens a second, its words above it and the number after its end.
fn render_bars(bars: &[(&DpRun, f64)], subtitle: &str) -> Result<String, String> {
    let x_hi = bars.iter().map(|(_, v)| *v).fold(0.0, f64::max) * 1.3;
    let n = bars.len() as f64;
    let plot_height = 75 * bars.len() as u32 + 75;
    chart(
        "Training throughput on one GPU and on several",
        subtitle,
        plot_height,
        &[],
        |root, body| {
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
                .x_desc("tokens a second (every step but the first)")
                .x_label_formatter(&|x: &f64| crate::short_number(*x))
                .light_line_style(TRANSPARENT)
                .label_style(("sans-serif", 20))
                .axis_desc_style(("sans-serif", 20))
                .draw()
                .map_err(|x| e(&x))?;
            for (i, (r, v)) in bars.iter().enumerate() {
                let l = r.look();
                let y = n - i as f64;
                let (lo, hi) = (y - 0.8, y - 0.35);
                chart
                    .draw_series([Rectangle::new([(0.0, lo), (*v, hi)], l.colour.filled())])
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
                    &format!("{} tokens/s", three_digits(*v)),
                    &TextStyle::from(("sans-serif", 20).into_font())
                        .color(&BLACK)
                        .pos(Pos::new(HPos::Left, VPos::Center)),
                    (ex + 8, ey),
                )
                .map_err(|x| e(&x))?;
            }
            Ok(())
        },
    )
}

/// The runs as the book's table: the scaling efficiency right after the run's name, so that
/// on a phone it is in view before the table scrolls.
fn table(runs: &[DpRun], subtitle: &str) -> String {
    let mut md = format!(
        "<!-- written by `cargo run -p charts` from charts/data/train-dp-*.json: {subtitle} -->\n\n\
         | run | scaling efficiency | steps | tokens/s | ms a step | all-reduce, ms a step | peak memory per GPU, GB | held-out loss | loss vs one GPU |\n\
         | :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    );
    let dash = || "–".to_string();
    for r in runs {
        let speed = r.run.throughput();
        let eff = match r.gpus {
            1 => dash(),
            _ => efficiency(runs, r).map_or_else(dash, |e| format!("{:.1}%", 100.0 * e)),
        };
        // the least of the GPUs' times is the collective's own; the most includes waiting
        let allreduce = match r.allreduce_ms.iter().copied().reduce(f64::min) {
            Some(lo) => {
                let hi = r.allreduce_ms.iter().copied().fold(lo, f64::max);
                format!("{lo:.2} to {hi:.2}")
            }
            None => dash(),
        };
        let difference = match same_batches(runs, r) {
            Some(o) if r.gpus > 1 => r
                .run
                .loss_difference(&o.run)
                .map_or_else(dash, |(d, n)| format!("{:.2}% over {n} steps", 100.0 * d)),
            _ => dash(),
        };
        md.push_str(&format!(
            "| {} | {eff} | {} | {} | {} | {allreduce} | {} | {} | {difference} |\n",
            r.label(),
            r.run.steps.len(),
            if speed > 0.0 {
                three_digits(speed)
            } else {
                dash()
            },
            r.run.median_ms().map_or_else(dash, three_digits),
            r.run
                .peak_memory_bytes
                .map_or_else(dash, |b| three_digits(b as f64 / 1e9)),
            r.run
                .evals
                .last()
                .map_or_else(dash, |e| format!("{:.4} (step {})", e.loss, e.step)),
        ));
    }
    md.push_str(
        "\n*scaling efficiency*: the run's tokens/s over the GPUs' count times the tokens/s of one \
         GPU taking one GPU's share of the batch (100%: no time lost to the all-reduce or to \
         waiting); *all-reduce*: each GPU's CUDA events around it, the least the collective's \
         own time and the most with the wait for the slowest GPU's backward; *peak memory*: the \
         largest GPU's high-water mark; *loss vs one GPU*: the largest relative difference \
         between the run's losses and those of one GPU on the same batches from the same \
         weights, at every step and every held-out loss.\n",
    );
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record as `step05-train --out` writes it, with `gpus` GPUs, `batch` sequences a
    /// step, `speed` tokens a second and losses shifted by `shift`.
    fn run(gpus: usize, batch: usize, speed: f64, shift: f64) -> DpRun {
        let steps: Vec<String> = (1..=20)
            .map(|s| {
                let loss = 5.5 - 0.1 * s as f64 + shift;
                let ms = (batch * 64) as f64 / speed * 1e3;
                format!(r#"{{"step":{s},"loss":{loss},"ms":{ms}}}"#)
            })
            .collect();
        let extra = match gpus {
            1 => String::new(),
            n => format!(r#","gpus":{n},"allreduce_ms":[1.5,0.9]"#),
        };
        serde_json::from_str(&format!(
            r#"{{"config":{{"layers":2,"d_model":64,"heads":4,"context":64,"vocab":256}},
               "settings":{{"batch":{batch},"seq_len":64,"steps":20}},
               "steps":[{}],"evals":[{{"step":0,"loss":5.55}},{{"step":20,"loss":3.5}}],
               "trainer":"step05-train","device":"cuda","device_name":"NVIDIA H200",
               "attention":"flash","precision":"bf16-mixed","peak_memory_bytes":11000000000{extra}}}"#,
            steps.join(",")
        ))
        .unwrap()
    }

    fn sample() -> Vec<DpRun> {
        vec![
            run(2, 24, 950_000.0, 0.01),
            run(1, 12, 500_000.0, 0.0),
            run(1, 24, 510_000.0, 0.0),
        ]
    }

    #[test]
    fn the_charts_and_table_of_the_runs() {
        let charts = render_all(&sample()).unwrap();
        let names: Vec<&str> = charts.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "train-dp-loss.svg",
                "train-dp-throughput.svg",
                "train-dp.md"
            ]
        );
        let mut reversed = sample();
        reversed.reverse();
        assert_eq!(charts, render_all(&reversed).unwrap());
        let md = &charts[2].1;
        // 950,000 over 2 × 500,000, right after the run's name
        assert!(
            md.contains("| 2 GPUs, 12 sequences each (24 a step) | 95.0% |"),
            "{md}"
        );
        assert!(md.contains("| 0.90 to 1.50 |"), "{md}");
        // the losses 0.01 apart at loss 3.5 at most: 0.29%
        assert!(md.contains("0.29% over 20 steps"), "{md}");
        for (name, svg) in &charts {
            if name.ends_with(".svg") {
                assert!(svg.starts_with("<svg width=\"100%\""), "{name}");
            }
        }
    }

    #[test]
    fn no_runs_no_charts() {
        assert!(render_all(&[]).unwrap().is_empty());
    }

    #[test]
    fn a_record_without_the_gpu_count_is_one_gpu() {
        let r = run(1, 12, 1.0, 0.0);
        assert_eq!((r.gpus, r.allreduce_ms.len()), (1, 0));
        assert!(is_dp_file(Path::new("data/train-dp-2x24.json")));
        assert!(!is_dp_file(Path::new("data/train-gpu-ours-flash.json")));
    }
}
