//! The benchmark: every chosen method at every length, time and peak memory, one row each.
//!
//! Time: one warm-up call, then the median of `--runs` calls, each timed around the
//! attention call alone; the inputs are made before. On the GPU a method times itself with
//! events on its stream ([`DeviceRun::time_ms`]), after preparing its inputs once.
//!
//! Peak memory on the CPU: a fresh process per method and length. The benchmark runs itself
//! with a hidden first argument ([`PEAK_CHILD`]); the child makes the inputs, resets the
//! resident high-water mark (`echo 5 > /proc/self/clear_refs`), reads `VmHWM` from
//! `/proc/self/status` before and after one call, and prints the growth. `getrusage`'s
//! `ru_maxrss` would not do: on Linux a child inherits its parent's high-water mark across
//! fork and exec, so a small measurement after a large one would report the large one. The
//! child runs first, so a length that does not fit in memory is found in a process that may
//! die (the OOM killer's SIGKILL, or the allocator's abort) and reported as "out of
//! memory", and the benchmark itself never tries that call.
//!
//! The rows go to `--out` once, whole, at the sweep's end ([`RowsFile`]); along the way
//! they are kept in `FILE.partial.json` after every row. Ctrl-C stops the sweep after the
//! row in progress (a row it broke is not kept) and leaves `--out` as it was, the rows so
//! far in that file; a second Ctrl-C stops at once.
//!
//! ## Layout
//!
//! - [`run`]: the sweep; prints the device, the methods, then one table line per row.
//! - [`measure_cpu`], [`measure_gpu`]: one row; [`estimate_s`] and [`with_progress`]: a row
//!   estimated at more than a minute is announced with its estimate (and, on the CPU, the
//!   memory its inputs take), and a row still running says so every 10 s.
//! - [`peak_child`]: the hidden child's side; [`peak_in_child`] the parent's.
//! - [`cpu_description`], [`simd_level`]: what the header says about the machine.

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use flash_core::inputs::{random_normal, random_qkv};
use flash_core::{AttnError, Shape, memory_and_swap};
use ndarray::Array4;

use flash_core::row::{self, Row, RowsFile};
use flash_core::timing::median_ms; // [step 03]
use flash_core::timing::{Warmup, cpu_median_ms};
use flash_core::{Attention, Dtype, Pass, reference};

use crate::cli::{BenchArgs, PEAK_CHILD};
use crate::methods::{Device, Method};
// [step 03]
use crate::methods::DeviceRunSpec;
// [/step 03]
use crate::report;

/// The seed of every benchmark input: the same inputs on every machine and in every
/// process.
const SEED: u64 = 2024;
// [step 03]
/// How long a GPU method runs before it is timed.
const GPU_WARMUP_MS: f64 = 200.0;
// [/step 03]
/// Exit code of a child whose method returned `AttnError::OutOfMemory`.
const EXIT_OOM: i32 = 3;

/// Exit status of a sweep stopped by Ctrl-C (128 + SIGINT, as a shell reports it).
pub const EXIT_STOPPED: u8 = 130;

/// What a sweep measured, and whether Ctrl-C stopped it before its end.
#[derive(Clone, Debug)]
pub struct Sweep {
    pub rows: Vec<Row>,
    pub stopped: bool,
}

/// Set by the first Ctrl-C (or SIGTERM): the sweep stops after the row in progress.
static STOP: AtomicBool = AtomicBool::new(false);

/// Installs the Ctrl-C handler, once per process: the first press asks the sweep to stop
/// after the row in progress; the second stops at once (the rows so far are whole on disk:
/// each save is a rename).
fn stop_on_ctrl_c() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let handler = ctrlc::set_handler(|| {
            if STOP.swap(true, Ordering::SeqCst) {
                std::process::exit(i32::from(EXIT_STOPPED));
            }
            eprintln!(
                "\nCtrl-C: stopping after the row in progress; press it again to stop at once"
            );
        });
        if let Err(e) = handler {
            eprintln!("Ctrl-C will stop the sweep at once (no handler: {e})");
        }
    });
}

/// The whole sweep: prints the device, the methods and a table, and returns the rows. With
/// `--out`, keeps the rows so far in `FILE.partial.json` after every row and writes `--out`
/// whole at the end ([`RowsFile`]).
pub fn run(args: &BenchArgs) -> Result<Sweep, String> {
    let rows_file = args
        .out
        .as_deref()
        .map(|out| RowsFile::check("--out", out))
        .transpose()
        .map_err(|e| e.to_string())?;
    let chosen: &[&dyn Method] = &args.methods;
    // [step 09]
    // with a mask, step 09's masked attention runs once a length, in the methods' place
    let chosen = match &args.mask {
        Some(_) => &chosen[..chosen.len().min(1)],
        None => chosen,
    };
    // [/step 09]
    stop_on_ctrl_c();
    let cuda = args.device != Device::Cpu;
    let (stamp, peak_gflops, implementations) = open_sweep(args, chosen, cuda)?;

    let total = chosen.len() * args.lengths.len();
    let mut rows = Vec::new();
    // each method's last measured row, for the next row's estimate
    let mut pace: HashMap<&str, Pace> = HashMap::new();
    'sweep: for &tokens in &args.lengths {
        for (&m, imp) in chosen.iter().zip(&implementations) {
            if STOP.load(Ordering::SeqCst) {
                break 'sweep;
            }
            let shape = Shape::new(args.batch, args.heads, tokens, args.head_dim);
            let name = m.name();
            // [step 09]
            let name = if args.mask.is_some() { MASKED } else { name };
            // [/step 09]
            eprintln!(
                "[{}/{total}] {name} at {tokens} tokens ({}) ...",
                rows.len() + 1,
                args.pass()
            );
            let estimate = announce(m, shape, args, pace.get(m.name()).copied(), cuda);
            // [step 09]
            let masked = args.mask.as_ref().map(|spec| Masked::new(spec, shape));
            // [/step 09]
            let started = Instant::now();
            let measured = with_progress(estimate, || {
                // [step 09]
                match &masked {
                    Some(Ok(masked)) => return masked.measure(shape, args),
                    Some(Err(e)) => return Err(e.clone()),
                    None => {}
                }
                // [/step 09]
                // [step 03]
                if cuda {
                    return measure_gpu(m, shape, args);
                }
                // [/step 03]
                measure_cpu(m, shape, args)
            });
            if measured.is_ok() {
                let seconds = started.elapsed().as_secs_f64();
                let flops = shape.flops(args.pass());
                pace.insert(
                    m.name(),
                    Pace {
                        seconds,
                        flops,
                        tokens,
                    },
                );
            }
            let row = new_row(args, m, imp, &stamp, shape, measured);
            // [step 09]
            let row = match &masked {
                Some(Ok(masked)) => masked.mark(row, args.pass()),
                _ => row,
            };
            // [/step 09]
            // Ctrl-C reaches the peak's child too, which then fails: a row that failed
            // while the sweep was being stopped is not the method's failure
            if STOP.load(Ordering::SeqCst) && row.error.is_some() {
                eprintln!("      stopped: this row was broken off and is not kept");
                break 'sweep;
            }
            println!("{}", report::table_line(&row, cuda, peak_gflops));
            eprintln!("      done in {:.1} s", started.elapsed().as_secs_f64());
            rows.push(row);
            if let Some(file) = &rows_file
                && let Err(e) = file.save_so_far(&row::to_json(&rows))
            {
                // not fatal: the rows are in memory, and --out is written at the end
                eprintln!("      the rows so far could not be kept: {e}");
            }
        }
    }
    let stopped = STOP.load(Ordering::SeqCst);
    finish_rows(rows_file.as_ref(), &rows, stopped)?;
    Ok(Sweep { rows, stopped })
}

/// The sweep's opening: the device described and printed (on the CPU with its SIMD level
/// and f32 peak, which each CPU row's note compares with), then the shape and the methods;
/// returns the stamp every row carries, that peak, and each method's implementation.
fn open_sweep(
    args: &BenchArgs,
    chosen: &[&dyn Method],
    cuda: bool,
) -> Result<(Stamp, Option<f64>, Vec<String>), String> {
    let device = cpu_description();
    // [step 03]
    let device = if cuda {
        chosen[0].describe_device().map_err(|e| e.to_string())?
    } else {
        device
    };
    // [/step 03]
    let stamp = Stamp {
        device,
        commit: row::COMMIT.to_string(),
        date: row::utc_now(),
    };

    println!("device: {}", stamp.device);
    if !cuda {
        println!("SIMD: {}", simd_level());
    }
    // the GFLOP/s of a CPU row as a share of what this machine's cores can do at most
    let peak_gflops: Option<f64> = None;
    // [step 02]
    let peak_gflops = match cuda {
        true => peak_gflops,
        false => step02_online_softmax::peak::f32_peak_gflops(
            step02_online_softmax::Isa::detect(),
        ),
    };
    if let Some(peak) = peak_gflops {
        println!(
            "f32 peak: {peak:.0} GFLOP/s, measured with multiply-add chains on every thread \
             (a row's note gives its share)"
        );
    }
    // [/step 02]
    let implementations: Vec<String> = chosen.iter().map(|m| m.implementation()).collect();
    // [step 09]
    let implementations = match &args.mask {
        Some(_) => vec![masked_implementation(args)],
        None => implementations,
    };
    // [/step 09]
    print_sweep(args, &implementations, cuda);
    Ok((stamp, peak_gflops, implementations))
}

/// What every row of a sweep carries: the device it ran on, the commit and the date.
struct Stamp {
    device: String,
    commit: String,
    date: String,
}

/// The sweep's shape, the methods it runs and the table's header.
fn print_sweep(args: &BenchArgs, implementations: &[String], cuda: bool) {
    let pattern = "causal".to_string();
    // [step 09]
    let pattern = match &args.mask {
        Some(spec) => format!("mask {}", spec.text()),
        None => pattern,
    };
    // [/step 09]
    println!(
        "shape: batch {}, heads {}, head_dim {}, {}, {pattern}; pass {}; median of {} runs after a warm-up",
        args.batch,
        args.heads,
        args.head_dim,
        args.dtype,
        args.pass(),
        args.runs
    );
    // [step 09]
    if args.mask.is_some() {
        println!("  {MASKED:<16} (step 09) {}", implementations[0]);
        println!();
        println!("{}", report::table_header(cuda));
        return;
    }
    // [/step 09]
    if !args.left_out.is_empty() {
        println!("left out, no backward pass: {}", args.left_out.join(", "));
    }
    for (m, imp) in args.methods.iter().zip(implementations) {
        println!("  {:<16} (step {}) {imp}", m.name(), m.step());
    }
    println!();
    println!("{}", report::table_header(cuda));
}

/// The row's estimate, said when the row will be long (with its inputs' size on the CPU).
fn announce(
    m: &dyn Method,
    shape: Shape,
    args: &BenchArgs,
    pace: Option<Pace>,
    cuda: bool,
) -> Option<f64> {
    // (inputs that cannot fit are reported at once, without an estimate)
    let fits = cuda
        || memory_and_swap().is_none_or(|have| input_bytes(shape, args.pass()) <= have);
    let estimate = fits
        .then(|| estimate_s(m, shape, args, pace, cuda))
        .flatten();
    if let Some(est) = estimate.filter(|&est| est > ANNOUNCE_AFTER_S) {
        let memory = if cuda {
            String::new()
        } else {
            format!(
                "; its inputs take {}",
                bytes(input_bytes(shape, args.pass()))
            )
        };
        eprintln!("      this row will take about {}{memory}", seconds(est));
    }
    estimate
}

/// The row of method `m` (described as `imp`) at `shape`, from what was measured.
fn new_row(
    args: &BenchArgs,
    m: &dyn Method,
    imp: &str,
    stamp: &Stamp,
    shape: Shape,
    measured: Result<Measured, String>,
) -> Row {
    let (ms, peak_bytes, error) = match measured {
        Ok(Measured { ms, peak_bytes }) => (Some(ms), peak_bytes, None),
        Err(e) => (None, None, Some(e)),
    };
    let flops = shape.flops(args.pass());
    Row {
        method: m.name().to_string(),
        implementation: imp.to_string(),
        device: stamp.device.clone(),
        device_kind: args.device,
        tokens: shape.tokens,
        batch: args.batch,
        heads: args.heads,
        head_dim: args.head_dim,
        dtype: args.dtype,
        pass: args.pass(),
        runs: args.runs,
        ms,
        tflops: ms.map(|ms| flops / (ms * 1e-3) / 1e12),
        peak_bytes,
        commit: stamp.commit.clone(),
        date: stamp.date.clone(),
        error,
        gpus: args.gpus, // [step 07]
        // [step 09]
        mask: None,
        density: None,
        // [/step 09]
    }
}

/// `--out` at the end of the sweep: written whole, or, after Ctrl-C, left as it was.
fn finish_rows(
    rows_file: Option<&RowsFile>,
    rows: &[Row],
    stopped: bool,
) -> Result<(), String> {
    match rows_file {
        Some(file) if stopped => {
            let kept = if !rows.is_empty() && file.partial().exists() {
                format!(
                    "the {} rows so far are in {}",
                    rows.len(),
                    file.partial().display()
                )
            } else {
                "no row was kept".to_string()
            };
            println!(
                "\nstopped by Ctrl-C: --out {} was left as it was; {kept}",
                file.path().display()
            );
        }
        Some(file) => {
            let measured = rows.iter().any(|r| r.ms.is_some());
            let said = file
                .finish(&row::to_json(rows), rows.len(), measured)
                .map_err(|e| e.to_string())?;
            println!("\n{said}");
        }
        None if stopped => println!("\nstopped by Ctrl-C after {} rows", rows.len()),
        None => {}
    }
    Ok(())
}

/// A row whose estimate is longer than this is announced, with the estimate.
const ANNOUNCE_AFTER_S: f64 = 60.0;
/// How often a row that is still running says so.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);
/// Tokens of the quick call that gives a method's speed before its first row.
const PROBE_TOKENS: usize = 256;

/// A method's last measured row: its whole wall time (the peak child and the check
/// included), its FLOPs and its tokens.
#[derive(Clone, Copy)]
struct Pace {
    seconds: f64,
    flops: f64,
    tokens: usize,
}

/// About how long a row will take, in seconds: the method's last row's time, scaled by the
/// FLOPs on the CPU, where the computing is most of a row, and by the tokens on a GPU,
/// where most of a row is its check on the CPU (a sample of rows, each as long as the
/// sequence); or, before a CPU method's first row, the speed of one quick call at
/// [`PROBE_TOKENS`] tokens, times the calls a row makes (the peak child's, the check's and
/// the timed runs). None for a GPU method's first row: a quick call there would compile its
/// kernels.
fn estimate_s(
    m: &dyn Method,
    shape: Shape,
    args: &BenchArgs,
    pace: Option<Pace>,
    cuda: bool,
) -> Option<f64> {
    let pass = args.pass();
    let flops = shape.flops(pass);
    if let Some(last) = pace {
        let scale = if cuda {
            shape.tokens as f64 / last.tokens as f64
        } else {
            flops / last.flops
        };
        return Some(last.seconds * scale);
    }
    // [step 09]
    // a probe would time the method, not the masked attention that runs in its place
    if args.mask.is_some() {
        return None;
    }
    // [/step 09]
    let small = Shape::new(1, shape.heads.min(12), PROBE_TOKENS, shape.head_dim);
    // a row no larger than the probe is quick, and the GPU's first call compiles
    if cuda || flops <= 4.0 * small.flops(pass) {
        return None;
    }
    let (qkv, dout) = cpu_inputs(small, pass);
    let start = Instant::now();
    call_once(m, &qkv, dout.as_ref(), args.dtype).ok()?;
    let per_flop = start.elapsed().as_secs_f64() / small.flops(pass);
    Some(per_flop * flops * (args.runs + 2) as f64)
}

/// Runs `f`, and while it runs prints to stderr every [`PROGRESS_EVERY`] how long it has
/// been running (so a row of minutes shows that it is alive); a row shorter than that
/// prints nothing.
fn with_progress<T>(estimate: Option<f64>, f: impl FnOnce() -> T) -> T {
    let (done, wait) = mpsc::channel::<()>();
    std::thread::scope(|scope| {
        scope.spawn(move || {
            let started = Instant::now();
            // the sender is dropped when `f` returns (or unwinds), which ends the wait
            while let Err(RecvTimeoutError::Timeout) = wait.recv_timeout(PROGRESS_EVERY) {
                let of =
                    estimate.map_or(String::new(), |e| format!(" of about {}", seconds(e)));
                eprintln!(
                    "      still running: {}{of}",
                    seconds(started.elapsed().as_secs_f64())
                );
            }
        });
        let result = f();
        drop(done);
        result
    })
}

/// Bytes of a CPU row's inputs: q, k, v in `f32`, and the output's gradient for a backward.
pub fn input_bytes(shape: Shape, pass: Pass) -> u128 {
    let tensors = if pass == Pass::Forward { 3 } else { 4 };
    tensors
        * shape.batch as u128
        * shape.heads as u128
        * shape.tokens as u128
        * shape.head_dim as u128
        * 4
}

fn seconds(s: f64) -> String {
    if s < 120.0 {
        format!("{s:.0} s")
    } else if s < 7200.0 {
        format!("{:.0} min", s / 60.0)
    } else {
        format!("{:.1} h", s / 3600.0)
    }
}

fn bytes(b: u128) -> String {
    if b >= 1_000_000_000 {
        format!("{:.1} GB", b as f64 / 1e9)
    } else {
        format!("{:.0} MB", b as f64 / 1e6)
    }
}

/// The benchmark's exit status for its rows (`--help` lists them): 0 when every row was
/// measured, 4 when a method's result was wrong, else 3 when some rows could not run.
pub fn exit_status(rows: &[Row]) -> u8 {
    let failed = |prefix: &str| {
        rows.iter()
            .any(|r| r.error.as_deref().is_some_and(|e| e.starts_with(prefix)))
    };
    if failed(WRONG_RESULT) {
        4
    } else if rows.iter().any(|r| r.error.is_some()) {
        3
    } else {
        0
    }
}

/// How a row whose check failed begins its error.
pub const WRONG_RESULT: &str = "wrong result";

/// One row's numbers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measured {
    pub ms: f64,
    /// None when the platform cannot measure it (no `/proc/self/clear_refs`).
    pub peak_bytes: Option<u64>,
}

fn describe_error(e: &AttnError) -> String {
    match e {
        AttnError::OutOfMemory { .. } => e.to_string(),
        _ => format!("error: {e}"),
    }
}

/// The inputs of one CPU measurement: q, k, v and, for the backward, the output's gradient.
fn cpu_inputs(shape: Shape, pass: Pass) -> ([Array4<f32>; 3], Option<Array4<f32>>) {
    let qkv = random_qkv(shape, SEED);
    let dout = (pass != Pass::Forward).then(|| random_normal(shape, SEED + 3));
    (qkv, dout)
}

/// The largest max-abs error against the `f64` reference that the check before timing lets
/// pass, by the element type computed in: `f32` methods agree with the reference to about
/// 1e-6 on these inputs, so 1e-4 leaves room for long rows; a 16-bit method rounds its
/// inputs and its probabilities, so 8 units in the last place of its type. A wrong method
/// (a missing rescale, a swapped row, a mask off by one) misses by orders of magnitude
/// more.
pub fn allowed_error(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::F32 => 1e-4,
        // [step 03]
        Dtype::Bf16 => 8.0 * 2f64.powi(-8),
        Dtype::F16 => 8.0 * 2f64.powi(-11),
        // [/step 03]
    }
}

/// The rows the check compares: the first, the last and a spread between them, in the first
/// and the last head of the first and the last sequence (up to 32 rows).
fn sample_rows(shape: Shape) -> Vec<(usize, usize, usize)> {
    let t = shape.tokens;
    let mut tokens: Vec<usize> = (0..8).map(|i| i * (t - 1) / 7).collect();
    tokens.dedup();
    let mut rows = Vec::new();
    for b in [0, shape.batch - 1] {
        for h in [0, shape.heads - 1] {
            rows.extend(tokens.iter().map(|&i| (b, h, i)));
        }
    }
    rows.sort();
    rows.dedup();
    rows
}

/// Checks a method's result against the `f64` reference on a sample of rows before it is
/// timed; an error begins with [`WRONG_RESULT`] and gives the measured error.
pub fn check_result(
    [q, k, v]: &[Array4<f32>; 3],
    got: &Attention,
    dtype: Dtype,
) -> Result<(), String> {
    let shape = Shape::new(q.dim().0, q.dim().1, q.dim().2, q.dim().3);
    if shape.is_empty() {
        return Ok(());
    }
    let rows = sample_rows(shape);
    let want = reference::rows_f64(q.view(), k.view(), v.view(), &rows)
        .map_err(|e| e.to_string())?;
    compare_rows(&rows, &want, got, dtype)
}

/// The check's verdict on `rows` of `got` against `want`, their reference outputs and
/// log-sum-exps: the largest error over the outputs and log-sum-exps, at most
/// [`allowed_error`].
fn compare_rows(
    rows: &[(usize, usize, usize)],
    want: &[(Vec<f64>, f64)],
    got: &Attention,
    dtype: Dtype,
) -> Result<(), String> {
    let (mut worst, mut at) = (0.0f64, rows[0]);
    for (&(b, h, i), (o, lse)) in rows.iter().zip(want) {
        let got_lse = f64::from(got.lse[[b, h, i]]);
        // a row that sees no key has a log-sum-exp of −∞ both ways
        let mut err = if got_lse == *lse {
            0.0
        } else {
            (got_lse - lse).abs()
        };
        for (d, o) in o.iter().enumerate() {
            err = err.max((f64::from(got.out[[b, h, i, d]]) - o).abs());
        }
        // a NaN is the worst error there is
        if err.is_nan() || err > worst {
            (worst, at) = (if err.is_nan() { f64::INFINITY } else { err }, (b, h, i));
        }
    }
    let allowed = allowed_error(dtype);
    if worst <= allowed {
        return Ok(());
    }
    Err(format!(
        "{WRONG_RESULT}: max abs error {worst:.2e} against the f64 reference at [{}, {}, {}] (allowed {allowed:.1e})",
        at.0, at.1, at.2
    ))
}

/// One call of the pass being measured: the forward, and the backward after it for
/// `fwd+bwd`. Returns whatever it computed, so that a caller can keep it alive while
/// reading the peak.
fn call_once(
    m: &dyn Method,
    [q, k, v]: &[Array4<f32>; 3],
    dout: Option<&Array4<f32>>,
    dtype: Dtype,
) -> Result<Box<dyn std::any::Any>, AttnError> {
    let fwd = m.forward(q.view(), k.view(), v.view(), dtype)?;
    // [step 04]
    if let Some(dout) = dout {
        let grads = m.backward(q.view(), k.view(), v.view(), &fwd, dout.view(), dtype)?;
        return Ok(Box::new((fwd, grads)));
    }
    // [/step 04]
    let _ = dout;
    Ok(Box::new(fwd))
}

/// One CPU row: the peak in a fresh process first (which also finds a length that does not
/// fit), then the warm-up and the timed runs here.
pub fn measure_cpu(
    m: &dyn Method,
    shape: Shape,
    args: &BenchArgs,
) -> Result<Measured, String> {
    // inputs larger than memory and swap cannot be made: say so without trying (where the
    // kernel overcommits, trying would end in the OOM killer after minutes of paging)
    let need = input_bytes(shape, args.pass());
    if let Some(have) = memory_and_swap().filter(|&have| need > have) {
        return Err(format!(
            "out of memory: the inputs alone take {}, and this machine has {} of memory and swap",
            bytes(need),
            bytes(have)
        ));
    }
    let peak_bytes = peak_or_unmeasured(peak_in_child(m, shape, args.pass()))?;
    let ms = check_then_time_cpu(m, shape, args)?;
    Ok(Measured { ms, peak_bytes })
}

/// A row's peak from its child: a child that ran out of memory or failed fails the row; a
/// platform that cannot measure a peak leaves it out, and the row goes on.
fn peak_or_unmeasured(peak: Result<u64, PeakError>) -> Result<Option<u64>, String> {
    match peak {
        Ok(bytes) => Ok(Some(bytes)),
        Err(PeakError::OutOfMemory(why) | PeakError::Failed(why)) => Err(why),
        Err(PeakError::Unavailable(why)) => {
            eprintln!("      peak memory not measured: {why}");
            Ok(None)
        }
    }
}

/// The part of a CPU row that runs in this process: one call checked against the reference
/// (an error beginning with [`WRONG_RESULT`] if it is off), then the median of the timed
/// runs.
pub fn check_then_time_cpu(
    m: &dyn Method,
    shape: Shape,
    args: &BenchArgs,
) -> Result<f64, String> {
    let (qkv, dout) = cpu_inputs(shape, args.pass());
    // check, then time: the checked call also warms up (pages in the code and the
    // allocator's arenas, starts the thread pool)
    let first = m
        .forward(qkv[0].view(), qkv[1].view(), qkv[2].view(), args.dtype)
        .map_err(|e| describe_error(&e))?;
    check_result(&qkv, &first, args.dtype)?;
    drop(first);
    cpu_median_ms(Warmup::Calls(0), args.runs, || {
        call_once(m, &qkv, dout.as_ref(), args.dtype)
    })
    .map_err(|e| describe_error(&e))
}

// [step 03]
/// One GPU row: the method prepares its inputs on the device once, checks one result
/// against the reference on a sample of rows, then times itself.
pub fn measure_gpu(
    m: &dyn Method,
    shape: Shape,
    args: &BenchArgs,
) -> Result<Measured, String> {
    let spec = DeviceRunSpec {
        shape,
        dtype: args.dtype,
        seed: SEED,
        gpus: args.gpus, // [step 07]
    };
    let mut run = match args.pass() {
        Pass::Forward => m.prepare_forward(&spec),
        Pass::ForwardBackward => m.prepare_backward(&spec), // [step 04]
    }
    .map_err(|e| describe_error(&e))?;
    let got = run.result().map_err(|e| describe_error(&e))?;
    check_result(&random_qkv(shape, SEED), &got, args.dtype)?;
    drop(got);
    // warm up for at least GPU_WARMUP_MS, so the clocks have left their idle state and the
    // first measured run is not the slowest
    let ms = median_ms(Warmup::Millis(GPU_WARMUP_MS), args.runs, || run.time_ms())
        .map_err(|e| describe_error(&e))?;
    let peak = run.peak_bytes().map_err(|e| describe_error(&e))?;
    Ok(Measured {
        ms,
        peak_bytes: Some(peak),
    })
}
// [/step 03]

// [step 09]
/// The method name of a masked row.
pub const MASKED: &str = "masked";

/// The masked row's implementation line.
fn masked_implementation(args: &BenchArgs) -> String {
    let pass = match args.pass() {
        Pass::Forward => "forward",
        Pass::ForwardBackward => "forward and backward",
    };
    format!(
        "step 09's blockwise {pass} in f32 over the block mask's non-empty 64 × 64 tiles, \
         {} threads",
        rayon::current_num_threads()
    )
}

/// `--mask` at one length: its mask as a block mask of this shape (made once, not timed,
/// as the GPU's is) and its score function.
struct Masked {
    text: String,
    block: step09_masks::BlockMask,
    score: step09_masks::ScoreMod,
}

impl Masked {
    fn new(spec: &step09_masks::MaskSpec, shape: Shape) -> Result<Masked, String> {
        let failed = |e: String| format!("--mask {:?}: {e}", spec.text());
        let (mask, score) = spec
            .resolve(shape.batch, shape.heads, shape.tokens)
            .map_err(|e| e.to_string())?;
        let dims = (shape.batch, shape.heads, shape.tokens, shape.tokens);
        let block = step09_masks::BlockMask::new(&mask, dims, Default::default())
            .map_err(|e| failed(e.to_string()))?;
        Ok(Masked {
            text: spec.text().to_string(),
            block,
            score,
        })
    }

    /// One call of the pass: the masked forward, and the backward after it for `fwd+bwd`.
    fn call_once(
        &self,
        [q, k, v]: &[Array4<f32>; 3],
        dout: Option<&Array4<f32>>,
    ) -> Result<Box<dyn std::any::Any>, AttnError> {
        let (q, k, v) = (q.view(), k.view(), v.view());
        let (fwd, _) = step09_masks::forward_with(q, k, v, &self.block, &self.score)?;
        if let Some(dout) = dout {
            let (grads, _) = step09_masks::backward_with(
                q,
                k,
                v,
                &fwd,
                dout.view(),
                &self.block,
                &self.score,
            )?;
            return Ok(Box::new((fwd, grads)));
        }
        Ok(Box::new(fwd))
    }

    /// The row as every CPU row is measured ([`measure_cpu`]): the peak in a fresh process
    /// first, given the mask, then [`Masked::check_then_time`] here.
    fn measure(&self, shape: Shape, args: &BenchArgs) -> Result<Measured, String> {
        let need = input_bytes(shape, args.pass());
        if let Some(have) = memory_and_swap().filter(|&have| need > have) {
            return Err(format!(
                "out of memory: the inputs alone take {}, and this machine has {} of memory \
                 and swap",
                bytes(need),
                bytes(have)
            ));
        }
        let peak_bytes = peak_or_unmeasured(self.peak_in_child(shape, args.pass()))?;
        let ms = self.check_then_time(shape, args)?;
        Ok(Measured { ms, peak_bytes })
    }

    /// The hidden child measuring one masked call's peak: the mask's text as it was given,
    /// so a `documents:FILE` is read again by the same path from the same working folder
    /// (the child inherits it), and checked against the length again as here.
    fn peak_in_child(&self, shape: Shape, pass: Pass) -> Result<u64, PeakError> {
        let mut cmd = peak_command(shape, pass)?;
        cmd.args(["--mask", &self.text]);
        run_peak_child(cmd)
    }

    /// One call checked against step 09's reference by the rule of the other CPU rows
    /// ([`allowed_error`]), then the median of the timed runs, in milliseconds.
    fn check_then_time(&self, shape: Shape, args: &BenchArgs) -> Result<f64, String> {
        let (qkv, dout) = cpu_inputs(shape, args.pass());
        let [q, k, v] = &qkv;
        let (first, _) = step09_masks::forward_with(
            q.view(),
            k.view(),
            v.view(),
            &self.block,
            &self.score,
        )
        .map_err(|e| describe_error(&e))?;
        let rows = sample_rows(shape);
        let want = masked_rows_f64(&qkv, self.block.mask(), &self.score, &rows);
        compare_rows(&rows, &want, &first, args.dtype)?;
        drop(first);
        cpu_median_ms(Warmup::Calls(0), args.runs, || {
            self.call_once(&qkv, dout.as_ref())
        })
        .map_err(|e| describe_error(&e))
    }

    /// `row` as a masked row: named [`MASKED`], with the mask and its density, and TFLOP/s
    /// over the kept scores only (4·head_dim FLOPs each forward, 3.5 times that forward and
    /// backward, as step 09's mask-bench counts them).
    fn mark(&self, row: Row, pass: Pass) -> Row {
        let per_score = 4.0
            * row.head_dim as f64
            * match pass {
                Pass::Forward => 1.0,
                Pass::ForwardBackward => 3.5,
            };
        let flops = per_score * self.block.visible() as f64;
        Row {
            method: MASKED.to_string(),
            tflops: row.ms.map(|ms| flops / (ms * 1e-3) / 1e12),
            mask: Some(self.text.clone()),
            density: Some(self.block.density()),
            ..row
        }
    }
}

/// Step 09's reference on a few rows `(batch, head, token)`, q, k and v of one shape: the
/// keys the mask lets the row see, the score function on each scaled score, the softmax,
/// in `f64` (steps/09-masks/src/reference.rs computes every row the same way). A row that
/// sees no key: output 0, log-sum-exp −∞.
fn masked_rows_f64(
    [q, k, v]: &[Array4<f32>; 3],
    mask: &step09_masks::Mask,
    score: &step09_masks::ScoreMod,
    rows: &[(usize, usize, usize)],
) -> Vec<(Vec<f64>, f64)> {
    let (tokens, d) = (k.dim().2, q.dim().3);
    let scale = 1.0 / (d as f64).sqrt();
    rows.iter()
        .map(|&(b, h, i)| {
            let seen: Vec<(usize, f64)> = (0..tokens)
                .filter(|&j| mask.allows(b, h, i, j))
                .map(|j| {
                    let dot: f64 = (0..d)
                        .map(|c| f64::from(q[[b, h, i, c]]) * f64::from(k[[b, h, j, c]]))
                        .sum();
                    (j, score.apply(dot * scale, b, h, i, j))
                })
                .collect();
            if seen.is_empty() {
                return (vec![0.0; d], f64::NEG_INFINITY);
            }
            let max = seen.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = seen.iter().map(|x| (x.1 - max).exp()).collect();
            let sum: f64 = p.iter().sum();
            let o = (0..d)
                .map(|c| {
                    seen.iter()
                        .zip(&p)
                        .map(|(&(j, _), p)| p * f64::from(v[[b, h, j, c]]))
                        .sum::<f64>()
                        / sum
                })
                .collect();
            (o, max + sum.ln())
        })
        .collect()
}

/// The hidden child of a masked row: one masked call's peak at the one length. The block
/// mask is made before the reset, with the inputs: the parent makes it once a shape and
/// does not time it either.
fn masked_peak_child(spec: &step09_masks::MaskSpec, args: &BenchArgs) -> i32 {
    let [tokens] = args.lengths[..] else {
        eprintln!("{PEAK_CHILD} takes one length");
        return 2;
    };
    let shape = Shape::new(args.batch, args.heads, tokens, args.head_dim);
    let masked = match Masked::new(spec, shape) {
        Ok(masked) => masked,
        Err(e) => {
            eprintln!("error: {e}");
            return 1;
        }
    };
    let (qkv, dout) = cpu_inputs(shape, args.pass());
    peak_of(|| masked.call_once(&qkv, dout.as_ref()))
}
// [/step 09]

/// Why a peak could not be measured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeakError {
    /// The call does not fit in memory here.
    OutOfMemory(String),
    /// The method refused the input or failed.
    Failed(String),
    /// This platform cannot reset the high-water mark.
    Unavailable(String),
}

/// Runs the benchmark's own executable as a fresh child measuring one call's peak.
pub fn peak_in_child(m: &dyn Method, shape: Shape, pass: Pass) -> Result<u64, PeakError> {
    let mut cmd = peak_command(shape, pass)?;
    cmd.args(["--methods", m.name()]);
    run_peak_child(cmd)
}

/// The hidden child's command line for one call of `pass` at `shape`, without what runs.
fn peak_command(shape: Shape, pass: Pass) -> Result<Command, PeakError> {
    let exe = std::env::current_exe().map_err(|e| {
        PeakError::Unavailable(format!("cannot find our own executable: {e}"))
    })?;
    let mut cmd = Command::new(exe);
    cmd.arg(PEAK_CHILD)
        .args(["--lengths", &shape.tokens.to_string()])
        .args(["--batch", &shape.batch.to_string()])
        .args(["--heads", &shape.heads.to_string()])
        .args(["--head-dim", &shape.head_dim.to_string()]);
    // [step 04]
    if pass == Pass::ForwardBackward {
        cmd.arg("--backward");
    }
    // [/step 04]
    let _ = pass;
    Ok(cmd)
}

/// Runs the child `cmd` and reads the peak it prints, or why it has none.
fn run_peak_child(mut cmd: Command) -> Result<u64, PeakError> {
    // the child's last line is its message: no backtrace after it
    let output = cmd
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| PeakError::Unavailable(format!("cannot start the child: {e}")))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    // the child's own message: the last line that is not the runtime's hint about
    // backtraces nor the "thread ... panicked at" line in front of a panic's message
    let last = |s: &str| {
        s.lines()
            .map(str::trim)
            .rfind(|l| {
                !l.is_empty() && !l.starts_with("note: ") && !l.contains("panicked at")
            })
            .unwrap_or("(it printed nothing)")
            .to_string()
    };
    if output.status.success() {
        return stdout
            .trim()
            .parse()
            .map_err(|_| PeakError::Failed(format!("the child printed {stdout:?}")));
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        match output.status.signal() {
            Some(9) => {
                return Err(PeakError::OutOfMemory(
                    "out of memory: the measuring process was killed (SIGKILL, as the kernel's \
                     OOM killer does)"
                        .into(),
                ));
            }
            // Rust's default allocation-failure handler prints this and aborts
            Some(6) => {
                if let Some(line) =
                    stderr.lines().find(|l| l.contains("memory allocation of"))
                {
                    return Err(PeakError::OutOfMemory(format!(
                        "out of memory: {}",
                        line.trim()
                    )));
                }
            }
            _ => {}
        }
    }
    match output.status.code() {
        Some(EXIT_OOM) => Err(PeakError::OutOfMemory(last(&stderr))),
        Some(EXIT_UNAVAILABLE) => Err(PeakError::Unavailable(last(&stderr))),
        _ => Err(PeakError::Failed(format!(
            "the measuring process failed ({}): {}",
            output.status,
            last(&stderr)
        ))),
    }
}

/// Exit code of a child that cannot reset the high-water mark on this platform.
const EXIT_UNAVAILABLE: i32 = 4;

/// The hidden child: makes the inputs, resets the high-water mark, runs one call and prints
/// the growth in bytes. Returns the process's exit code.
pub fn peak_child(args: &BenchArgs) -> i32 {
    // [step 09]
    if let Some(spec) = &args.mask {
        return masked_peak_child(spec, args);
    }
    // [/step 09]
    let (m, tokens) = match (args.methods.as_slice(), args.lengths.as_slice()) {
        ([m], [tokens]) => (*m, *tokens),
        _ => {
            eprintln!("{PEAK_CHILD} takes one method and one length");
            return 2;
        }
    };
    let shape = Shape::new(args.batch, args.heads, tokens, args.head_dim);
    let (qkv, dout) = cpu_inputs(shape, args.pass());
    peak_of(|| call_once(m, &qkv, dout.as_ref(), args.dtype))
}

/// The child's measurement once its inputs are made: resets the high-water mark, makes
/// `call` once, prints the growth in bytes and returns the exit code.
fn peak_of(call: impl FnOnce() -> Result<Box<dyn std::any::Any>, AttnError>) -> i32 {
    // start the thread pool before the reset: its stacks are not the method's memory
    rayon::broadcast(|_| ());
    let before = match reset_and_read_hwm() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("{e}");
            return EXIT_UNAVAILABLE;
        }
    };
    let result = call();
    // read while the result is alive: the output and the log-sum-exp are part of the cost
    let after = read_hwm();
    match (result, after) {
        (Ok(_), Ok(after)) => {
            println!("{}", after.saturating_sub(before));
            0
        }
        (Err(e @ AttnError::OutOfMemory { .. }), _) => {
            eprintln!("{e}");
            EXIT_OOM
        }
        (Err(e), _) => {
            eprintln!("error: {e}");
            1
        }
        (_, Err(e)) => {
            eprintln!("{e}");
            EXIT_UNAVAILABLE
        }
    }
}

/// Resets this process's resident high-water mark to its current resident size (Linux ≥
/// 4.0: writing 5 to `clear_refs`), then reads it.
fn reset_and_read_hwm() -> Result<u64, String> {
    fs::OpenOptions::new()
        .write(true)
        .open("/proc/self/clear_refs")
        .and_then(|mut f| f.write_all(b"5"))
        .map_err(|e| {
            format!(
                "cannot reset the resident high-water mark (/proc/self/clear_refs): {e}"
            )
        })?;
    read_hwm()
}

/// `VmHWM` of `/proc/self/status`, the resident high-water mark, in bytes.
fn read_hwm() -> Result<u64, String> {
    let status = fs::read_to_string("/proc/self/status")
        .map_err(|e| format!("cannot read /proc/self/status: {e}"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| "no VmHWM line in /proc/self/status".into())
}

/// The CPU model (from `/proc/cpuinfo`) and the threads the methods may use.
pub fn cpu_description() -> String {
    let model = fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name") || l.starts_with("Model"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    format!("{model} ({} threads)", rayon::current_num_threads())
}

/// The widest SIMD instructions this CPU has, as detected at run time.
pub fn simd_level() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            "AVX-512"
        } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            "AVX2 + FMA"
        } else if is_x86_feature_detected!("avx") {
            "AVX"
        } else {
            "SSE2"
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        "NEON"
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        "none detected"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::methods::{Describe, Descriptor};
    use ndarray::{ArrayView4, s};

    /// Step 01's attention with the outputs of the first and the last query of the first
    /// head swapped: the kind of slip (an index off in a store) the check before timing is
    /// for.
    fn swapped_rows(
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
    ) -> Result<Attention, AttnError> {
        let mut a = step01_naive::attention(q, k, v)?;
        let last = a.out.dim().2 - 1;
        let first_row = a.out.slice(s![0, 0, 0, ..]).to_owned();
        let last_row = a.out.slice(s![0, 0, last, ..]).to_owned();
        a.out.slice_mut(s![0, 0, 0, ..]).assign(&last_row);
        a.out.slice_mut(s![0, 0, last, ..]).assign(&first_row);
        Ok(a)
    }

    /// Step 01's attention with each row's normalisation forgotten after its first 16 keys,
    /// as a block-wise method that skips the rescale would: rows past 16 tokens are off.
    fn missing_rescale(
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
    ) -> Result<Attention, AttnError> {
        let mut a = step01_naive::attention(q, k, v)?;
        let tokens = a.out.dim().2;
        for i in 16..tokens {
            a.out
                .slice_mut(s![.., .., i, ..])
                .mapv_inplace(|x| x * 16.0 / (i + 1) as f32);
        }
        Ok(a)
    }

    fn args(line: &str) -> BenchArgs {
        let argv = std::iter::once("flash-attention".to_string())
            .chain(line.split_whitespace().map(String::from));
        match crate::cli::parse(argv).unwrap() {
            crate::cli::Command::Bench(b) => b,
            other => panic!("{line}: {other:?}"),
        }
    }

    /// The two broken forwards above as methods of the registry.
    #[derive(Clone, Copy)]
    enum Broken {
        SwappedRows,
        MissingRescale,
    }

    impl Describe for Broken {
        fn descriptor(&self) -> Descriptor {
            let name = match self {
                Broken::SwappedRows => "swapped_rows",
                Broken::MissingRescale => "missing_rescale",
            };
            Descriptor::new(name, "test", Device::Cpu, "a broken method")
        }
    }

    impl Method for Broken {
        fn forward(
            &self,
            q: ArrayView4<f32>,
            k: ArrayView4<f32>,
            v: ArrayView4<f32>,
            _dtype: Dtype,
        ) -> Result<Attention, AttnError> {
            match self {
                Broken::SwappedRows => swapped_rows(q, k, v),
                Broken::MissingRescale => missing_rescale(q, k, v),
            }
        }
    }

    #[test]
    fn a_broken_method_is_caught_before_it_is_timed() {
        let args = args("--methods naive --lengths 100 --heads 2 --head-dim 16 --runs 1");
        let shape = Shape::new(1, 2, 100, 16);
        for broken in [Broken::SwappedRows, Broken::MissingRescale] {
            let name = broken.name();
            let err = check_then_time_cpu(&broken, shape, &args).unwrap_err();
            assert!(
                err.starts_with(WRONG_RESULT) && err.contains("max abs error"),
                "{name}: {err}"
            );
            // the measured error is printed, and it is far above what is allowed
            let measured: f64 = err
                .split("max abs error ")
                .nth(1)
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|e| e.parse().ok())
                .unwrap_or_else(|| panic!("{name}: no error in {err:?}"));
            assert!(
                measured > 100.0 * allowed_error(Dtype::F32),
                "{name}: {err}"
            );
            // and a row carrying it makes the benchmark's exit status 4
            let row = Row {
                method: name.into(),
                implementation: String::new(),
                device: String::new(),
                device_kind: Device::Cpu,
                tokens: shape.tokens,
                batch: shape.batch,
                heads: shape.heads,
                head_dim: shape.head_dim,
                dtype: Dtype::F32,
                pass: Pass::Forward,
                runs: 1,
                ms: None,
                tflops: None,
                peak_bytes: None,
                commit: String::new(),
                date: String::new(),
                error: Some(err),
                gpus: 1, // [step 07]
                // [step 09]
                mask: None,
                density: None,
                // [/step 09]
            };
            assert_eq!(exit_status(&[row]), 4);
        }
    }

    #[test]
    fn a_correct_method_passes_the_check_and_is_timed() {
        let args = args("--methods naive --lengths 100 --heads 2 --head-dim 16 --runs 2");
        let naive = args.methods[0];
        let ms = check_then_time_cpu(naive, Shape::new(1, 2, 100, 16), &args).unwrap();
        assert!(ms.is_finite() && ms >= 0.0, "{ms}");
        let qkv = random_qkv(Shape::new(3, 2, 77, 8), 5);
        let got =
            step01_naive::attention(qkv[0].view(), qkv[1].view(), qkv[2].view()).unwrap();
        assert_eq!(check_result(&qkv, &got, Dtype::F32), Ok(()));
    }

    #[test]
    fn long_rows_are_estimated_and_small_ones_are_not() {
        let args = args("--methods naive --runs 3");
        let naive = args.methods[0];
        // at the pace of an earlier row: on the CPU its seconds scaled by the FLOPs, on a
        // GPU by the tokens
        let shape = Shape::new(1, 12, 8192, 64);
        let half = Shape::new(1, 12, 4096, 64);
        let last = Pace {
            seconds: 10.0,
            flops: half.flops(Pass::Forward),
            tokens: 4096,
        };
        let est = estimate_s(naive, shape, &args, Some(last), false).unwrap();
        let want = 10.0 * shape.flops(Pass::Forward) / half.flops(Pass::Forward);
        assert!((est - want).abs() < 1e-9 && est > 39.0, "{est}");
        let est = estimate_s(naive, shape, &args, Some(last), true).unwrap();
        assert!((est - 20.0).abs() < 1e-9, "{est}");
        // a first row no larger than the quick call needs no estimate; a large one gets one
        assert_eq!(
            estimate_s(naive, Shape::new(1, 12, 256, 64), &args, None, false),
            None
        );
        assert!(estimate_s(naive, shape, &args, None, false).is_some_and(|s| s > 0.0));
        assert_eq!(input_bytes(shape, Pass::Forward), 3 * 12 * 8192 * 64 * 4);
        assert_eq!(seconds(95.0), "95 s");
        assert_eq!(seconds(600.0), "10 min");
        // a short call under with_progress prints nothing and returns what it returned
        assert_eq!(with_progress(Some(100.0), || 7), 7);
    }

    // [step 09]
    /// The masked row's check: its reference rows are step 09's reference, a result with the
    /// right mask passes and is timed, and one with the wrong mask (causal where a window of
    /// 16 was asked for: rows past 16 tokens see too much) is caught before it is timed.
    #[test]
    fn a_masked_result_is_checked_against_step_09_s_reference_before_it_is_timed() {
        let args =
            args("--mask sliding:16,alibi --lengths 100 --heads 2 --head-dim 16 --runs 1");
        let shape = Shape::new(1, 2, 100, 16);
        let masked = Masked::new(args.mask.as_ref().unwrap(), shape).unwrap();
        let (qkv, _) = cpu_inputs(shape, Pass::Forward);
        let [q, k, v] = &qkv;
        let rows = sample_rows(shape);
        let (mask, score) = (masked.block.mask(), &masked.score);
        let want = masked_rows_f64(&qkv, mask, score, &rows);
        let whole = step09_masks::reference::attention_f64(
            q.view(),
            k.view(),
            v.view(),
            mask,
            score,
        )
        .unwrap();
        for (&(b, h, i), (o, lse)) in rows.iter().zip(&want) {
            assert!((whole.lse[[b, h, i]] - lse).abs() < 1e-12, "{b} {h} {i}");
            for (d, o) in o.iter().enumerate() {
                assert!(
                    (whole.out[[b, h, i, d]] - o).abs() < 1e-12,
                    "{b} {h} {i} {d}"
                );
            }
        }
        assert!(
            masked
                .check_then_time(shape, &args)
                .is_ok_and(|ms| ms >= 0.0),
            "the right mask passes"
        );
        let causal = step01_naive::attention(q.view(), k.view(), v.view()).unwrap();
        let err = compare_rows(&rows, &want, &causal, Dtype::F32).unwrap_err();
        assert!(
            err.starts_with(WRONG_RESULT) && err.contains("max abs error"),
            "{err}"
        );
    }
    // [/step 09]

    #[test]
    #[cfg_attr(
        not(target_os = "linux"),
        ignore = "needs Linux's /proc/self/clear_refs"
    )]
    fn hwm_reads_and_resets() {
        let before = reset_and_read_hwm().unwrap();
        assert!(before > 0);
        // touching 64 MB raises the high-water mark by about that much
        let v = vec![1u8; 64 << 20];
        let after = read_hwm().unwrap();
        assert!(v.iter().step_by(4096).all(|&b| b == 1));
        assert!(after >= before + (48 << 20), "{before} -> {after}");
    }
}
