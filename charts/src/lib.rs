//! # The charts
//!
//! Reads the benchmark's rows (`charts/data/*.json`, written by `cargo run --release --
//! --out` and by `charts/peers/pytorch_peers.py`) and draws SVG charts with plotters:
//!
//! - CPU: peak memory against length, and time against length, both on log scales (one pair
//!   for each pass found, `fwd` and `fwd+bwd`);
//! - GPU: TFLOP/s against length, and peak memory against length on a log scale, for `fwd`
//!   and for `fwd+bwd`;
//! - for each of those groups, the rows as Markdown tables (`cpu.md`, `gpu-fwd.md`, ...)
//!   that the book includes, so the book's numbers are the JSON's: a row per length, a
//!   column per method, and our best method's speed against the peers of `VERSUS`.
//!
//! Every method looks the same wherever it appears: one colour, one marker and one legend
//! in words, from `STYLES` (ours in blues and greens with filled markers and solid lines,
//! the peers in oranges, reds and greys with hollow markers and dashed lines); a method the
//! table does not know gets a look from its name. The SVGs carry a `viewBox` and no fixed
//! size, so they scale to the book's column.
//!
//! The drawing is a pure function of the rows: the same JSON gives byte-identical SVG, so
//! regenerating the committed charts shows no diff (a test checks both).
//!
//! ## Layout
//!
//! - [`read_dir`]: the rows of every JSON file, as the shared core's [`Row`].
//! - [`render_all`]: every chart and table the rows call for, as `(file name, text)`.
//! - [`train`]: the training runs' charts, from `charts/data/train-*.json`. // [step 05]
//! - [`decode`]: decoding's tables and chart, from `charts/data/decode*.json`. // [step 08]
//! - [`decode_cpu`]: decoding on the CPU, from `charts/data/decode-cpu*.json`. // [step 08]
//! - [`grouped`]: grouped-query attention's tables, from `charts/data/grouped*.json`. // [step 08]
//! - [`masks`]: the masks' tables and charts, from `charts/data/masks-*.json`. // [step 09]

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;

pub use flash_core::Row;
use flash_core::{Device, Pass, row};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

pub mod decode; // [step 08]
pub mod decode_cpu; // [step 08]
pub mod grouped; // [step 08]
pub mod masks; // [step 09]
pub mod train; // [step 05]

/// Measurements with charts of their own, apart from the main CPU and GPU ones: the rows of
/// `data/NAME*.json` draw `NAME-*.md` and, as the set says, `NAME-*.svg`. A step whose
/// method is measured in a call of its own (with the peers measured again beside it) keeps
/// its rows here, so the charts of earlier chapters stay as those chapters measured them. A
/// file belongs to the first set its name starts with, so a longer name comes before its
/// prefix.
pub const SETS: &[(&str, Drawn)] = &[
    // [step 06]
    ("hopper-ladder-d128", Drawn::Tables),
    ("hopper-ladder", Drawn::Tables),
    ("hopper-d128", Drawn::TablesAndRate),
    ("hopper", Drawn::TablesAndRate),
    // [/step 06]
];

/// What a set draws besides the main set's charts: its tables always (time, rate, peak
/// memory and the ratios), and the charts the book shows of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drawn {
    /// The tables alone.
    Tables,
    /// The tables and the rate's chart (its peak memory is in the tables).
    TablesAndRate,
}

impl Drawn {
    /// Whether a set drawn so writes the file `name` (as `render_all` names it).
    fn writes(self, name: &str) -> bool {
        !name.ends_with(".svg")
            || (self == Drawn::TablesAndRate && !name.contains("peak-memory"))
    }
}

/// Every chart and table of `dir/data/*.json`, as `(file name, text)`: the main set's from
/// the files no [`SETS`] name starts, and each set's, prefixed with its name.
pub fn render_dir(dir: &Path) -> Result<Vec<(String, String)>, String> {
    let data = dir.join("data");
    let mut charts = Vec::new();
    let set_of = |p: &Path| {
        let file = p.file_name().map(|f| f.to_string_lossy().to_string());
        SETS.iter()
            .find(|(s, _)| file.as_deref().is_some_and(|f| f.starts_with(*s)))
            .copied()
    };
    for set in std::iter::once(None).chain(SETS.iter().map(|s| Some(*s))) {
        let rows = read_files(&data, |p| set_of(p) == set)?;
        if rows.is_empty() {
            continue;
        }
        for (name, text) in render_all(&rows)? {
            match set {
                Some((s, drawn)) if drawn.writes(&name) => {
                    charts.push((format!("{s}-{name}"), text))
                }
                Some(_) => {}
                None => charts.push((name, text)),
            }
        }
    }
    // [step 05]
    // the training runs, ours and PyTorch's
    charts.extend(train::render_all(&train::read_runs(&data)?)?);
    // the same run rounded three ways
    charts.extend(train::precision::render_all(&train::precision::read_runs(
        &data,
    )?)?);
    // [/step 05]
    // [step 07]
    // data parallelism: the same training on one GPU and on several
    charts.extend(train::parallel::render_all(&train::parallel::read_runs(
        &data,
    )?)?);
    // [/step 07]
    // [step 08]
    // decoding against the read kernel, ours and PyTorch's
    if let Some(decoding) = decode::read(&data)? {
        charts.extend(decode::render_all(&decoding)?);
    }
    // decoding on the CPU, rung by rung, against the read loop and PyTorch's
    if let Some(decoding) = decode_cpu::read(&data)? {
        charts.extend(decode_cpu::render_all(&decoding)?);
    }
    // grouped-query attention in the training kernels, ours and PyTorch's
    if let Some(rows) = grouped::read(&data)? {
        charts.extend(grouped::render_all(&rows));
    }
    // the model trained with grouped heads
    charts.extend(train::kv_heads::render_all(&train::kv_heads::read_runs(
        &data,
    )?)?);
    // [/step 08]
    // [step 09]
    // the masked kernels against FlexAttention, a head dim at a time
    charts.extend(masks::render_all(&masks::read(&data)?)?);
    // [/step 09]
    Ok(charts)
}

// [step 08]
/// Chapter 8's measurements (`decode-bench`, `grouped-bench` and the PyTorch peer's
/// `--decode` and `--grouped`, `generate --out`): rows with keys of their own, which [`decode`] reads, not the main set's charts.
fn is_inference_file(p: &Path) -> bool {
    p.file_name().is_some_and(|f| {
        ["decode", "generate-", "grouped"]
            .iter()
            .any(|n| f.to_string_lossy().starts_with(n))
    })
}
// [/step 08]

/// Every row of every `*.json` file in `dir`, the files taken in name order.
pub fn read_dir(dir: &Path) -> Result<Vec<Row>, String> {
    read_files(dir, |_| true)
}

/// The rows of the `*.json` files in `dir` that `keep` keeps, the files in name order.
fn read_files(dir: &Path, keep: impl Fn(&Path) -> bool) -> Result<Vec<Row>, String> {
    let mut files: Vec<_> = fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json") && keep(p))
        .filter(|p| !train::is_run_file(p)) // [step 05]
        .filter(|p| !is_inference_file(p)) // [step 08]
        .filter(|p| !masks::is_mask_file(p)) // [step 09]
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

/// How one method looks everywhere it appears: the same colour, marker and words in every
/// chart and every table, whatever else the data holds.
struct Style {
    /// the method's name in the JSON rows
    name: &'static str,
    /// the device kind (`"cpu"`, ...) the entry is for; `""` for every device
    device: &'static str,
    /// the legend's words, without the step
    words: &'static str,
    /// a table's column head: a word or two, spelled out by the legend under the table
    short: &'static str,
    /// the step that brings the method, `None` for a peer
    step: Option<u8>,
    colour: RGBColor,
    marker: Marker,
    /// the method whose peak memory this one's is, byte for byte: the memory charts and
    /// tables leave this one out, as its line would only hide under the other's
    same_memory_as: Option<&'static str>,
}

/// Shapes that tell the methods apart in grey as well as in colour; ours are filled, the
/// peers' hollow (and their lines dashed).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Marker {
    Circle,
    Square,
    Triangle,
    TriangleDown,
    Diamond,
    Cross,
}

const fn ours(
    name: &'static str,
    words: &'static str,
    short: &'static str,
    step: u8,
    colour: RGBColor,
    marker: Marker,
) -> Style {
    Style {
        name,
        device: "",
        words,
        short,
        step: Some(step),
        colour,
        marker,
        same_memory_as: None,
    }
}

// [step 02]
const fn peer(
    name: &'static str,
    device: &'static str,
    words: &'static str,
    short: &'static str,
    colour: RGBColor,
    marker: Marker,
) -> Style {
    Style {
        name,
        device,
        words,
        short,
        step: None,
        colour,
        marker,
        same_memory_as: None,
    }
}
// [/step 02]

/// Every method's look, ours in blues and greens, the peers in oranges, reds and greys;
/// charts and tables list the methods in this order, ours first.
#[rustfmt::skip]
const STYLES: &[Style] = &[
    ours("naive", "attention by hand", "by hand", 1, RGBColor(0x08, 0x51, 0x9c), Marker::Circle),
    // [step 02]
    ours("online_loop", "online softmax, plain loops", "loops", 2, RGBColor(0x66, 0xc2, 0xa4), Marker::Triangle),
    ours("online", "online softmax, SIMD", "online", 2, RGBColor(0x23, 0x8b, 0x45), Marker::Square),
    // [/step 02]
    // [step 03]
    ours("cuda_naive", "attention by hand, cuBLAS", "by hand", 3, RGBColor(0x25, 0x34, 0x94), Marker::Circle),
    Style {
        same_memory_as: Some("cuda_flash"),
        ..ours("cuda_rows", "ladder rung 1: a thread per row", "rung 1", 3, RGBColor(0x6b, 0xae, 0xd6), Marker::Triangle)
    },
    Style {
        same_memory_as: Some("cuda_flash"),
        ..ours("cuda_shared", "ladder rung 2: shared memory", "rung 2", 3, RGBColor(0x2b, 0x8c, 0xbe), Marker::Diamond)
    },
    Style {
        same_memory_as: Some("cuda_flash"),
        ..ours("cuda_mma", "ladder rung 3: tensor cores, plain loads", "rung 3", 3, RGBColor(0x1c, 0x90, 0x99), Marker::Cross)
    },
    Style {
        same_memory_as: Some("cuda_flash"),
        ..ours("cuda_ldmatrix", "ladder rung 4: ldmatrix, swizzled tiles", "rung 4", 3, RGBColor(0x74, 0xc4, 0x76), Marker::TriangleDown)
    },
    ours("cuda_flash", "FlashAttention kernel", "flash", 3, RGBColor(0x00, 0x6d, 0x2c), Marker::Square),
    // [/step 03]
    // [step 06]
    // the Hopper ladder, rung by rung (each in the same memory as the kernel that runs),
    // then the kernel that runs
    Style {
        same_memory_as: Some("cuda_hopper"),
        ..ours("hopper_wgmma", "Hopper rung 1: TMA and wgmma", "wgmma", 6, RGBColor(0xa6, 0xbd, 0xdb), Marker::Triangle)
    },
    Style {
        same_memory_as: Some("cuda_hopper"),
        ..ours("hopper_producer_warpgroup", "Hopper rung 2: registers handed over", "setmaxnreg", 6, RGBColor(0x74, 0xa9, 0xcf), Marker::Diamond)
    },
    Style {
        same_memory_as: Some("cuda_hopper"),
        ..ours("hopper_turns", "Hopper rung 3: turns at the tensor cores", "turns", 6, RGBColor(0x36, 0x90, 0xc0), Marker::TriangleDown)
    },
    Style {
        same_memory_as: Some("cuda_hopper"),
        ..ours("hopper_overlap", "Hopper rung 4: the softmax beside the products", "overlap", 6, RGBColor(0x05, 0x70, 0xb0), Marker::Square)
    },
    ours("hopper_two_passes", "Hopper backward rung 1: two passes", "two passes", 6, RGBColor(0x04, 0x5a, 0x8d), Marker::Circle),
    Style {
        same_memory_as: Some("cuda_flash"),
        ..ours("cuda_hopper", "Hopper kernel: wgmma and TMA", "Hopper", 6, RGBColor(0x08, 0x30, 0x6b), Marker::Cross)
    },
    // [/step 06]
    // [step 02]
    peer("pytorch_by_hand", "", "PyTorch by hand", "PyTorch by hand", RGBColor(0x52, 0x52, 0x52), Marker::Circle),
    peer("pytorch_sdpa", "cpu", "PyTorch SDPA (CPU flash attention)", "PyTorch SDPA", RGBColor(0xe6, 0x55, 0x0d), Marker::Square),
    // [/step 02]
    // [step 03]
    peer("pytorch_sdpa_flash", "", "FlashAttention-2 via PyTorch", "FA-2", RGBColor(0xd6, 0x27, 0x28), Marker::Triangle),
    peer("pytorch_sdpa_cudnn", "", "cuDNN via PyTorch", "cuDNN", RGBColor(0xa6, 0x36, 0x03), Marker::Diamond),
    peer("pytorch_sdpa_efficient", "", "memory-efficient SDPA via PyTorch", "mem-eff.", RGBColor(0x96, 0x96, 0x96), Marker::TriangleDown),
    peer("pytorch_sdpa", "cuda", "PyTorch's default SDPA", "SDPA", RGBColor(0xfd, 0x8d, 0x3c), Marker::Square),
    // [/step 03]
    // [step 05]
    ours("cpu_fast_path", "fast path: a shard per core, faer's products", "fast path", 5, RGBColor(0x00, 0x44, 0x1b), Marker::Diamond),
    peer("pytorch_compiled", "", "PyTorch's default SDPA, torch.compile", "compiled", RGBColor(0xe7, 0x29, 0x8a), Marker::Cross),
    // [/step 05]
    // [step 09]
    ours("masked", "masks as code: step 06's Hopper kernels with the mask compiled in", "masked", 9, RGBColor(0x31, 0x82, 0xbd), Marker::Circle),
    peer("flex_attention", "", "FlexAttention via PyTorch (torch.compile, a block mask)", "FlexAttention", RGBColor(0x80, 0x00, 0x26), Marker::Square),
    // [/step 09]
];

/// Our best method at each length against the peer it is compared with, in the tables: the
/// peer's time over ours, so above 1 ours is faster.
const VERSUS: &[(&str, &str)] = &[
    // [step 02]
    ("online", "pytorch_sdpa"),
    // [/step 02]
    // [step 03]
    ("cuda_flash", "pytorch_sdpa_flash"),
    ("cuda_flash", "pytorch_sdpa_cudnn"),
    // [/step 03]
    // [step 06]
    ("hopper_wgmma", "pytorch_sdpa_cudnn"),
    ("hopper_producer_warpgroup", "pytorch_sdpa_cudnn"),
    ("hopper_turns", "pytorch_sdpa_cudnn"),
    ("hopper_overlap", "pytorch_sdpa_cudnn"),
    ("hopper_two_passes", "pytorch_sdpa_cudnn"),
    ("cuda_hopper", "pytorch_sdpa_flash"),
    ("cuda_hopper", "pytorch_sdpa_cudnn"),
    // [/step 06]
];

/// Colours for a method the table does not know, picked by its name so it keeps them.
const FALLBACK: [RGBColor; 4] = [
    RGBColor(0x75, 0x6b, 0xb1),
    RGBColor(0x8c, 0x6d, 0x31),
    RGBColor(0xce, 0x6d, 0xbd),
    RGBColor(0x7f, 0x7f, 0x7f),
];
const MARKERS: [Marker; 6] = [
    Marker::Circle,
    Marker::Square,
    Marker::Triangle,
    Marker::TriangleDown,
    Marker::Diamond,
    Marker::Cross,
];

/// A method's look as drawn: the table's entry, or for a name it lacks, one chosen from the
/// name's hash (so a new method draws without an edit here, and the same way every time).
#[derive(Clone)]
struct Look {
    /// where the method sorts: its place in `STYLES`, unknown names after
    rank: usize,
    ours: bool,
    colour: RGBColor,
    marker: Marker,
    words: String,
    short: String,
    step: Option<u8>,
    same_memory_as: Option<&'static str>,
}

/// `method`'s twin in memory (its style's `same_memory_as`) where `rows` bear it out: at
/// every length `method` was measured at, the twin took the same bytes. A method whose
/// memory has come apart from its twin's (a pass given a buffer of its own) is
/// drawn and tabled on its own.
fn memory_twin(method: &str, rows: &[&Row]) -> Option<&'static str> {
    let twin = look(method, rows.first()?.device_kind).same_memory_as?;
    let peak = |m: &str, tokens: usize| {
        rows.iter()
            .find(|r| r.method == m && r.tokens == tokens)
            .and_then(|r| r.peak_bytes)
    };
    rows.iter()
        .filter(|r| r.method == method)
        .all(|r| r.peak_bytes.is_some() && peak(twin, r.tokens) == r.peak_bytes)
        .then_some(twin)
}

fn look(method: &str, device: Device) -> Look {
    let kind = device.to_string();
    let found = STYLES
        .iter()
        .position(|s| s.name == method && s.device == kind)
        .or_else(|| {
            STYLES
                .iter()
                .position(|s| s.name == method && s.device.is_empty())
        });
    match found {
        Some(i) => {
            let s = &STYLES[i];
            Look {
                rank: i,
                ours: s.step.is_some(),
                colour: s.colour,
                marker: s.marker,
                words: s.words.to_string(),
                short: s.short.to_string(),
                step: s.step,
                same_memory_as: s.same_memory_as,
            }
        }
        None => {
            // FNV-1a: a hash that is the same on every machine and in every version
            let hash = method.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
            });
            Look {
                rank: STYLES.len(),
                ours: !method.starts_with("pytorch"),
                colour: FALLBACK[(hash % FALLBACK.len() as u64) as usize],
                marker: MARKERS[((hash >> 8) % MARKERS.len() as u64) as usize],
                words: method.to_string(),
                short: method.to_string(),
                step: None,
                same_memory_as: None,
            }
        }
    }
}

impl Look {
    /// The legend's words with the step that brings the method: `(step 02)`; a pass with
    /// the backward adds the step that brings every backward, `(steps 02 and 04)`, `(steps
    /// 03–04)`.
    fn label(&self, pass: Pass) -> String {
        match self.step {
            None => self.words.clone(),
            Some(s) if pass == Pass::Forward || s >= 4 => {
                format!("{} (step {s:02})", self.words)
            }
            Some(3) => format!("{} (steps 03–04)", self.words),
            Some(s) => format!("{} (steps {s:02} and 04)", self.words),
        }
    }
}

/// Every chart the rows call for, as `(file name, SVG)`, and the book's table of each group
/// of rows, as `(file name, Markdown)`, in a fixed order.
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
            charts.push((format!("cpu{suffix}.md"), table(&cpu)));
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
            // without the methods that allocate exactly what another one does
            let memory: Vec<&Row> = gpu
                .iter()
                .copied()
                .filter(|r| memory_twin(&r.method, &gpu).is_none())
                .collect();
            charts.push((
                format!("gpu-peak-memory-{name}.svg"),
                render(&memory, Quantity::PeakMemory)?,
            ));
            charts.push((format!("gpu-{name}.md"), table(&gpu)));
        }
    }
    Ok(charts)
}

/// The methods found in the rows, in the order of `STYLES`, ours before the peers, so that
/// neither colours nor columns depend on how the files are named or ordered.
fn method_order<'a>(rows: &[&'a Row]) -> Vec<&'a str> {
    let mut methods: Vec<(&str, Device)> = Vec::new();
    for r in rows {
        if !methods.iter().any(|(m, _)| *m == r.method) {
            methods.push((&r.method, r.device_kind));
        }
    }
    // ours first, by step, then in the order of STYLES (a ladder's rungs in turn)
    methods.sort_by_key(|&(m, d)| {
        let l = look(m, d);
        let listed = STYLES
            .iter()
            .position(|s| s.name == m)
            .unwrap_or(usize::MAX);
        (!l.ours, l.rank, listed, m)
    });
    methods.into_iter().map(|(m, _)| m).collect()
}

/// What a failed measurement says in a table cell, in place of a number.
fn failure(error: &str) -> &'static str {
    if error.contains("out of memory") {
        "out of memory"
    } else if error.contains("wrong result") {
        "wrong result"
    } else {
        "failed"
    }
}

/// A whole number's digits with its thousands separated by commas, as in the book's text:
/// `34940` as `34,940`.
fn thousands(whole: &str) -> String {
    let mut out = String::new();
    for (i, c) in whole.chars().enumerate() {
        if i > 0 && (whole.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Three significant digits, and all the digits of the whole part: `0.0318`, `9.18`,
/// `68.8`, `236`, `34,940`; so the fastest methods are told apart.
fn three_digits(v: f64) -> String {
    if !v.is_finite() || v <= 0.0 {
        return "0".into();
    }
    if v >= 99.95 {
        return thousands(&format!("{v:.0}"));
    }
    let decimals = (2 - v.log10().floor() as i32).max(0) as usize;
    format!("{v:.decimals$}")
}

/// The rows as the book's tables, first line the command that writes them: a row per length
/// and a column per method, for time (with the rate under it) and then for peak memory,
/// with our best method's speed against each peer of `VERSUS` found in the rows.
fn table(rows: &[&Row]) -> String {
    let cpu = rows[0].device_kind == Device::Cpu;
    let pass = rows[0].pass;
    let methods = method_order(rows);
    let looks: Vec<Look> = methods
        .iter()
        .map(|m| Look {
            same_memory_as: memory_twin(m, rows),
            ..look(m, rows[0].device_kind)
        })
        .collect();
    let mut lengths: Vec<usize> = rows.iter().map(|r| r.tokens).collect();
    lengths.sort();
    lengths.dedup();
    let find = |m: &str, t: usize| rows.iter().find(|r| r.method == m && r.tokens == t);
    let versus: Vec<(&str, &str)> = VERSUS
        .iter()
        .copied()
        .filter(|(a, b)| methods.contains(a) && methods.contains(b))
        .collect();
    let short = |m: &str| short_name(&methods, &looks, m);
    // with two of ours compared, a column names both sides: `Hopper vs cuDNN`
    let several = versus.iter().any(|(a, _)| *a != versus[0].0);
    let vs = |a: &str, b: &str| {
        if several {
            format!("{} vs {}", short(a), short(b))
        } else {
            format!("vs {}", short(b))
        }
    };

    let mut md = format!(
        "<!-- written by `cargo run -p charts` from charts/data/*.json: {} -->\n\n",
        distinct(rows, |r| r.device.clone()),
    );
    md.push_str(&format!(
        "**Time per call**, ms, with {} under it",
        if cpu { "GFLOP/s" } else { "TFLOP/s" }
    ));
    // the comparisons, grouped by our method: `vs FA-2`, `vs cuDNN`: the peer's time over
    // ours
    let mut ours_seen: Vec<&str> = Vec::new();
    for (a, _) in &versus {
        if ours_seen.contains(a) {
            continue;
        }
        ours_seen.push(a);
        let peers: Vec<String> = versus
            .iter()
            .filter(|(x, _)| x == a)
            .map(|(a, b)| format!("*{}*", vs(a, b)))
            .collect();
        md.push_str(&format!(
            "; {}: the peer's time over *{}*'s, above 1× *{}* is faster",
            peers.join(", "),
            short(a),
            short(a)
        ));
    }
    md.push_str(".\n\n");
    let heads: Vec<String> = looks.iter().map(|l| l.short.clone()).collect();
    let vs_heads: Vec<String> = versus.iter().map(|(a, b)| vs(a, b)).collect();
    // the ratios next to the length: a table wider than a phone's column scrolls, and what
    // it is there to say stays in view
    md.push_str(&format!(
        "| tokens |{} {} |\n| ---: |{}{}\n",
        vs_heads
            .iter()
            .map(|h| format!(" {h} |"))
            .collect::<String>(),
        heads.join(" | "),
        " ---: |".repeat(vs_heads.len()),
        " ---: |".repeat(heads.len()),
    ));
    for &t in &lengths {
        md.push_str(&format!("| {t} |"));
        for (a, b) in &versus {
            let ms = |m: &str| find(m, t).and_then(|r| r.ms).filter(|v| *v > 0.0);
            let cell = ms(a)
                .zip(ms(b))
                .map_or("–".to_string(), |(a, b)| format!("{:.2}×", b / a));
            md.push_str(&format!(" {cell} |"));
        }
        for m in &methods {
            let cell = match find(m, t) {
                None => "–".to_string(),
                Some(r) => match (r.ms, &r.error) {
                    (_, Some(e)) => failure(e).to_string(),
                    (Some(ms), None) => {
                        let rate = r.tflops.map_or("–".to_string(), |v| {
                            three_digits(if cpu { v * 1e3 } else { v })
                        });
                        format!("{}<br>{rate}", three_digits(ms))
                    }
                    (None, None) => "–".to_string(),
                },
            };
            md.push_str(&format!(" {cell} |"));
        }
        md.push('\n');
    }

    md.push_str(&memory_table(rows, &methods, &looks, &lengths));
    md.push_str(&column_meanings(&looks, pass));
    md
}

/// A column head's short name for method `m` (its name when it is not among `methods`).
fn short_name(methods: &[&str], looks: &[Look], m: &str) -> String {
    methods
        .iter()
        .position(|x| *x == m)
        .map_or(m.to_string(), |i| looks[i].short.clone())
}

/// The peak memory's table, as in the memory charts: a method that allocates exactly what
/// another does is left out, and said so.
fn memory_table(
    rows: &[&Row],
    methods: &[&str],
    looks: &[Look],
    lengths: &[usize],
) -> String {
    let find = |m: &str, t: usize| rows.iter().find(|r| r.method == m && r.tokens == t);
    let short = |m: &str| short_name(methods, looks, m);
    let mut md = String::new();
    let memory: Vec<usize> = (0..methods.len())
        .filter(|&i| looks[i].same_memory_as.is_none())
        .collect();
    let mut same = String::new();
    for i in 0..methods.len() {
        if let Some(other) = looks[i].same_memory_as {
            same.push_str(&format!(
                "{}*{}*",
                if same.is_empty() { " (" } else { ", " },
                looks[i].short
            ));
            if !looks[i + 1..]
                .iter()
                .any(|l| l.same_memory_as == Some(other))
            {
                let one = looks[..i].iter().all(|l| l.same_memory_as != Some(other));
                let verb = if one { "allocates" } else { "allocate" };
                same.push_str(&format!(" {verb} what *{}* does", short(other)));
            }
        }
    }
    if !same.is_empty() {
        same.push(')');
    }
    md.push_str(&format!(
        "\n**Peak memory** above the inputs, MB{same}.\n\n"
    ));
    md.push_str(&format!(
        "| tokens |{}\n| ---: |{}\n",
        memory
            .iter()
            .map(|&i| format!(" {} |", looks[i].short))
            .collect::<String>(),
        " ---: |".repeat(memory.len())
    ));
    for &t in lengths {
        md.push_str(&format!("| {t} |"));
        for &i in &memory {
            let cell = match find(methods[i], t) {
                None => "–".to_string(),
                Some(r) => match (r.peak_bytes, &r.error) {
                    (_, Some(e)) => failure(e).to_string(),
                    (Some(b), None) => three_digits(b as f64 / 1e6),
                    (None, None) => "–".to_string(),
                },
            };
            md.push_str(&format!(" {cell} |"));
        }
        md.push('\n');
    }
    md
}

/// What the short column heads stand for, where they are not the words themselves (empty
/// when none).
fn column_meanings(looks: &[Look], pass: Pass) -> String {
    let heads_meaning: Vec<String> = looks
        .iter()
        .filter(|l| l.short != l.label(pass))
        .map(|l| format!("*{}*: {}", l.short, l.label(pass)))
        .collect();
    match heads_meaning.is_empty() {
        true => String::new(),
        false => format!("\nColumns: {}.\n", heads_meaning.join("; ")),
    }
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

/// One entry of a legend at `(x, y)` (the middle of its left end): a stretch of the
/// method's line, solid for ours and dashed for a peer, with its marker on it, then the
/// words.
pub(crate) fn draw_legend_entry(
    root: &DrawingArea<SVGBackend, Shift>,
    l: &Look,
    label: &str,
    (x, y): (i32, i32),
) -> Result<(), String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let line = l.colour.stroke_width(2);
    if l.ours {
        root.draw(&PathElement::new(vec![(x, y), (x + 36, y)], line))
            .map_err(|x| e(&x))?;
    } else {
        root.draw(&PathElement::new(
            vec![(x, y), (x + 36, y)],
            dashed(l.colour, 2),
        ))
        .map_err(|x| e(&x))?;
    }
    draw_marker(root, l.marker, (x + 18, y), l.colour, l.ours)?;
    root.draw_text(
        label,
        &TextStyle::from(("sans-serif", LEGEND_FONT).into_font())
            .color(&BLACK)
            .pos(Pos::new(HPos::Left, VPos::Center)),
        (x + 48, y),
    )
    .map_err(|x| e(&x))?;
    Ok(())
}

/// Draws a method's marker centred on `(x, y)` (pixels of `area`): filled for ours, hollow
/// for the peers.
fn draw_marker(
    area: &DrawingArea<SVGBackend, Shift>,
    marker: Marker,
    (x, y): (i32, i32),
    colour: RGBColor,
    filled: bool,
) -> Result<(), String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let fill = if filled { colour } else { WHITE };
    let outline = colour.stroke_width(2);
    let polygon = |points: Vec<(i32, i32)>| -> Result<(), String> {
        let points: Vec<(i32, i32)> = points.iter().map(|(a, b)| (x + a, y + b)).collect();
        area.draw(&Polygon::new(points.clone(), fill.filled()))
            .map_err(|x| e(&x))?;
        let mut closed = points.clone();
        closed.push(points[0]);
        area.draw(&PathElement::new(closed, outline))
            .map_err(|x| e(&x))
    };
    match marker {
        Marker::Circle => {
            area.draw(&Circle::new((x, y), 5, fill.filled()))
                .map_err(|x| e(&x))?;
            area.draw(&Circle::new((x, y), 5, outline))
                .map_err(|x| e(&x))
        }
        Marker::Square => polygon(vec![(-5, -5), (5, -5), (5, 5), (-5, 5)]),
        Marker::Triangle => polygon(vec![(0, -7), (6, 4), (-6, 4)]),
        Marker::TriangleDown => polygon(vec![(0, 7), (6, -4), (-6, -4)]),
        Marker::Diamond => polygon(vec![(0, -7), (7, 0), (0, 7), (-7, 0)]),
        Marker::Cross => {
            area.draw(&PathElement::new(
                vec![(x - 5, y - 5), (x + 5, y + 5)],
                outline,
            ))
            .map_err(|x| e(&x))?;
            area.draw(&PathElement::new(
                vec![(x - 5, y + 5), (x + 5, y - 5)],
                outline,
            ))
            .map_err(|x| e(&x))
        }
    }
}

/// The opacity that marks a dashed line: plotters' `DashedLineSeries` writes a polyline for
/// every dash (hundreds for a long training curve), so a dashed line is drawn solid in a
/// colour of this opacity ([`dashed`]) and [`scalable`] makes it one dashed polyline.
const DASH_MARK: f64 = 0.996;

/// The style of a dashed line of `colour` and `width` (see [`DASH_MARK`]).
pub(crate) fn dashed(colour: RGBColor, width: u32) -> ShapeStyle {
    colour.mix(DASH_MARK).stroke_width(width)
}

/// plotters writes a fixed size (`<svg width="900" height="560" viewBox=...`); the book's
/// column is narrower than that, so the chart gets only its `viewBox` and the column's
/// width. A line marked dashed ([`dashed`]) gets its dashes.
fn scalable(svg: String) -> String {
    let svg = svg.replace(
        &format!("opacity=\"{DASH_MARK}\""),
        "opacity=\"1\" stroke-dasharray=\"8 5\"",
    );
    match (svg.find("<svg "), svg.find("viewBox=")) {
        (Some(start), Some(view)) if view > start => {
            let mut out = String::with_capacity(svg.len());
            out.push_str(&svg[..start]);
            out.push_str("<svg width=\"100%\" ");
            out.push_str(&svg[view..]);
            out
        }
        _ => svg,
    }
}

/// Width and row height of the legend under a chart, in pixels, and its font size.
const WIDTH: u32 = 900;
const PLOT_HEIGHT: u32 = 500;
const LEGEND_ROW: u32 = 30;
const LEGEND_FONT: u32 = 21;

/// One line of a chart: the method's look, its legend, its points.
type Series = (Look, String, Vec<(f64, f64)>);

fn render(rows: &[&Row], q: Quantity) -> Result<String, String> {
    let (title, subtitle) = titles(rows, q);
    let series = series(rows, q);
    let ((x_lo, x_hi), (y_lo, y_hi)) = ranges(rows, &series);
    let columns = legend_columns(&series);
    let legend_rows = (series.len() as u32).div_ceil(columns);
    let height = 62 + PLOT_HEIGHT + 10 + legend_rows * LEGEND_ROW + 10;

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        let e = |e: &dyn std::fmt::Display| e.to_string();
        root.fill(&WHITE).map_err(|x| e(&x))?;
        let (top, rest) = root.split_vertically(62);
        let (body, legend) = rest.split_vertically(PLOT_HEIGHT);
        top.draw_text(
            &title,
            &TextStyle::from(("sans-serif", 28).into_font()).color(&BLACK),
            (20, 8),
        )
        .map_err(|x| e(&x))?;
        top.draw_text(
            &subtitle,
            &TextStyle::from(("sans-serif", 21).into_font())
                .color(&RGBColor(0x44, 0x44, 0x44)),
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
        // each series' points in the root's pixels, for the markers drawn on top of the
        // lines
        let mut pixels: Vec<Vec<(i32, i32)>> = Vec::new();
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
                    .label_style(("sans-serif", 20))
                    .axis_desc_style(("sans-serif", 20))
                    .draw()
                    .map_err(|x| e(&x))?;
                for (l, _, points) in &series {
                    if l.ours {
                        chart
                            .draw_series(LineSeries::new(
                                points.iter().copied(),
                                l.colour.stroke_width(2),
                            ))
                            .map_err(|x| e(&x))?;
                    } else {
                        chart
                            .draw_series(LineSeries::new(
                                points.iter().copied(),
                                dashed(l.colour, 2),
                            ))
                            .map_err(|x| e(&x))?;
                    }
                    pixels.push(points.iter().map(|p| chart.backend_coord(p)).collect());
                }
            }};
        }
        let mut builder = ChartBuilder::on(&body);
        builder
            .margin_left(10)
            .margin_right(30)
            .margin_bottom(10)
            .x_label_area_size(55)
            .y_label_area_size(85);
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
        for ((l, _, _), points) in series.iter().zip(&pixels) {
            for &p in points {
                draw_marker(&root, l.marker, p, l.colour, l.ours)?;
            }
        }

        draw_legend(&root, &legend, &series, columns)?;
        root.present().map_err(|x| e(&x))?;
    }
    Ok(scalable(svg))
}

/// A chart's title (the quantity and the pass) and subtitle (the machine and the shape).
fn titles(rows: &[&Row], q: Quantity) -> (String, String) {
    let pass = rows[0].pass;
    let title = format!(
        "{}, causal {}",
        q.title(),
        if pass == Pass::Forward {
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
    (title, subtitle)
}

/// One series per method, in the methods' order: its look, its legend (failed lengths
/// noted) and its points (log2 of the length, value).
fn series(rows: &[&Row], q: Quantity) -> Vec<Series> {
    let pass = rows[0].pass;
    let methods = method_order(rows);
    methods
        .iter()
        .map(|&m| {
            let mine: Vec<&&Row> = rows.iter().filter(|r| r.method == m).collect();
            let l = look(m, mine[0].device_kind);
            let mut points: Vec<(f64, f64)> = mine
                .iter()
                .filter(|r| r.error.is_none())
                .filter_map(|r| q.value(r).map(|v| ((r.tokens as f64).log2(), v)))
                .collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            let failed: BTreeSet<usize> = mine
                .iter()
                .filter(|r| r.error.is_some())
                .map(|r| r.tokens)
                .collect();
            let words = l.label(pass);
            let label = match failed.first() {
                Some(t)
                    if mine.iter().any(|r| {
                        r.error
                            .as_deref()
                            .is_some_and(|e| e.contains("out of memory"))
                    }) =>
                {
                    format!("{words} (out of memory at {t} tokens)")
                }
                Some(t) => format!("{words} (failed at {t} tokens)"),
                None => words,
            };
            (l, label, points)
        })
        .collect()
}

/// The plot's ranges: the lengths' (log2), a quarter step either side, and the values'.
fn ranges(rows: &[&Row], series: &[Series]) -> ((f64, f64), (f64, f64)) {
    let xs: Vec<f64> = rows.iter().map(|r| (r.tokens as f64).log2()).collect();
    let (x_lo, x_hi) = (
        xs.iter().copied().fold(f64::INFINITY, f64::min) - 0.25,
        xs.iter().copied().fold(f64::NEG_INFINITY, f64::max) + 0.25,
    );
    let ys: Vec<f64> = series
        .iter()
        .flat_map(|(_, _, p)| p.iter().map(|&(_, y)| y))
        .collect();
    let (mut y_lo, mut y_hi) = (
        ys.iter().copied().fold(f64::INFINITY, f64::min),
        ys.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    );
    if ys.is_empty() {
        (y_lo, y_hi) = (1.0, 10.0);
    }
    ((x_lo, x_hi), (y_lo, y_hi))
}

/// The legend under the plot, in two columns when the labels are short enough (a label's
/// width estimated at 9 pixels a character, about half the font's size).
fn legend_columns(series: &[Series]) -> u32 {
    let longest = series
        .iter()
        .map(|(_, l, _)| l.chars().count())
        .max()
        .unwrap_or(0) as u32;
    if 30 + 48 + longest * 9 <= WIDTH / 2 {
        2
    } else {
        1
    }
}

/// The legend in `area`: for each series a stretch of the line with the marker on it, then
/// the words, in `columns` columns.
fn draw_legend(
    root: &DrawingArea<SVGBackend, Shift>,
    area: &DrawingArea<SVGBackend, Shift>,
    series: &[Series],
    columns: u32,
) -> Result<(), String> {
    let (legend_x, legend_y) = area.get_base_pixel();
    let column_width = WIDTH as i32 / columns as i32;
    for (i, (l, label, _)) in series.iter().enumerate() {
        let (row, column) = (i as u32 / columns, i as u32 % columns);
        let x = legend_x + 30 + column as i32 * column_width;
        let y = legend_y + 10 + (row * LEGEND_ROW + LEGEND_ROW / 2) as i32;
        draw_legend_entry(root, l, label, (x, y))?;
    }
    Ok(())
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
            // a name the table of looks does not know: drawn with a look from its name
            items.push(row("blocked", "cpu", "fwd", t, Some(x * 3.0)));
            // [step 04]
            items.push(row("flash", "cuda", "fwd+bwd", t, Some(x / 100.0)));
            // [/step 04]
        }
        row::from_json(&format!("[{}]", items.join(",")), "sample").unwrap()
    }

    // [step 02]
    #[test]
    fn the_ratio_to_the_peer_comes_right_after_the_length() {
        let mut items = Vec::new();
        for t in [1024u64, 2048] {
            items.push(row("online", "cpu", "fwd", t, Some(2.0)));
            items.push(row("pytorch_sdpa", "cpu", "fwd", t, Some(5.0)));
        }
        let rows = row::from_json(&format!("[{}]", items.join(",")), "sample").unwrap();
        let md = table(&rows.iter().collect::<Vec<_>>());
        // a table wider than a phone's column scrolls: the ratio is what stays in view
        assert!(
            md.contains("| tokens | vs PyTorch SDPA | online | PyTorch SDPA |"),
            "{md}"
        );
        assert!(md.contains("| 1024 | 2.50× | 2.00<br>"), "{md}");
    }
    // [/step 02]

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
                "gpu-peak-memory-fwd-bwd.svg",
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
            // the legend in words, with the step that brings the method
            "\nattention by hand (step 01) (out of memory at 8192 tokens)\n",
            "\nblocked\n",
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
        // a row per length, a column per method: naive at 4096 in the sample takes 4096²
        // ms, at 4096³·10⁻³ GFLOP/s; a failed cell says why, and no empty note column is
        // left
        assert!(md.contains("| tokens | by hand | blocked |"), "{md}");
        assert!(
            md.contains("| 4096 | 16,777,216<br>16,777,216,000 | 12,288<br>12,288,000 |"),
            "{md}"
        );
        assert!(md.contains("| 8192 | out of memory | 24,576<br>"), "{md}");
        assert!(!md.contains("note"), "{md}");
        assert!(
            md.contains("*by hand*: attention by hand (step 01)"),
            "{md}"
        );
    }

    #[test]
    fn charts_scale_to_the_column() {
        let mut svgs = 0;
        for (name, svg) in render_all(&sample()).unwrap() {
            if name.ends_with(".svg") {
                svgs += 1;
                assert!(
                    svg.starts_with("<svg width=\"100%\" viewBox=\"0 0 900 "),
                    "{name}: {}",
                    &svg[..80]
                );
                let root = svg.lines().next().unwrap();
                assert!(
                    !root.contains("height="),
                    "{name}: a fixed height in {root}"
                );
            }
        }
        assert!(svgs > 0, "the sample rows give no SVG chart");
    }

    #[test]
    fn a_method_keeps_its_colour_and_marker_across_charts() {
        // naive first in one set of rows, last and beside other methods in the other
        let rows = sample();
        let reordered: Vec<Row> = rows.iter().rev().cloned().collect();
        let only_blocked: Vec<Row> = rows
            .iter()
            .filter(|r| r.method == "blocked")
            .cloned()
            .collect();
        let colour = |m: &str| {
            let c = look(m, Device::Cpu).colour;
            format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
        };
        let (naive, blocked) = (colour("naive"), colour("blocked"));
        assert_ne!(naive, blocked);
        for set in [&rows, &reordered] {
            let charts = render_all(set).unwrap();
            for (name, svg) in charts.iter().filter(|(n, _)| n.starts_with("cpu-")) {
                assert!(svg.contains(&naive), "{name}: no {naive} for naive");
                assert!(svg.contains(&blocked), "{name}: no {blocked} for blocked");
            }
        }
        let charts = render_all(&only_blocked).unwrap();
        assert!(
            !charts[0].1.contains(&naive),
            "naive's colour drawn without naive"
        );
        assert!(charts[0].1.contains(&blocked));
        // a name nobody listed gets the same look every time, from the name alone
        let (a, b) = (
            look("new_method", Device::Cpu),
            look("new_method", Device::Cpu),
        );
        assert_eq!((a.colour, a.marker), (b.colour, b.marker));
        assert!(a.ours && !look("pytorch_new", Device::Cpu).ours);
        // every listed method has a look of its own
        for (i, x) in STYLES.iter().enumerate() {
            for y in &STYLES[i + 1..] {
                assert!(
                    x.name != y.name || x.device != y.device,
                    "{} listed twice",
                    x.name
                );
                assert!(
                    x.colour != y.colour,
                    "{} and {} share a colour",
                    x.name,
                    y.name
                );
            }
        }
    }

    #[test]
    fn numbers_have_three_significant_digits() {
        for (v, s) in [
            (0.031_84, "0.0318"),
            (0.152_3, "0.152"),
            (9.183, "9.18"),
            (68.81, "68.8"),
            (236.03, "236"),
            (34_939.65, "34,940"),
            (1_234_567.0, "1,234,567"),
        ] {
            assert_eq!(three_digits(v), s);
        }
    }

    #[test]
    fn labels_name_the_step() {
        assert_eq!(
            look("naive", Device::Cpu).label(Pass::Forward),
            "attention by hand (step 01)"
        );
        // [step 04]
        assert_eq!(
            look("naive", Device::Cpu).label(Pass::ForwardBackward),
            "attention by hand (steps 01 and 04)"
        );
        assert_eq!(
            look("cuda_flash", Device::Cuda).label(Pass::ForwardBackward),
            "FlashAttention kernel (steps 03–04)"
        );
        // [/step 04]
    }

    // [step 02]
    // step 01 measures nothing yet: chapter 2 brings the first measurements, and this test
    #[test]
    fn committed_charts_are_regenerated_from_committed_data() {
        // tests run in their package's folder: charts/ in this checkout, wherever it was
        // built
        let dir = Path::new(".");
        let charts = render_dir(dir).unwrap();
        assert!(
            !charts.is_empty(),
            "charts/data/ gives no charts: the committed ones are checked against nothing"
        );
        for (name, svg) in charts {
            let committed = fs::read_to_string(dir.join(&name)).unwrap_or_default();
            assert!(
                committed == svg,
                "charts/{name} is not what charts/data/ gives: run `cargo run -p charts`"
            );
        }
    }

    /// Every file of `charts/data/` is laid out one row a line, whichever program wrote it
    /// (the benchmark, the trainer, the PyTorch peers), so that a new measurement's diff is
    /// a diff of rows.
    #[test]
    fn data_files_are_laid_out_one_row_a_line() {
        let mut files = 0;
        for entry in fs::read_dir("data").unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "json") {
                let text = fs::read_to_string(&path).unwrap();
                assert!(
                    row::row_a_line(&text) == text,
                    "{} is not laid out one row a line (flash_core::row::row_a_line)",
                    path.display()
                );
                files += 1;
            }
        }
        assert!(files > 0, "no JSON files in charts/data/");
    }
    // [/step 02]
}
