//! How fast decoding reads its cache on the CPU: for each shape, the rungs of `--methods`
//! ([`decode`], step 02's loop one query row at a time, to [`decode_threads`], each kv head's
//! rows together in SIMD registers with the keys split over the threads) and a loop that
//! only reads the same bytes, the memory's speed. Each result is checked against the `f64`
//! reference first, then timed: the median of `--runs` after a warm-up. Writes one JSON row
//! per method and shape (`--out`, e.g. `charts/data/decode-cpu.json`, the rows of
//! `decode-bench` with `device` a CPU) and prints a table; PyTorch's CPU attention on the
//! same shapes is `charts/peers/pytorch_peers.py --decode --device cpu`.
//!
//! `cargo run --release -p step08-inference --bin decode-cpu -- --help`

use std::error::Error;
use std::process::ExitCode;

use clap::Parser;
use flash_core::inputs::random_normal;
use flash_core::reference::error;
use flash_core::row::{COMMIT, RowsFile, utc_now};
use flash_core::timing::{Run, medians_in_turn, on_cpu_clock};
use flash_core::{AttnError, Shape, memory_and_swap};
use rayon::prelude::*;
use step03_cuda_forward::gpu::Dtype;
use step03_cuda_forward::tool::at_least_one;
use step08_inference::reference::{by_hand_rows_low_precision, decode_f64};
use step08_inference::rows::{DecodeRow as Row, keep_so_far, write_out};
use step08_inference::{
    DecodeShape, cpu_description, decode, decode_grouped, decode_simd, decode_threads,
};

// ANCHOR: rungs
/// The rungs of CPU decoding, in the order the chapter climbs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Method {
    /// 1: step 02's loop, one query row at a time, rows in parallel
    #[value(name = "decode")]
    Decode,
    /// 2: a kv head's rows together, keys in blocks, each key and value read once; plain Rust
    #[value(name = "decode_grouped")]
    Grouped,
    /// 3: rung 2 in AVX-512 or AVX2 registers, chosen at run time
    #[value(name = "decode_simd")]
    Simd,
    /// 4: rung 3 with the keys split over the threads when the kv heads are too few
    #[value(name = "decode_threads")]
    Threads,
}

impl Method {
    fn name(self) -> &'static str {
        match self {
            Method::Decode => "decode",
            Method::Grouped => "decode_grouped",
            Method::Simd => "decode_simd",
            Method::Threads => "decode_threads",
        }
    }

    fn implementation(self) -> &'static str {
        match self {
            Method::Decode => {
                "step08 rung 1, decode: step 02's online softmax, one query row against its \
                 kv head's cache, rows in parallel (rayon)"
            }
            Method::Grouped => {
                "step08 rung 2, decode_grouped: the rows of a kv head together, blocks of 64 \
                 keys, each key and value read once for all of them, plain Rust"
            }
            Method::Simd => {
                "step08 rung 3, decode_simd: rung 2 with AVX-512 or AVX2 kernels chosen at \
                 run time"
            }
            Method::Threads => {
                "step08 rung 4, decode_threads: rung 3 with the keys split over the threads \
                 when the (sequence, kv head) pairs are too few, merged through the \
                 log-sum-exps"
            }
        }
    }

    fn run(
        self,
        q: ndarray::ArrayView4<f32>,
        k: ndarray::ArrayView4<f32>,
        v: ndarray::ArrayView4<f32>,
    ) -> Result<flash_core::Attention, AttnError> {
        match self {
            Method::Decode => decode(q, k, v),
            Method::Grouped => decode_grouped(q, k, v),
            Method::Simd => decode_simd(q, k, v),
            Method::Threads => decode_threads(q, k, v),
        }
    }
}
// ANCHOR_END: rungs

/// Decoding attention on the CPU against the memory's speed: one query row of every query
/// head against a cache of keys and values in `f32`, and a loop that only reads the same
/// bytes.
///
/// For every combination of the lists below it makes q, k and v (normal, seeded), checks
/// the result against the f64 reference (FlashAttention's rule in f32: at most twice the
/// error of attention by hand in f32), then times the rungs and the read loop in turn, run
/// by run (each one's median of --runs after --warmup calls), and reports milliseconds, the
/// bytes of k and v, GB/s, and that speed as a fraction of the read loop's over the same
/// bytes.
#[derive(Parser, Debug)]
#[command(name = "decode-cpu")]
struct Args {
    /// Sequences decoded together
    #[arg(long, value_delimiter = ',', default_value = "1", value_parser = at_least_one)]
    batch: Vec<usize>,
    /// Tokens in each sequence's cache
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1024,4096,16384",
        value_parser = at_least_one
    )]
    contexts: Vec<usize>,
    /// Head dims
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "64,128",
        value_parser = at_least_one
    )]
    head_dims: Vec<usize>,
    /// Query heads
    #[arg(long, default_value_t = 32, value_parser = at_least_one)]
    q_heads: usize,
    /// Kv heads, each dividing the query heads: as many as the query heads is plain
    /// multi-head attention, fewer is grouped-query attention
    #[arg(long, value_delimiter = ',', default_value = "32,8", value_parser = at_least_one)]
    kv_heads: Vec<usize>,
    /// The rungs to measure
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "decode,decode_grouped,decode_simd,decode_threads"
    )]
    methods: Vec<Method>,
    /// Timed runs of each method after the warm-up; the median is reported
    #[arg(long, default_value_t = 10, value_parser = at_least_one)]
    runs: usize,
    /// Untimed calls of each method before its timed runs
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Write the rows as JSON, one row a line (e.g. charts/data/decode-cpu.json): checked
    /// before any work, written whole at the end; meanwhile the rows so far are kept in
    /// FILE.partial.json
    #[arg(long, value_name = "FILE")]
    out: Option<std::path::PathBuf>,
}

// ANCHOR: read_loop
/// The memory's speed on this CPU: every 4-byte word of `k` and `v` read once, folded
/// together with XOR (so the compiler cannot drop the reads, and vectorises the loop), in
/// chunks on every thread.
fn read_all(k: &[f32], v: &[f32]) -> u32 {
    let fold = |x: &[f32]| {
        x.par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u32, |a, x| a ^ x.to_bits()))
            .reduce(|| 0, |a, b| a ^ b)
    };
    fold(k) ^ fold(v)
}
// ANCHOR_END: read_loop

fn main() -> ExitCode {
    let args = Args::parse();
    let out = match before_any_work(&args) {
        Ok(out) => out,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    match run(&args, out.as_ref()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What is checked before any work: `--out` can be written, and every shape's q, k and v
/// can be counted in bytes without overflow and fit in this machine's memory and swap (a
/// size from the command line is refused here, not by the allocator's abort half-way).
fn before_any_work(args: &Args) -> Result<Option<RowsFile>, Box<dyn Error>> {
    let have = memory_and_swap();
    for &head_dim in &args.head_dims {
        for &kv_heads in &args.kv_heads {
            for &batch in &args.batch {
                for &context in &args.contexts {
                    let values = |heads: usize, tokens: usize| {
                        [heads, tokens, head_dim]
                            .iter()
                            .try_fold(batch as u128, |n, &x| n.checked_mul(x as u128))
                    };
                    let bytes = values(args.q_heads, 1)
                        .zip(values(kv_heads, context))
                        .and_then(|(q, kv)| {
                            kv.checked_mul(2)?.checked_add(q)?.checked_mul(4)
                        });
                    let shape = format!(
                        "--batch {batch} --q-heads {} --kv-heads {kv_heads} --contexts \
                         {context} --head-dims {head_dim}",
                        args.q_heads
                    );
                    let fits = bytes.filter(|&b| b <= isize::MAX as u128);
                    match (fits, have) {
                        (None, _) => {
                            return Err(format!(
                                "{shape}: q, k and v in f32 would take more bytes than this \
                                 machine can address; choose smaller sizes"
                            )
                            .into());
                        }
                        (Some(need), Some(have)) if need > have => {
                            return Err(format!(
                                "{shape}: q, k and v in f32 take {need} bytes ({:.1} GB), and \
                                 this machine has {have} bytes ({:.1} GB) of memory and swap; \
                                 choose a shorter context, fewer sequences or fewer kv heads",
                                need as f64 / 1e9,
                                have as f64 / 1e9
                            )
                            .into());
                        }
                        _ => {}
                    }
                }
            }
        }
    }
    Ok(args
        .out
        .as_deref()
        .map(|out| RowsFile::check("--out", out))
        .transpose()?)
}

/// A rung's result against the f64 reference, by FlashAttention's rule in f32.
fn check(
    method: Method,
    q: &ndarray::Array4<f32>,
    k: &ndarray::Array4<f32>,
    v: &ndarray::Array4<f32>,
) -> Result<(), String> {
    let text = |e: AttnError| e.to_string();
    let reference = decode_f64(q.view(), k.view(), v.view()).map_err(text)?;
    let ours = method.run(q.view(), k.view(), v.view()).map_err(text)?;
    let by_hand = by_hand_rows_low_precision(q.view(), k.view(), v.view(), Dtype::F32)
        .map_err(text)?;
    let (ours, by_hand) = (
        error(&ours.out, &reference.out),
        error(&by_hand, &reference.out),
    );
    if ours.max_abs > 2.0 * by_hand.max_abs + 1e-6 {
        return Err(format!(
            "wrong result: max abs error {:.3e} > 2 × attention by hand's {:.3e}",
            ours.max_abs, by_hand.max_abs
        ));
    }
    Ok(())
}

fn run(args: &Args, out: Option<&RowsFile>) -> Result<(), Box<dyn Error>> {
    if let Some(kv) = args
        .kv_heads
        .iter()
        .find(|&&kv| !args.q_heads.is_multiple_of(kv))
    {
        return Err(AttnError::Unsupported {
            what: format!(
                "--kv-heads {kv} does not divide --q-heads {}: each kv head serves \
                 q_heads / kv_heads query heads",
                args.q_heads
            ),
        }
        .into());
    }
    let device = cpu_description();
    println!("device: {device}");
    println!(
        "{} query heads, one row each, f32; median of {} runs after {} untimed",
        args.q_heads, args.runs, args.warmup
    );
    print!("\n{:>4} {:>3} {:>5} {:>7} |", "d", "kv", "batch", "context");
    for m in &args.methods {
        print!(" {:>14} {:>5} |", format!("{} ms", m.name()), "%read");
    }
    println!(" {:>8} {:>6}", "read ms", "GB/s");
    let date = utc_now();
    let mut rows: Vec<Row> = Vec::new();
    for &head_dim in &args.head_dims {
        for &kv_heads in &args.kv_heads {
            for &batch in &args.batch {
                for &context in &args.contexts {
                    let shape = DecodeShape::new(
                        batch,
                        args.q_heads,
                        kv_heads,
                        1,
                        context,
                        head_dim,
                    );
                    let row = |method: &str, what: &str| Row {
                        method: method.into(),
                        implementation: what.into(),
                        device: device.clone(),
                        commit: COMMIT.into(),
                        date: date.clone(),
                        batch,
                        q_heads: args.q_heads,
                        kv_heads,
                        q_rows: 1,
                        context,
                        head_dim,
                        dtype: "f32".into(),
                        page_size: None,
                        splits: None,
                        runs: args.runs,
                        us: None,
                        bytes: shape.cache_bytes(4),
                        gb_s: None,
                        fraction_of_read: None,
                        error: None,
                    };
                    let mut ours: Vec<Row> = args
                        .methods
                        .iter()
                        .map(|m| row(m.name(), m.implementation()))
                        .collect();
                    let mut read = row(
                        "read_cpu",
                        "every 4-byte word of k and v read once and folded by XOR, in \
                         chunks on every thread (rayon)",
                    );
                    let q = random_normal(Shape::new(batch, args.q_heads, 1, head_dim), 1);
                    let kv_shape = Shape::new(batch, kv_heads, context, head_dim);
                    let (k, v) = (random_normal(kv_shape, 2), random_normal(kv_shape, 3));
                    time_in_turn(args, [&q, &k, &v], &mut ours, &mut read)?;
                    print_line(shape, &ours, &read);
                    rows.extend(ours);
                    rows.push(read);
                    keep_so_far(out, &rows);
                }
            }
        }
    }
    write_out(out, &rows, rows.iter().any(|r| r.us.is_some()))?;
    if let Some(bad) = rows.iter().find_map(|r| r.error.as_ref()) {
        return Err(AttnError::Unsupported {
            what: format!("a result failed its check ({bad}); its rows have no time"),
        }
        .into());
    }
    Ok(())
}

/// Checks each rung's result (a failure is kept in its row) and times the rungs that pass
/// and the read loop in turn, run by run, so that a slow spell of a shared machine falls on
/// all of them; then each row's GB/s and share of the read loop's.
fn time_in_turn(
    args: &Args,
    [q, k, v]: [&ndarray::Array4<f32>; 3],
    ours: &mut [Row],
    read: &mut Row,
) -> Result<(), AttnError> {
    let mut timed: Vec<&mut Row> = Vec::new();
    let mut runs: Vec<Run<'_, AttnError>> = Vec::new();
    for (&method, row) in args.methods.iter().zip(ours.iter_mut()) {
        match check(method, q, k, v) {
            Err(e) => row.error = Some(e),
            Ok(()) => {
                let (q, k, v) = (q.view(), k.view(), v.view());
                runs.push(Box::new(on_cpu_clock(move || method.run(q, k, v))));
                timed.push(row);
            }
        }
    }
    let (ks, vs) = (
        k.as_slice().expect("standard"),
        v.as_slice().expect("standard"),
    );
    runs.push(Box::new(on_cpu_clock(|| {
        Ok(std::hint::black_box(read_all(ks, vs)))
    })));
    timed.push(read);
    let ms = medians_in_turn(args.warmup, args.runs, &mut runs)?;
    for (row, ms) in timed.into_iter().zip(ms) {
        row.us = Some(ms * 1e3);
        row.gb_s = Some(row.bytes as f64 / (ms * 1e-3) / 1e9);
    }
    let read_gb_s = read.gb_s;
    for r in ours.iter_mut().chain([read]) {
        r.fraction_of_read = r.gb_s.zip(read_gb_s).map(|(a, b)| a / b);
    }
    Ok(())
}

fn print_line(shape: DecodeShape, ours: &[Row], read: &Row) {
    let ms = |r: &Row| r.us.map_or("-".into(), |x| format!("{:.3}", x / 1e3));
    let gb = |r: &Row| r.gb_s.map_or("-".into(), |x| format!("{x:.1}"));
    let pct = |r: &Row| {
        r.fraction_of_read
            .map_or("-".into(), |x| format!("{:.0}%", 100.0 * x))
    };
    print!(
        "{:>4} {:>3} {:>5} {:>7} |",
        shape.head_dim, shape.kv_heads, shape.batch, shape.context
    );
    for r in ours {
        print!(" {:>14} {:>5} |", ms(r), pct(r));
    }
    let errors: Vec<String> = ours
        .iter()
        .filter_map(|r| r.error.as_ref().map(|e| format!("  {}: {e}", r.method)))
        .collect();
    println!(" {:>8} {:>6}{}", ms(read), gb(read), errors.concat());
}
