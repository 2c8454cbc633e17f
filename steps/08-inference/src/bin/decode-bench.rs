//! How fast decoding reads its cache: for each shape, the decoding kernel on a contiguous
//! cache and on pages, and the read kernel over the same bytes, the physical limit. Each
//! result is checked against the `f64` reference first (two kv heads of the batch, made
//! again on the host), then timed with CUDA events after a warm-up, the median of `--runs`.
//! Writes one JSON row per kernel and shape (`--out`) and prints a table.
//!
//! `cargo run --release -p step08-inference --bin decode-bench -- --help`

use std::error::Error;
use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use cudarc::driver::CudaSlice;
use flash_core::inputs::random_normal;
use flash_core::reference::error;
use flash_core::row::{COMMIT, RowsFile, utc_now};
use flash_core::timing::{Warmup, median_ms};
use flash_core::{AttnError, Shape};
use ndarray::{Array4, s};
use step03_cuda_forward::gpu::{Dtype, Gpu, device_error, parse_half_dtype};
use step03_cuda_forward::host::round_array;
use step03_cuda_forward::tool::at_least_one;
use step08_inference::DecodeShape;
use step08_inference::cuda::{
    CacheLayout, CacheSpec, DecodeOutput, DecodePlan, PagedKvCache, cache_value,
    fill_cache, read_bytes,
};
use step08_inference::kernel::{DecodeKernel, KEY_GROUP};
use step08_inference::reference::{by_hand_rows_low_precision, decode_f64};
use step08_inference::rows::{DecodeRow, keep_so_far, write_out};

/// Decoding attention on the GPU against the memory's speed: one query row (or a few) of
/// every query head against a cache of keys and values, contiguous and in pages, and a
/// kernel that only reads the same bytes.
///
/// For every combination of the lists below it fills a cache on the GPU, checks the
/// decoding kernels' results on two kv heads against the f64 reference (FlashAttention's
/// rule: at most twice the error of attention by hand in the same precision), then times
/// each kernel (CUDA events around the launch, a warm-up, the median of --runs) and reports
/// microseconds, the bytes of k and v read, GB/s, and that speed as a fraction of the read
/// kernel's. A cache that does not fit the GPU's free memory gives rows with an error.
#[derive(Parser, Debug)]
#[command(name = "decode-bench")]
struct Args {
    /// Sequences decoded together
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,8,64",
        value_parser = at_least_one
    )]
    batch: Vec<usize>,
    /// Tokens in each sequence's cache
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1024,2048,4096,8192,16384,32768,65536,131072",
        value_parser = at_least_one
    )]
    contexts: Vec<usize>,
    /// Head dims (32, 64 or 128)
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
    /// Query rows of each head (1: one new token)
    #[arg(long, default_value_t = 1, value_parser = at_least_one)]
    q_rows: usize,
    #[arg(
        long,
        default_value_t = 64,
        value_parser = at_least_one,
        help = format!("Tokens per page of the paged cache (a multiple of {KEY_GROUP})")
    )]
    page_size: usize,
    /// The cache's dtype: bf16 or f16
    #[arg(long, default_value = "bf16", value_parser = parse_half_dtype)]
    dtype: Dtype,
    /// Timed runs of each kernel after the warm-up; the median is reported
    #[arg(long, default_value_t = 30, value_parser = at_least_one)]
    runs: usize,
    /// Milliseconds of the kernel's own time to warm up each kernel for (3 to 200 calls)
    #[arg(long, default_value_t = 50.0)]
    warmup_ms: f64,
    /// Write the rows as JSON, one row a line (e.g. charts/data/decode.json): checked
    /// before any work, written whole at the end; meanwhile the rows so far are kept in
    /// FILE.partial.json
    #[arg(long, value_name = "FILE")]
    out: Option<std::path::PathBuf>,
}

/// The kv heads whose results are checked: the first of the first sequence and the last
/// of the last.
fn samples(shape: DecodeShape) -> [(usize, usize); 2] {
    [(0, 0), (shape.batch - 1, shape.kv_heads - 1)]
}

/// One kv head's keys or values as the fill made them, `[1, 1, context, head_dim]`.
fn host_slice(shape: DecodeShape, seed: u32, b: usize, kv: usize) -> Array4<f32> {
    let (t, d) = (shape.context, shape.head_dim);
    let first = ((b * shape.kv_heads + kv) * t * d) as u64;
    Array4::from_shape_fn((1, 1, t, d), |(_, _, j, c)| {
        cache_value(seed, first + (j * d + c) as u64)
    })
}

/// The reference and attention by hand for one sampled kv head's query rows.
struct Expected {
    b: usize,
    kv: usize,
    reference: flash_core::reference::Reference,
    by_hand: Array4<f32>,
}

fn expected(shape: DecodeShape, q: &Array4<f32>, dtype: Dtype, seed: u32) -> Vec<Expected> {
    let g = shape.group();
    samples(shape)
        .into_iter()
        .map(|(b, kv)| {
            let q = q.slice(s![b..b + 1, kv * g..(kv + 1) * g, .., ..]);
            let (k, v) = (
                host_slice(shape, seed, b, kv),
                host_slice(shape, seed + 1, b, kv),
            );
            let reference = decode_f64(q, k.view(), v.view()).expect("checked shapes");
            let by_hand = by_hand_rows_low_precision(q, k.view(), v.view(), dtype)
                .expect("checked shapes");
            Expected {
                b,
                kv,
                reference,
                by_hand,
            }
        })
        .collect()
}

/// FlashAttention's rule on the sampled rows: Err naming both errors when it fails.
fn check(
    gpu: &Gpu,
    shape: DecodeShape,
    result: &DecodeOutput,
    want: &[Expected],
) -> Result<(), String> {
    let g = shape.group();
    let (n, d) = (shape.q_rows, shape.head_dim);
    for e in want {
        let first = (e.b * shape.q_heads + e.kv * g) * n * d;
        let bits = gpu
            .stream()
            .clone_dtoh(&result.out.data.slice(first..first + g * n * d))
            .map_err(|err| err.to_string())?;
        let got = step03_cuda_forward::host::from_bits(
            &bits,
            Shape::new(1, g, n, d),
            result.out.dtype,
        );
        let ours = error(&got, &e.reference.out);
        let by_hand = error(&e.by_hand, &e.reference.out);
        if ours.max_abs > 2.0 * by_hand.max_abs + 1e-5 {
            return Err(format!(
                "wrong result at sequence {}, kv head {}: max abs error {:.3e} > 2 × \
                 attention by hand's {:.3e}",
                e.b, e.kv, ours.max_abs, by_hand.max_abs
            ));
        }
    }
    Ok(())
}

/// Times `call` on the GPU: the warm-up, then the median of `runs`, in microseconds. The
/// warm-up is `--warmup-ms` of the kernel's own time, in at least 3 calls and at most 200
/// (each timed call waits behind a 0.5 ms spin, so a 10 µs kernel warmed for 50 ms of its
/// own time would take 5,000 calls and seconds).
fn time_us(
    gpu: &Gpu,
    args: &Args,
    mut call: impl FnMut() -> Result<(), AttnError>,
) -> Result<f64, AttnError> {
    let first = gpu.time_ms(&mut call)?;
    let calls = (args.warmup_ms / first.max(1e-3)).ceil().clamp(3.0, 200.0) as usize;
    median_ms(Warmup::Calls(calls), args.runs, || gpu.time_ms(&mut call)).map(|ms| ms * 1e3)
}

struct Measured {
    us: f64,
    splits: Option<usize>,
}

/// The decoding kernel on `cache`: planned, checked, then timed.
fn measure_decode(
    gpu: &Gpu,
    args: &Args,
    shape: DecodeShape,
    q: &step03_cuda_forward::gpu::DeviceTensor,
    cache: &PagedKvCache,
    want: &[Expected],
) -> Result<Measured, String> {
    let text = |e: AttnError| e.to_string();
    let plan = DecodePlan::new(gpu, cache, shape.q_heads, shape.q_rows).map_err(text)?;
    let mut result = plan.alloc_output(gpu).map_err(text)?;
    let split = plan.run(gpu, cache, 0, q, &mut result).map_err(text)?;
    check(gpu, shape, &result, want)?;
    let us = time_us(gpu, args, || {
        plan.run(gpu, cache, 0, q, &mut result).map(|_| ())
    })
    .map_err(text)?;
    Ok(Measured {
        us,
        splits: Some(split.splits),
    })
}

/// A cache of `shape`'s sequences laid out as `layout`, full, its values [`cache_value`]'s
/// from `seed`; a paged one's pages shuffled in the pool.
fn filled_cache(
    gpu: &Gpu,
    args: &Args,
    shape: DecodeShape,
    layout: CacheLayout,
    seed: u32,
) -> Result<PagedKvCache, AttnError> {
    let spec = CacheSpec::new(
        shape.batch,
        shape.kv_heads,
        shape.context,
        shape.head_dim,
        args.dtype,
        layout,
    );
    let mut cache = PagedKvCache::new(gpu, spec)?;
    cache.shuffle_free(seed as u64);
    cache.reserve(gpu, &vec![shape.context; shape.batch])?;
    fill_cache(gpu, &mut cache, seed)?;
    Ok(cache)
}

fn main() -> ExitCode {
    let args = Args::parse();
    // on the CPU, before the GPU is touched
    let out = match args.out.as_deref().map(|out| RowsFile::check("--out", out)) {
        None => None,
        Some(Ok(out)) => Some(out),
        Some(Err(e)) => {
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

fn run(args: &Args, out: Option<&RowsFile>) -> Result<(), Box<dyn Error>> {
    check_args(args)?;
    let gpu = Gpu::shared()?;
    let device = gpu.describe();
    print_header(args, &device);
    let date = utc_now();
    let mut rows: Vec<DecodeRow> = Vec::new();
    let mut sums = gpu
        .stream()
        .alloc_zeros::<u32>(1 << 16)
        .map_err(device_error("allocating the read kernel's sums"))?;
    for &head_dim in &args.head_dims {
        for &kv_heads in &args.kv_heads {
            for &batch in &args.batch {
                for &context in &args.contexts {
                    let shape = DecodeShape::new(
                        batch,
                        args.q_heads,
                        kv_heads,
                        args.q_rows,
                        context,
                        head_dim,
                    );
                    let stamp = (device.as_str(), date.as_str());
                    let [decode, paged, read] =
                        shape_rows(gpu, args, shape, stamp, &mut sums);
                    print_line(shape, &decode, &paged, &read);
                    rows.extend([decode, paged, read]);
                    keep_so_far(out, &rows);
                }
            }
        }
    }
    write_out(out, &rows, rows.iter().any(|r| r.us.is_some()))?;
    Ok(())
}

/// The refusals of the arguments that need no GPU: kv heads that divide the query heads,
/// head dims and page sizes the kernel builds for, contexts at least as long as the rows.
fn check_args(args: &Args) -> Result<(), Box<dyn Error>> {
    for &kv in &args.kv_heads {
        if !args.q_heads.is_multiple_of(kv) {
            return Err(AttnError::Unsupported {
                what: format!(
                    "--kv-heads {kv} does not divide --q-heads {}: each kv head serves \
                     q_heads / kv_heads query heads",
                    args.q_heads
                ),
            }
            .into());
        }
        DecodeKernel::new(
            args.dtype,
            args.head_dims[0],
            args.q_heads / kv * args.q_rows,
            0,
        )?;
    }
    for &d in &args.head_dims {
        DecodeKernel::new(args.dtype, d, 1, args.page_size)?;
    }
    if let Some(&t) = args.contexts.iter().find(|&&t| t < args.q_rows) {
        return Err(AttnError::Unsupported {
            what: format!("--contexts {t} is shorter than --q-rows {}", args.q_rows),
        }
        .into());
    }
    Ok(())
}

/// The device, what every row shares, and the table's header.
fn print_header(args: &Args, device: &str) {
    println!("device: {device}");
    println!(
        "{} query heads, {} row(s) each, {}; pages of {} tokens; median of {} runs after \
         {} ms of warm-up",
        args.q_heads,
        args.q_rows,
        args.dtype.name(),
        args.page_size,
        args.runs,
        args.warmup_ms
    );
    println!(
        "\n{:>4} {:>3} {:>5} {:>7} {:>6} | {:>9} {:>7} {:>5} | {:>9} {:>7} {:>5} | \
         {:>9} {:>7}",
        "d",
        "kv",
        "batch",
        "context",
        "splits",
        "decode us",
        "GB/s",
        "%read",
        "paged us",
        "GB/s",
        "%read",
        "read us",
        "GB/s"
    );
}

/// One shape measured ([`measure_shape`]) as its three rows, the contiguous cache's, the
/// paged one's and the read kernel's, each speed also as a fraction of the read kernel's;
/// `stamp` is the device and the date every row carries.
fn shape_rows(
    gpu: &Gpu,
    args: &Args,
    shape: DecodeShape,
    (device, date): (&str, &str),
    sums: &mut CudaSlice<u32>,
) -> [DecodeRow; 3] {
    let row = |method: &str, what: String| DecodeRow {
        method: method.into(),
        implementation: what,
        device: device.into(),
        commit: COMMIT.into(),
        date: date.into(),
        batch: shape.batch,
        q_heads: args.q_heads,
        kv_heads: shape.kv_heads,
        q_rows: args.q_rows,
        context: shape.context,
        head_dim: shape.head_dim,
        dtype: args.dtype.name().into(),
        page_size: None,
        splits: None,
        runs: args.runs,
        us: None,
        bytes: shape.cache_bytes(2),
        gb_s: None,
        fraction_of_read: None,
        error: None,
    };
    let found = measure_shape(gpu, args, shape, sums);
    let mut decode = row("decode", implementation(args, shape, 0));
    let mut paged = row("decode_paged", implementation(args, shape, args.page_size));
    paged.page_size = Some(args.page_size);
    let mut read = row(
        "read",
        "kernels/read.cu: every byte of k and v read once, 16 at a time, summed".into(),
    );
    for (r, m) in [
        (&mut read, found.read),
        (&mut decode, found.decode),
        (&mut paged, found.paged),
    ] {
        match m {
            Some(Ok(m)) => {
                r.us = Some(m.us);
                r.splits = m.splits;
                r.gb_s = Some(r.bytes as f64 / (m.us * 1e-6) / 1e9);
            }
            Some(Err(e)) => r.error = Some(e),
            None => {}
        }
    }
    let read_gb_s = read.gb_s;
    for r in [&mut decode, &mut paged, &mut read] {
        r.fraction_of_read = r.gb_s.zip(read_gb_s).map(|(a, b)| a / b);
    }
    [decode, paged, read]
}

fn implementation(args: &Args, shape: DecodeShape, page_size: usize) -> String {
    let kernel = DecodeKernel::new(
        args.dtype,
        shape.head_dim,
        shape.rows_per_kv_head(),
        page_size,
    );
    let layout = match page_size {
        0 => "contiguous cache".to_string(),
        p => format!("pages of {p} tokens, shuffled in the pool"),
    };
    match kernel {
        Ok(k) => format!(
            "kernels/decode.cu, {layout}: {} query rows a kv head in {} tile(s) of 16, {} \
             warps × {} keys a step, {} stages; splits merged by the last block",
            shape.rows_per_kv_head(),
            k.row_tiles,
            DecodeKernel::WARPS,
            k.keys(),
            k.stages()
        ),
        Err(e) => e.to_string(),
    }
}

/// What one shape measured: each kernel's time, or why it has none.
#[derive(Default)]
struct Found {
    decode: Option<Result<Measured, String>>,
    paged: Option<Result<Measured, String>>,
    read: Option<Result<Measured, String>>,
}

// ANCHOR: measure_shape
/// One shape: the contiguous cache filled, checked and timed with the read kernel over its
/// bytes, freed; then the same values in pages, checked and timed.
fn measure_shape(
    gpu: &Gpu,
    args: &Args,
    shape: DecodeShape,
    sums: &mut CudaSlice<u32>,
) -> Found {
    let mut found = Found::default();
    let all = |e: String| Found {
        decode: Some(Err(e.clone())),
        paged: Some(Err(e.clone())),
        read: Some(Err(e)),
    };
    let need = shape.cache_bytes(2);
    let free = gpu
        .context()
        .mem_get_info()
        .map(|(free, _)| free as u64)
        .unwrap_or(0);
    // the cache, the output and the splits' partial results, with room to spare
    if need as f64 > 0.9 * free as f64 {
        return all(format!(
            "the cache needs {:.1} GB and the GPU has {:.1} GB free",
            need as f64 / 1e9,
            free as f64 / 1e9
        ));
    }
    let seed = (shape.context * 31 + shape.batch * 7 + shape.head_dim) as u32;
    let q = random_normal(
        Shape::new(shape.batch, shape.q_heads, shape.q_rows, shape.head_dim),
        seed as u64,
    );
    let q = round_array(q.view(), args.dtype);
    let want = expected(shape, &q, args.dtype, seed);
    let q_dev = match gpu.upload(q.view(), args.dtype) {
        Ok(q) => q,
        Err(e) => return all(e.to_string()),
    };
    // contiguous
    match filled_cache(gpu, args, shape, CacheLayout::Contiguous, seed) {
        Ok(cache) => {
            found.decode = Some(measure_decode(gpu, args, shape, &q_dev, &cache, &want));
            let (k, v) = cache.pools();
            found.read = Some(
                time_us(gpu, args, || read_bytes(gpu, k, v, sums))
                    .map(|us| Measured { us, splits: None })
                    .map_err(|e| e.to_string()),
            );
        }
        Err(e) => return all(e.to_string()),
    }
    // paged: the same logical values through a shuffled table
    let page_size = args.page_size;
    let paged = filled_cache(gpu, args, shape, CacheLayout::Paged { page_size }, seed);
    found.paged = Some(match paged {
        Ok(cache) => measure_decode(gpu, args, shape, &q_dev, &cache, &want),
        Err(e) => Err(e.to_string()),
    });
    found
}
// ANCHOR_END: measure_shape

fn print_line(shape: DecodeShape, decode: &DecodeRow, paged: &DecodeRow, read: &DecodeRow) {
    let us = |r: &DecodeRow| r.us.map_or("-".into(), |x| format!("{x:.1}"));
    let gb = |r: &DecodeRow| r.gb_s.map_or("-".into(), |x| format!("{x:.0}"));
    let pct = |r: &DecodeRow| {
        r.fraction_of_read
            .map_or("-".into(), |x| format!("{:.0}%", 100.0 * x))
    };
    let splits = decode.splits.map_or("-".into(), |s| s.to_string());
    println!(
        "{:>4} {:>3} {:>5} {:>7} {:>6} | {:>9} {:>7} {:>5} | {:>9} {:>7} {:>5} | \
         {:>9} {:>7}",
        shape.head_dim,
        shape.kv_heads,
        shape.batch,
        shape.context,
        splits,
        us(decode),
        gb(decode),
        pct(decode),
        us(paged),
        gb(paged),
        pct(paged),
        us(read),
        gb(read)
    );
    for r in [decode, paged, read] {
        if let Some(e) = &r.error {
            println!("    {}: {e}", r.method);
        }
    }
    std::io::stdout().flush().ok();
}
