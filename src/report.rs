//! What the benchmark reports: one [`Row`] per method, length and pass, printed as a table and
//! written as JSON rows that `charts` (and the PyTorch script, which writes the same keys)
//! read.
//!
//! ## Layout
//!
//! - [`Row`] and [`Row::to_json`]: the schema of `charts/data/*.json`.
//! - [`table_header`], [`table_line`]: the printed table, one line per row as it is measured.
//! - [`commit`], [`utc_now`]: where and when a row was measured.

use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

/// One measurement: a method at one shape and pass, or why it could not be measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub method: String,
    /// What ran: the method's implementation line (SIMD path, threads, kernel).
    pub implementation: String,
    /// One line about the machine: the CPU model and threads, or the GPU.
    pub device: String,
    /// `cpu` or `cuda`: which charts the row belongs to.
    pub device_kind: String,
    pub tokens: usize,
    pub batch: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub dtype: String,
    /// `fwd` or `fwd+bwd`.
    pub pass: String,
    pub runs: usize,
    /// Median milliseconds of one call.
    pub ms: Option<f64>,
    /// FLOPs as FlashAttention counts them (see [`flops`]) over the median time.
    pub tflops: Option<f64>,
    /// Memory one call needs on top of its inputs.
    pub peak_bytes: Option<u64>,
    pub commit: String,
    pub date: String,
    /// Why the row has no time: "out of memory: ...", an unsupported shape, a device error.
    pub error: Option<String>,
}

/// FLOPs of one causal call, as FlashAttention, Triton and the tutorial count them: the
/// forward's two `T·T·D` products of multiply-adds per head, halved by the mask,
/// `4·B·H·T²·D / 2`; the backward is 2.5 forwards, so forward and backward are 3.5.
pub fn flops(batch: usize, heads: usize, tokens: usize, head_dim: usize, backward: bool) -> f64 {
    let forward = 4.0 * (batch * heads) as f64 * (tokens as f64).powi(2) * head_dim as f64 / 2.0;
    if backward { 3.5 * forward } else { forward }
}

impl Row {
    pub fn to_json(&self) -> Value {
        json!({
            "method": self.method,
            "implementation": self.implementation,
            "device": self.device,
            "device_kind": self.device_kind,
            "tokens": self.tokens,
            "batch": self.batch,
            "heads": self.heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "pass": self.pass,
            "runs": self.runs,
            "ms": self.ms,
            "tflops": self.tflops,
            "peak_bytes": self.peak_bytes,
            "commit": self.commit,
            "date": self.date,
            "error": self.error,
        })
    }
}

/// The rows as the JSON file holds them: a list, one object per row, keys sorted.
pub fn to_json(rows: &[Row]) -> String {
    let list: Vec<Value> = rows.iter().map(Row::to_json).collect();
    let mut text = serde_json::to_string_pretty(&list).expect("rows are plain values");
    text.push('\n');
    text
}

/// The table's header; `cuda` prints TFLOP/s, the CPU GFLOP/s (its numbers are a thousandth).
pub fn table_header(cuda: bool) -> String {
    format!(
        "{:<16} {:<8} {:>7} {:>11} {:>10} {:>12}  note",
        "method",
        "pass",
        "tokens",
        "ms",
        if cuda { "TFLOP/s" } else { "GFLOP/s" },
        "peak MB"
    )
}

pub fn table_line(row: &Row, cuda: bool) -> String {
    let rate = row
        .tflops
        .map(|t| {
            if cuda {
                format!("{t:.1}")
            } else {
                format!("{:.1}", t * 1e3)
            }
        })
        .unwrap_or_else(|| "-".into());
    format!(
        "{:<16} {:<8} {:>7} {:>11} {:>10} {:>12}  {}",
        row.method,
        row.pass,
        row.tokens,
        row.ms.map_or("-".into(), |ms| format!("{ms:.3}")),
        rate,
        row.peak_bytes
            .map_or("-".into(), |b| format!("{:.1}", b as f64 / 1e6)),
        row.error.as_deref().unwrap_or("")
    )
}

/// `$BENCH_COMMIT` if set, else `git rev-parse --short HEAD`, or "unknown" outside a git checkout.
pub fn commit() -> String {
    // a copy of the tree on another machine (a GPU box) is no git checkout: the caller names
    // the commit it was copied from
    if let Some(c) = std::env::var("BENCH_COMMIT").ok().filter(|c| !c.is_empty()) {
        return c;
    }
    Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// The time now in UTC as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    utc(secs)
}

fn utc(secs: u64) -> String {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // days since 1970-01-01 to a civil date (Howard Hinnant's `civil_from_days`)
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_civil_utc() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_798_761_599), "2026-12-31T23:59:59Z");
    }

    #[test]
    fn flops_follow_the_anchors() {
        // FlashAttention's count: at T = 16384, B = 4, H = 12, D = 64, a 5.447 ms forward is 302.8 TFLOP/s
        let tf = flops(4, 12, 16384, 64, false) / 5.447e-3 / 1e12;
        assert!((tf - 302.8).abs() < 0.1, "{tf}");
        assert_eq!(flops(1, 1, 2, 4, true), 3.5 * flops(1, 1, 2, 4, false));
    }
}
