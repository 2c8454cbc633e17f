//! Step 05's rounding check: one run of our GPU trainer and the same run in PyTorch rounded
//! three ways, from the same weights and batches (`charts/data/train-precision-*.json`,
//! written by `step05-train train --device cuda --out` and by `gpt_pytorch.py --like OURS
//! --precision P
//! --out`):
//!
//! - `train-precision-loss.svg`: the loss against the step, and below it each PyTorch run's
//!   relative difference from ours at every step;
//! - `train-precision.md`: a row per run: where it rounds to bf16, its held-out losses, and
//!   how far its losses are from ours.
//!
//! These files are not among step 05's runs ([`super::read_runs`] leaves them here).

use std::path::Path;

use flash_core::Device;

use super::{Line, Run, render_loss_and_difference};
use crate::{Look, look};

/// A rounding check's file: `train-precision-*.json`.
pub fn is_precision_file(path: &Path) -> bool {
    super::is_named(path, "train-precision-")
}

/// Every run of `dir/train-precision-*.json`, the files taken in name order.
pub fn read_runs(dir: &Path) -> Result<Vec<Run>, String> {
    super::read_records(dir, is_precision_file)
}

/// How a run rounds, in the order the chart and the table list them.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Rounding {
    /// our trainer
    Ours,
    /// PyTorch rounding where ours does (`--precision ours`, recorded `bf16-as-ours`)
    AsOurs,
    /// PyTorch's bf16 autocast (`bf16-mixed`)
    Autocast,
    /// PyTorch in f32 (`f32`)
    F32,
}

impl Rounding {
    fn of(r: &Run) -> Rounding {
        if !r.trainer.starts_with("pytorch") {
            return Rounding::Ours;
        }
        match r.precision.as_str() {
            "bf16-as-ours" => Rounding::AsOurs,
            "f32" => Rounding::F32,
            _ => Rounding::Autocast,
        }
    }

    /// The legend's words.
    fn label(self) -> &'static str {
        match self {
            Rounding::Ours => "ours",
            Rounding::AsOurs => "PyTorch, rounded where ours rounds",
            Rounding::Autocast => "PyTorch, bf16 autocast",
            Rounding::F32 => "PyTorch in f32, no bf16",
        }
    }

    /// Where the run rounds to bf16, for the table.
    fn rounds(self) -> &'static str {
        match self {
            Rounding::Ours | Rounding::AsOurs => {
                "every product's operands; the results that feed only another product or the \
                 attention"
            }
            Rounding::Autocast => {
                "every product's operands and results (the residual stream's share, the \
                 logits, the input gradients, the weights' gradients)"
            }
            Rounding::F32 => "nowhere",
        }
    }

    /// Ours as our flash attention looks everywhere; PyTorch's in the colours of its
    /// methods.
    fn look(self) -> Look {
        let method = match self {
            Rounding::Ours => "cuda_flash",
            Rounding::AsOurs => "pytorch_sdpa",
            Rounding::Autocast => "pytorch_sdpa_cudnn",
            Rounding::F32 => "pytorch_by_hand",
        };
        look(method, Device::Cuda)
    }
}

/// The chart and the table of the runs, as `(file name, text)`; none without our run.
pub fn render_all(runs: &[Run]) -> Result<Vec<(String, String)>, String> {
    let mut runs = runs.to_vec();
    runs.sort_by_key(Rounding::of);
    let Some(ours) = runs.iter().position(|r| Rounding::of(r) == Rounding::Ours) else {
        return Ok(Vec::new());
    };
    let reference = &runs[ours];
    let subtitle = format!(
        "{} · {} layers, d_model {}, {} heads · batch {} × {} tokens · {} steps",
        super::distinct(&runs, |r| r.device_name.clone()),
        reference.config.layers,
        reference.config.d_model,
        reference.config.heads,
        reference.settings.batch,
        reference.settings.seq_len,
        reference.steps.len(),
    );
    let lines: Vec<Line> = runs
        .iter()
        .map(|r| Line {
            run: r,
            look: Rounding::of(r).look(),
            label: Rounding::of(r).label().to_string(),
        })
        .collect();
    // every PyTorch run that shares our run's weights, batches and rates, against ours
    let pairs: Vec<(usize, usize)> = (0..runs.len())
        .filter(|&i| i != ours && runs[i].same_setup(reference))
        .map(|i| (ours, i))
        .collect();
    let chart = render_loss_and_difference(
        "Loss by where the products round to bf16, same weights and batches",
        &subtitle,
        &lines,
        &pairs,
        "vs ours, %",
        2.0,
    )?;
    Ok(vec![
        ("train-precision-loss.svg".into(), chart),
        (
            "train-precision.md".into(),
            table(&runs, ours, &pairs, &subtitle),
        ),
    ])
}

/// The runs as the book's table: its largest difference from ours right after the run's
/// name (in view on a phone before the table scrolls), where it rounds, and its held-out
/// losses at our run's held-out steps.
fn table(runs: &[Run], ours: usize, pairs: &[(usize, usize)], subtitle: &str) -> String {
    let steps: Vec<usize> = runs[ours]
        .evals
        .iter()
        .map(|e| e.step)
        .filter(|&s| s > 0)
        .collect();
    let mut md = format!(
        "<!-- written by `cargo run -p charts` from charts/data/train-precision-*.json: \
         {subtitle} -->\n\n| run | loss vs ours | rounds to bf16 |"
    );
    for s in &steps {
        md.push_str(&format!(" held-out loss, step {s} |"));
    }
    md.push_str("\n| :--- | ---: | :--- |");
    md.push_str(&" ---: |".repeat(steps.len()));
    md.push('\n');
    for (i, r) in runs.iter().enumerate() {
        let rounding = Rounding::of(r);
        let difference = if i == ours {
            "–".to_string()
        } else if pairs.iter().any(|&(_, j)| j == i) {
            r.loss_difference(&runs[ours])
                .map_or("–".to_string(), |(d, n)| {
                    format!("{:.2}% over {n} steps", 100.0 * d)
                })
        } else {
            "other settings".to_string()
        };
        md.push_str(&format!(
            "| {} | {difference} | {} |",
            rounding.label(),
            rounding.rounds()
        ));
        for s in &steps {
            let loss = r.evals.iter().find(|e| e.step == *s);
            md.push_str(&loss.map_or(" – |".into(), |e| format!(" {:.4} |", e.loss)));
        }
        md.push('\n');
    }
    md.push_str(
        "\n*rounds to bf16*: where the run's numbers are rounded to bf16 (every run keeps its \
         weights, AdamW's moments and the sums inside each product in f32); *loss vs ours*: the \
         largest relative difference between the run's losses and ours at the same steps \
         (every training step and every held-out loss), from the same initial weights and \
         batches (*other settings*: a run of another model, batch, schedule, seed or text, not \
         compared).\n",
    );
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record of `trainer` in `precision`, its losses shifted by `shift`.
    fn run(trainer: &str, precision: &str, shift: f64) -> Run {
        let steps: Vec<String> = (1..=20)
            .map(|s| {
                let loss = 5.5 - 0.1 * s as f64 + shift;
                format!(r#"{{"step":{s},"loss":{loss},"ms":40.0}}"#)
            })
            .collect();
        serde_json::from_str(&format!(
            r#"{{"config":{{"layers":2,"d_model":64,"heads":4,"context":64,"vocab":256}},
               "settings":{{"batch":4,"seq_len":64,"steps":20}},
               "steps":[{}],"evals":[{{"step":0,"loss":5.55}},{{"step":10,"loss":4.5}},{{"step":20,"loss":3.5}}],
               "trainer":"{trainer}","device":"cuda","device_name":"NVIDIA H200",
               "attention":"flash","precision":"{precision}"}}"#,
            steps.join(",")
        ))
        .unwrap()
    }

    #[test]
    fn the_chart_and_table_of_the_runs() {
        let runs = vec![
            run("pytorch-eager", "f32", 0.1),
            run("pytorch-eager", "bf16-mixed", 0.05),
            run("step05-train", "bf16-mixed", 0.0),
            run("pytorch-eager", "bf16-as-ours", 0.01),
        ];
        let charts = render_all(&runs).unwrap();
        let names: Vec<&str> = charts.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["train-precision-loss.svg", "train-precision.md"]);
        let md = &charts[1].1;
        let rows: Vec<&str> = md
            .lines()
            .filter(|l| l.starts_with("| ") && !l.starts_with("| :"))
            .collect();
        // the header, then ours first, then PyTorch as ours rounds, autocast, f32
        assert!(rows[0].contains("held-out loss, step 10 | held-out loss, step 20 |"));
        assert!(rows[1].starts_with("| ours | – |"), "{md}");
        assert!(rows[3].starts_with("| PyTorch, bf16 autocast |"), "{md}");
        assert!(rows[4].starts_with("| PyTorch in f32, no bf16 |"), "{md}");
        // 0.01 over the smallest loss of 3.5: 0.29%; 0.1 over 3.5: 2.86%; right after the name
        assert!(
            rows[2].starts_with(
                "| PyTorch, rounded where ours rounds | 0.29% over 20 steps |"
            ),
            "{md}"
        );
        assert!(
            rows[4].starts_with("| PyTorch in f32, no bf16 | 2.86% over 20 steps |"),
            "{md}"
        );
        assert!(charts[0].1.starts_with("<svg width=\"100%\""));
    }

    #[test]
    fn without_our_run_nothing_is_drawn() {
        let runs = vec![run("pytorch-eager", "bf16-mixed", 0.0)];
        assert!(render_all(&runs).unwrap().is_empty());
        assert!(is_precision_file(Path::new(
            "data/train-precision-ours.json"
        )));
        assert!(!is_precision_file(Path::new(
            "data/train-gpu-ours-flash.json"
        )));
    }
}
