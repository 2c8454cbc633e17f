//! The benchmark's printed table: one line per [`Row`] as it is measured. The rows
//! themselves, and the JSON the charts read, are the shared core's ([`flash_core::row`]).

use flash_core::Row;

/// The table's header; `cuda` prints TFLOP/s, the CPU GFLOP/s (its numbers are a
/// thousandth).
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

/// One row of the table; with `peak_gflops` (the CPU's measured f32 peak), the note of a
/// measured row gives its share of that peak.
pub fn table_line(row: &Row, cuda: bool, peak_gflops: Option<f64>) -> String {
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
    let note = match (&row.error, row.tflops, peak_gflops) {
        (Some(e), _, _) => e.clone(),
        (None, Some(t), Some(peak)) => {
            format!("{:.0}% of the f32 peak", 100.0 * t * 1e3 / peak)
        }
        _ => String::new(),
    };
    // [step 09]
    // a masked row's rate counts only the scores its mask keeps: the note gives their share
    let note = match row.density {
        Some(density) => format!("density {density:.3}; {note}"),
        None => note,
    };
    // [/step 09]
    format!(
        "{:<16} {:<8} {:>7} {:>11} {:>10} {:>12}  {note}",
        row.method,
        row.pass,
        row.tokens,
        row.ms.map_or("-".into(), |ms| format!("{ms:.3}")),
        rate,
        row.peak_bytes
            .map_or("-".into(), |b| format!("{:.1}", b as f64 / 1e6)),
    )
}
