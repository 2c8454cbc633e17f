//! The rows `decode-bench` (the GPU) and `decode-cpu` (the CPU) write: one measurement of
//! one method at one shape, in one schema, so that the charts and the peers read both. Each
//! tool checks its `--out` before any work ([`RowsFile::check`]), keeps the rows so far
//! beside it after every row ([`keep_so_far`]) and writes it whole at the end
//! ([`write_out`]).

use flash_core::files::FileError;
use flash_core::row::{RowsFile, to_json_row_a_line};
use serde::Serialize;

/// One measurement: a method at one shape, or why it has none.
#[derive(Clone, Debug, Serialize)]
pub struct DecodeRow {
    /// On the GPU `decode` (contiguous cache), `decode_paged`, `read` (the read kernel); on
    /// the CPU `decode_cpu`, `read_cpu` (the read loop)
    pub method: String,
    pub implementation: String,
    pub device: String,
    pub commit: String,
    pub date: String,
    pub batch: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub q_rows: usize,
    pub context: usize,
    pub head_dim: usize,
    pub dtype: String,
    /// Tokens per page of a paged cache
    pub page_size: Option<usize>,
    /// Thread blocks the keys of each (sequence, kv head) were split over
    pub splits: Option<usize>,
    pub runs: usize,
    /// Median microseconds of one call
    pub us: Option<f64>,
    /// Bytes of k and v read: `2 · batch · kv_heads · context · head_dim` values
    pub bytes: u64,
    pub gb_s: Option<f64>,
    /// GB/s as a fraction of the read kernel's (or loop's) over the same bytes, in the
    /// same run
    pub fraction_of_read: Option<f64>,
    pub error: Option<String>,
}

/// One measurement of `grouped-bench`: a pass of the training kernels with grouped-query
/// attention at one shape, or why it has none.
#[derive(Clone, Debug, Serialize)]
pub struct GroupedRow {
    /// `cuda_flash` (step 03's forward), `cuda_hopper` (step 06's), `cuda_backward`
    /// (step 03's forward and step 04's backward); the peers' `pytorch_sdpa*`
    pub method: String,
    pub implementation: String,
    pub device: String,
    pub commit: String,
    pub date: String,
    pub batch: usize,
    /// Query heads
    pub heads: usize,
    /// Heads of k and v, each serving `heads / kv_heads` query heads
    pub kv_heads: usize,
    pub tokens: usize,
    pub head_dim: usize,
    pub dtype: String,
    /// `fwd` or `fwd+bwd`
    pub pass: String,
    pub runs: usize,
    /// Median milliseconds of one pass
    pub ms: Option<f64>,
    /// The FLOPs of plain attention with `heads` heads over `ms`
    pub tflops: Option<f64>,
    pub error: Option<String>,
}

/// After each row of a sweep: the rows so far, whole, in `--out`'s `FILE.partial.json`
/// ([`RowsFile`]). Not fatal when they cannot be written (the rows are in memory, and
/// `--out` is written at the end): it says so on stderr.
pub fn keep_so_far<R: Serialize>(out: Option<&RowsFile>, rows: &[R]) {
    if let Some(out) = out
        && let Err(e) = out.save_so_far(&to_json_row_a_line(rows))
    {
        eprintln!("the rows so far could not be kept: {e}");
    }
}

/// At a sweep's end: `--out` written whole, over an earlier file only if a row was
/// `measured` ([`RowsFile::finish`]); prints what was done.
pub fn write_out<R: Serialize>(
    out: Option<&RowsFile>,
    rows: &[R],
    measured: bool,
) -> Result<(), FileError> {
    if let Some(out) = out {
        let said = out.finish(&to_json_row_a_line(rows), rows.len(), measured)?;
        println!("\n{said}");
    }
    Ok(())
}
