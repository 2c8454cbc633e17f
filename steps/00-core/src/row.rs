//! One measurement as `charts/data/*.json` holds it: the benchmark writes these rows, the
//! charts read them, and the PyTorch peer script (`charts/peers/pytorch_peers.py`) writes
//! the same keys. A file is a JSON list of rows.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::files::{self, FileError};

use crate::check::Pass;
use crate::method::{Device, Dtype};

/// One measurement: a method at one shape and pass, or why it could not be measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Row {
    pub method: String,
    /// What ran: the method's implementation line (SIMD path, threads, kernel).
    pub implementation: String,
    /// One line about the machine: the CPU model and threads, or the GPU.
    pub device: String,
    /// Which charts the row belongs to.
    pub device_kind: Device,
    pub tokens: usize,
    pub batch: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub dtype: Dtype,
    pub pass: Pass,
    pub runs: usize,
    /// Median milliseconds of one call.
    pub ms: Option<f64>,
    /// FLOPs as FlashAttention counts them ([`Shape::flops`](crate::Shape::flops)) over the
    /// median time, in TFLOP/s.
    pub tflops: Option<f64>,
    /// Memory one call needs on top of its inputs.
    pub peak_bytes: Option<u64>,
    pub commit: String,
    pub date: String,
    /// Why the row has no time: "out of memory: ...", an unsupported shape, a device error,
    /// a wrong result.
    pub error: Option<String>,
    // [step 07]
    /// GPUs one call ran on (`--gpus`); 1 when the file does not say, as in files written
    /// before step 07, and left out of the file when it is 1.
    #[serde(default = "one_gpu", skip_serializing_if = "is_one_gpu")]
    pub gpus: usize,
    // [/step 07]
    // [step 09]
    /// The mask and score function (`--mask`, step 09) the row ran with; with one, `tflops`
    /// counts only the scores the mask keeps. Left out of the file when there is none, so
    /// an unmasked row reads and writes as before step 09.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask: Option<String>,
    /// The fraction of the `batch·heads·tokens²` scores the mask keeps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub density: Option<f64>,
    // [/step 09]
}

// [step 07]
fn one_gpu() -> usize {
    1
}

fn is_one_gpu(gpus: &usize) -> bool {
    *gpus == 1
}
// [/step 07]

impl Row {
    /// The shape the row measured.
    pub fn shape(&self) -> crate::Shape {
        crate::Shape::new(self.batch, self.heads, self.tokens, self.head_dim)
    }
}

/// The rows as a file holds them: a list, one row a line ([`row_a_line`]).
pub fn to_json(rows: &[Row]) -> String {
    to_json_row_a_line(rows)
}

/// `value` as JSON laid out one row a line ([`row_a_line`]), as every file of
/// `charts/data/` is written: the benchmark's rows, a training run's record, ring-scaling's
/// report.
pub fn to_json_row_a_line<T: Serialize + ?Sized>(value: &T) -> String {
    row_a_line(&serde_json::to_string(value).expect("plain values serialise"))
}

/// The JSON text `json` laid out one row a line, every token kept as it is written: a list
/// whose first item is an object (a list of rows: benchmark rows, a run's steps), when it
/// is the whole file or one of the file's fields, puts each item on a line of its own; an
/// object that is the whole file puts each field on a line of its own; everything else
/// stays on one line, items after `, ` and values after `: `. A file's diff is then a diff
/// of rows, and a run of 200 steps is 200 lines, not one a number. The PyTorch peers lay
/// out theirs the same way, and a test holds every file of `charts/data/` to it.
pub fn row_a_line(json: &str) -> String {
    // the tokens with the whitespace between them dropped
    let mut chars = Vec::with_capacity(json.len());
    let mut in_string = false;
    let mut escaped = false;
    for c in json.chars() {
        if in_string {
            in_string = escaped || c != '"';
            escaped = !escaped && c == '\\';
        } else if c.is_whitespace() {
            continue;
        } else {
            in_string = c == '"';
        }
        chars.push(c);
    }
    let mut out = String::with_capacity(chars.len() * 11 / 10);
    // for each list or object open: its bracket, and whether it puts its items on lines of
    // their own
    let mut open: Vec<(char, bool)> = Vec::new();
    let indent = |depth: usize| "  ".repeat(depth);
    let (mut in_string, mut escaped) = (false, false);
    for (i, &c) in chars.iter().enumerate() {
        if in_string {
            in_string = escaped || c != '"';
            escaped = !escaped && c == '\\';
            out.push(c);
            continue;
        }
        let next = chars.get(i + 1).copied();
        match c {
            '"' => {
                in_string = true;
                out.push(c);
            }
            '[' | '{' => {
                let empty = matches!(next, Some(']' | '}'));
                // the whole file, or one of the fields of a file that is an object
                let top = open.is_empty() || (open.len() == 1 && open[0].0 == '{');
                let rows = !empty
                    && match c {
                        '[' => top && next == Some('{'),
                        _ => open.is_empty(),
                    };
                out.push(c);
                open.push((c, rows));
                if rows {
                    out.push('\n');
                    out.push_str(&indent(open.len()));
                }
            }
            ']' | '}' => {
                if open.pop().is_some_and(|(_, rows)| rows) {
                    out.push('\n');
                    out.push_str(&indent(open.len()));
                }
                out.push(c);
            }
            ',' if open.last().is_some_and(|&(_, rows)| rows) => {
                out.push_str(",\n");
                out.push_str(&indent(open.len()));
            }
            ',' => out.push_str(", "),
            ':' => out.push_str(": "),
            _ => out.push(c),
        }
    }
    out.push('\n');
    out
}

/// The rows of one file; `source` names it in the error.
pub fn from_json(json: &str, source: &str) -> Result<Vec<Row>, String> {
    serde_json::from_str(json)
        .map_err(|e| format!("{source}: not a list of benchmark rows: {e}"))
}

// ANCHOR: rows_file
/// The file a sweep writes its rows to (`--out`): written once, whole, at the sweep's end,
/// and only if the sweep measured something, so that a sweep that is stopped, or whose
/// every row failed, leaves the file of an earlier run as it was. Along the way the rows
/// so far are rewritten whole after every row to a file beside it ([`RowsFile::partial`]:
/// `cpu.json` → `cpu.partial.json`), so a sweep stopped after hours loses nothing; that file
/// is removed once the target is written.
#[derive(Clone, Debug)]
pub struct RowsFile {
    flag: String,
    path: PathBuf,
    partial: PathBuf,
}

impl RowsFile {
    /// Checks, before any work, that `path` can be written as the output of `flag` and that
    /// no rows of an earlier, stopped sweep wait beside it (this sweep would replace them).
    pub fn check(flag: &str, path: &Path) -> Result<Self, FileError> {
        files::check_output(flag, path)?;
        let partial = partial_path(path);
        if partial.exists() {
            return Err(FileError {
                path: partial.clone(),
                what: format!(
                    "{flag}: this file holds the rows of an earlier sweep that was stopped; \
                     move it away, or rename it to {} to keep it as that sweep's result, \
                     before starting another",
                    path.display()
                ),
            });
        }
        Ok(RowsFile {
            flag: flag.to_string(),
            path: path.to_path_buf(),
            partial,
        })
    }

    /// The file the sweep's rows go to at its end.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file beside it that holds the rows so far while the sweep runs.
    pub fn partial(&self) -> &Path {
        &self.partial
    }

    /// Keeps the rows so far (`json`, the whole list) in [`RowsFile::partial`].
    pub fn save_so_far(&self, json: &str) -> Result<(), FileError> {
        files::write_atomic(&self.partial, json.as_bytes())
    }

    /// Ends the sweep: writes `json` (its `rows`) to the target and removes the rows so far;
    /// but with nothing `measured` (every row failed), leaves a target that exists as it
    /// was. Returns what was done, in words. On an error the target is as it was and the
    /// rows so far are still in [`RowsFile::partial`] (if they could be written there).
    pub fn finish(
        &self,
        json: &str,
        rows: usize,
        measured: bool,
    ) -> Result<String, FileError> {
        if !measured && self.path.exists() {
            let _ = std::fs::remove_file(&self.partial);
            return Ok(format!(
                "no row was measured: {} {} was left as it was",
                self.flag,
                self.path.display()
            ));
        }
        files::write_atomic(&self.path, json.as_bytes()).map_err(|e| FileError {
            what: if self.partial.exists() {
                format!(
                    "{}; the rows are kept in {}",
                    e.what,
                    self.partial.display()
                )
            } else {
                e.what
            },
            ..e
        })?;
        let _ = std::fs::remove_file(&self.partial);
        Ok(format!("wrote {rows} rows to {}", self.path.display()))
    }
}

/// Where a sweep writing `path` keeps its rows so far: `.partial` before the extension
/// (`cpu.json` → `cpu.partial.json`), or after a name without one.
pub fn partial_path(path: &Path) -> PathBuf {
    let name = match (path.file_stem(), path.extension()) {
        (Some(stem), Some(ext)) => format!(
            "{}.partial.{}",
            stem.to_string_lossy(),
            ext.to_string_lossy()
        ),
        _ => format!(
            "{}.partial",
            path.file_name().unwrap_or_default().to_string_lossy()
        ),
    };
    path.with_file_name(name)
}
// ANCHOR_END: rows_file

/// The commit these binaries were built from: `git rev-parse --short HEAD` when they were
/// built, `-dirty` if tracked files differed from it, `unknown` outside this repository's
/// git (`build.rs`). Baked in at build time: a binary copied to another machine (a GPU box)
/// names its own commit there, without the source or git.
pub const COMMIT: &str = env!("FLASH_COMMIT");

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
    fn a_sweep_writes_its_file_once_and_only_with_something_measured() {
        let dir = std::env::temp_dir().join(format!("rows-file-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cpu.json");
        assert_eq!(partial_path(&path), dir.join("cpu.partial.json"));
        assert_eq!(partial_path(Path::new("rows")), Path::new("rows.partial"));
        std::fs::write(&path, "the complete rows of an earlier sweep").unwrap();

        // rows along the way go beside the file, never over it
        let out = RowsFile::check("--out", &path).unwrap();
        out.save_so_far("[first]").unwrap();
        assert_eq!(std::fs::read_to_string(out.partial()).unwrap(), "[first]");
        // a second sweep refuses to start over the first one's rows so far
        let e = RowsFile::check("--out", &path).unwrap_err();
        assert!(e.what.contains("stopped") && e.path == out.partial(), "{e}");
        // nothing measured: the earlier file is left whole
        let said = out.finish("[failed rows]", 1, false).unwrap();
        assert!(said.contains("left as it was"), "{said}");
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "the complete rows of an earlier sweep"
        );
        assert!(!out.partial().exists());
        // ... and where there was none, the failed rows are written, with their reasons
        let fresh = dir.join("fresh.json");
        let rows = RowsFile::check("--out", &fresh).unwrap();
        rows.finish("[failed rows]", 1, false).unwrap();
        assert_eq!(std::fs::read_to_string(&fresh).unwrap(), "[failed rows]");
        // something measured: written whole, the rows so far removed
        let out = RowsFile::check("--out", &path).unwrap();
        out.save_so_far("[a]").unwrap();
        assert_eq!(
            out.finish("[a, b]", 2, true).unwrap(),
            format!("wrote 2 rows to {}", path.display())
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "[a, b]");
        assert!(!out.partial().exists());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_commit_is_a_hash_or_unknown() {
        let hash = COMMIT.strip_suffix("-dirty").unwrap_or(COMMIT);
        assert!(
            COMMIT == "unknown"
                || (hash.len() >= 7 && hash.chars().all(|c| c.is_ascii_hexdigit())),
            "{COMMIT}"
        );
    }

    #[test]
    fn files_are_laid_out_one_row_a_line() {
        // rows: a list of objects, each on a line of its own
        let rows = r#"[{"a": 1, "b": [1, 2], "c": {"d": "x, \"y\": [z]"}}, {"a": 1e-08}]"#;
        assert_eq!(
            row_a_line(rows),
            "[\n  {\"a\": 1, \"b\": [1, 2], \"c\": {\"d\": \"x, \\\"y\\\": [z]\"}},\n  {\"a\": 1e-08}\n]\n"
        );
        // a run: a field a line, its lists of objects a row a line, other lists on one line
        let run = "{\"config\":{\"layers\":2},\"steps\":[{\"step\":1,\"loss\":5.3},{\"step\":2,\
                   \"loss\":5.1}],\"ms\":[1.5,2.0],\"profile\":[],\"seconds\":1.0}";
        let want = "{\n  \"config\": {\"layers\": 2},\n  \"steps\": [\n    {\"step\": 1, \"loss\": 5.3},\n    \
                    {\"step\": 2, \"loss\": 5.1}\n  ],\n  \"ms\": [1.5, 2.0],\n  \"profile\": [],\n  \
                    \"seconds\": 1.0\n}\n";
        assert_eq!(row_a_line(run), want);
        // the layout is a fixed point, and whitespace is all it changes
        assert_eq!(row_a_line(want), want);
        let spread = run.replace(',', ",\n    ").replace(':', " :\t");
        assert_eq!(row_a_line(&spread), want);
        assert_eq!(row_a_line("[]"), "[]\n");
        assert_eq!(row_a_line(r#"[[{"a": 1}]]"#), "[[{\"a\": 1}]]\n");
        assert_eq!(row_a_line("{}"), "{}\n");
    }

    #[test]
    fn dates_are_civil_utc() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_798_761_599), "2026-12-31T23:59:59Z");
    }

    #[test]
    fn rows_round_trip_with_the_keys_the_peers_write() {
        // a row as charts/peers/pytorch_peers.py writes it
        let peer = r#"[{"batch": 1, "commit": "5b8e78e", "date": "2026-11-30T00:28:38Z",
            "device": "AMD EPYC (2 threads)", "device_kind": "cpu", "dtype": "f32", "error": null,
            "head_dim": 64, "heads": 12, "implementation": "torch SDPA", "method": "pytorch_sdpa",
            "ms": 15.0, "pass": "fwd", "peak_bytes": 7500000, "runs": 5, "tflops": 0.107,
            "tokens": 1024}]"#;
        let rows = from_json(peer, "peer").unwrap();
        assert_eq!(rows[0].pass, Pass::Forward);
        assert_eq!(rows[0].device_kind, Device::Cpu);
        assert_eq!(rows[0].gpus, 1); // [step 07]
        assert_eq!(from_json(&to_json(&rows), "again").unwrap(), rows);
        let bad = from_json(r#"[{"method": "x"}]"#, "bad.json").unwrap_err();
        assert!(
            bad.starts_with("bad.json: ") && bad.contains("missing field"),
            "{bad}"
        );
    }

    #[test]
    fn rows_carry_what_the_profiler_saw_pytorch_run() {
        // pytorch_sdpa rows as the peer script writes them after profiling PyTorch's
        // default: the operation (and on the GPU the kernels) after an arrow, in UTF-8 or
        // escaped. The CPU rows are from a run of the script; the GPU row has the shape of
        // one.
        let cpu = r#"[{"batch": 1, "commit": "c31a26e", "date": "2026-11-30T14:05:31Z",
            "device": "AMD EPYC (2 threads)", "device_kind": "cpu", "dtype": "f32", "error": null,
            "head_dim": 64, "heads": 12,
            "implementation": "torch 2.15.0+cu132 SDPA default (AVX512) → aten::_scaled_dot_product_flash_attention_for_cpu",
            "method": "pytorch_sdpa", "ms": 16.000205000182177, "pass": "fwd",
            "peak_bytes": 3846144, "runs": 1, "tflops": 0.00629137539168116, "tokens": 256}]"#;
        let rows = from_json(cpu, "cpu").unwrap();
        assert!(
            rows[0]
                .implementation
                .ends_with(" → aten::_scaled_dot_product_flash_attention_for_cpu")
        );
        assert_eq!(from_json(&to_json(&rows), "again").unwrap(), rows);
        // [step 03]
        let gpu = r#"[{"batch": 4, "commit": "c31a26e", "date": "2026-11-30T14:07:43Z",
            "device": "NVIDIA H200 (sm_90, CUDA 12.8)", "device_kind": "cuda", "dtype": "bf16",
            "error": null, "head_dim": 64, "heads": 12,
            "implementation": "torch 2.11 SDPA default (no backend forced) \u2192 aten::_scaled_dot_product_cudnn_attention; kernels: cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0",
            "method": "pytorch_sdpa", "ms": 3.5, "pass": "fwd", "peak_bytes": 100663296,
            "runs": 20, "tflops": 471.2, "tokens": 16384}]"#;
        let rows = from_json(gpu, "gpu").unwrap();
        assert_eq!(rows[0].device_kind, Device::Cuda);
        assert!(rows[0].implementation.contains(
            " → aten::_scaled_dot_product_cudnn_attention; kernels: cudnn_generated_"
        ));
        assert_eq!(from_json(&to_json(&rows), "again").unwrap(), rows);
        // [/step 03]
        // [step 04]
        let bwd = r#"[{"batch": 1, "commit": "c31a26e", "date": "2026-11-30T14:07:43Z",
            "device": "AMD EPYC (2 threads)", "device_kind": "cpu", "dtype": "f32", "error": null,
            "head_dim": 64, "heads": 12,
            "implementation": "torch 2.15.0+cu132 SDPA default (AVX512) → aten::_scaled_dot_product_flash_attention_for_cpu, aten::_scaled_dot_product_flash_attention_for_cpu_backward",
            "method": "pytorch_sdpa", "ms": 52.06883800019568, "pass": "fwd+bwd",
            "peak_bytes": 45748224, "runs": 1, "tflops": 0.006766456666435996, "tokens": 256}]"#;
        let rows = from_json(bwd, "bwd").unwrap();
        assert_eq!(rows[0].pass, Pass::ForwardBackward);
        assert!(rows[0].implementation.ends_with(
            "_flash_attention_for_cpu, aten::_scaled_dot_product_flash_attention_for_cpu_backward"
        ));
        // [/step 04]
    }

    #[test]
    fn flops_follow_the_anchors() {
        // FlashAttention's count: at T = 16384, B = 4, H = 12, D = 64, a 5.447 ms forward
        // is 302.8 TFLOP/s
        let shape = crate::Shape::new(4, 12, 16384, 64);
        let tf = shape.flops(Pass::Forward) / 5.447e-3 / 1e12;
        assert!((tf - 302.8).abs() < 0.1, "{tf}");
    }
}
