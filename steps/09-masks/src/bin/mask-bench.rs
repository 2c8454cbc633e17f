//! The masked kernels measured: for each head dim, length and mask, the block mask made on
//! the GPU, the forward's output checked on sampled rows against the `f64` reference
//! (FlashAttention's rule: at most twice the error of attention by hand in the same
//! precision), then the forward and the forward and backward timed with CUDA events after a
//! warm-up, the median of `--runs`. For the causal mask, step 06's `cuda_hopper` beside it
//! (with `--kernels ampere`, steps 03's and 04's masked copies, step 03's `cuda_flash`).
//! TFLOP/s count only the scores the mask lets through (4 · head_dim FLOPs each forward,
//! 3.5 times that forward and backward). Writes one JSON row per measurement (`--out`)
//! and prints a table.
//!
//! `cargo run --release -p step09-masks --bin mask-bench -- --help`

use std::process::ExitCode;

use clap::Parser;
use flash_core::inputs::random_normal;
use flash_core::row::{COMMIT, RowsFile, utc_now};
use flash_core::timing::{Warmup, median_ms};
use flash_core::{AttnError, Shape};
use ndarray::Array4;
use serde::Serialize;
use step03_cuda_forward::gpu::{DeviceTensor, Dtype, Gpu, parse_half_dtype};
use step09_masks::cuda::{self, DeviceMask, GpuMask};
use step09_masks::cuda_ampere::Kernels;
use step09_masks::rule::row_both_ways;
use step09_masks::{Documents, Mask, MaskSpec, ScoreMod};

/// The masked Hopper kernels against step 06's causal kernel, every mask checked then
/// timed.
#[derive(Parser, Debug)]
#[command(name = "mask-bench")]
struct Args {
    /// Masks, separated by `;`, each as `attend --mask` takes it (comma-separated terms:
    /// causal, full, sliding:W, prefix:P, documents:FILE, softcap:C, alibi, cuda:FILE.cu);
    /// `documents` alone packs documents of 256 + (397·i mod 1792) tokens, the i-th, in
    /// every sequence (the peer script packs the same)
    #[arg(
        long,
        default_value = "causal;full;sliding:1024;prefix:1024;documents;causal,softcap:30;causal,alibi"
    )]
    masks: String,
    /// Tokens of q, k and v
    #[arg(long, value_delimiter = ',', default_value = "4096,16384")]
    lengths: Vec<usize>,
    /// Head dims (64, 128)
    #[arg(long, value_delimiter = ',', default_value = "64,128")]
    head_dims: Vec<usize>,
    #[arg(long, default_value_t = 4)]
    batch: usize,
    #[arg(long, default_value_t = 12)]
    heads: usize,
    /// bf16 or f16
    #[arg(long, default_value = "bf16", value_parser = parse_half_dtype)]
    dtype: Dtype,
    /// Timed runs a measurement (their median is reported)
    #[arg(long, default_value_t = 20)]
    runs: usize,
    /// Write the rows here as JSON (whole or not at all)
    #[arg(long, value_name = "FILE")]
    out: Option<std::path::PathBuf>,
    /// The masked kernels to time: `hopper` (step 06's, compute capability 9.0) or
    /// `ampere` (steps 03's and 04's, any GPU from 8.0) [default: hopper on 9.0, else
    /// ampere]
    #[arg(long)]
    kernels: Option<Kernels>,
}

/// One measurement, as `charts/data/masks*.json` holds it.
#[derive(Serialize, Clone, Debug)]
struct MaskRow {
    /// `masked` (this step's Hopper kernels), `masked_ampere` (its Ampere kernels),
    /// `cuda_hopper` (step 06's, causal only) or `cuda_flash` (steps 03's and 04's, causal
    /// only, beside `masked_ampere`)
    method: String,
    device: String,
    commit: String,
    date: String,
    batch: usize,
    heads: usize,
    tokens: usize,
    head_dim: usize,
    dtype: String,
    /// The mask as `--mask` takes it
    mask: String,
    /// The fraction of the batch·heads·tokens² scores the mask lets through
    density: f64,
    /// The tiles of 64 × 128 scores: empty, partial, full
    tiles: [u64; 3],
    /// `fwd` or `fwd+bwd`
    pass: String,
    runs: usize,
    ms: Option<f64>,
    /// Over the scores computed only
    tflops: Option<f64>,
    error: Option<String>,
}

/// The documents `documents` packs: 256 + (397·i mod 1792) tokens, the last cut to fit.
fn bench_documents(tokens: usize) -> Result<Documents, AttnError> {
    let (mut lengths, mut left, mut i) = (Vec::new(), tokens, 0usize);
    while left > 0 {
        let n = (256 + (397 * i) % 1792).min(left);
        lengths.push(n);
        left -= n;
        i += 1;
    }
    Ok(Documents::from_lengths(&lengths)?)
}

fn resolve(
    spec: &str,
    batch: usize,
    heads: usize,
    t: usize,
) -> Result<(Mask, ScoreMod), AttnError> {
    if spec.trim() == "documents" {
        return Ok((Mask::Documents(bench_documents(t)?), ScoreMod::None));
    }
    let spec = MaskSpec::parse(spec)?;
    Ok(spec.resolve(batch, heads, t)?)
}

/// The forward's output on sampled rows of the first and the last head, against the `f64`
/// reference and attention by hand: `Err` naming the worst row where the rule fails.
fn check_rows(
    [q, k, v]: [&Array4<f32>; 3],
    out: &Array4<f32>,
    mask: &Mask,
    score: &ScoreMod,
    dtype: Dtype,
) -> Result<(), String> {
    let (b_n, h_n, t, d) = q.dim();
    let (mut ours, mut hand, mut size) = (0.0f64, 0.0f64, 1.0f64);
    for (b, h) in [(0, 0), (b_n - 1, h_n - 1)] {
        for n in 0..24 {
            let i = (n * (t - 1)) / 23;
            let (want, by_hand) =
                row_both_ways(q.view(), k.view(), v.view(), mask, score, dtype, (b, h, i));
            for c in 0..d {
                size = size.max(want[c].abs());
                ours = ours.max((out[[b, h, i, c]] as f64 - want[c]).abs());
                hand = hand.max((by_hand[c] as f64 - want[c]).abs());
            }
        }
    }
    if ours.is_nan() || ours > 2.0 * hand + 1e-5 * size {
        return Err(format!(
            "the output's largest error on 48 sampled rows is {ours:.3e}, over twice by \
             hand's {hand:.3e}"
        ));
    }
    Ok(())
}

fn time(
    gpu: &Gpu,
    runs: usize,
    mut call: impl FnMut() -> Result<(), AttnError>,
) -> Result<f64, AttnError> {
    median_ms(Warmup::Millis(300.0), runs, || gpu.time_ms(&mut call))
}

#[allow(clippy::too_many_arguments)]
fn measure(
    gpu: &Gpu,
    args: &Args,
    kernels: Kernels,
    d: usize,
    t: usize,
    spec: &str,
    [q, k, v, dout]: [&DeviceTensor; 4],
    host: [&Array4<f32>; 3],
    rows: &mut Vec<MaskRow>,
) -> Result<(), AttnError> {
    let (mask, score) = resolve(spec, args.batch, args.heads, t)?;
    cuda::check_mask(&mask, &score, args.batch, args.heads, t)?;
    let gm = GpuMask::new(&mask, &score)?;
    let q_shape = Shape::new(args.batch, args.heads, t, d);
    let dm = DeviceMask::with_kernels(gpu, &gm, kernels, q_shape, t)?;
    let (masked, peer) = match kernels {
        Kernels::Hopper => ("masked", "cuda_hopper"),
        Kernels::Ampere => ("masked_ampere", "cuda_flash"),
    };
    let row = |method: &str, pass: &str, ms: Option<f64>, error: Option<String>| {
        let flops = 4.0
            * d as f64
            * dm.computed_scores() as f64
            * if pass == "fwd" { 1.0 } else { 3.5 };
        MaskRow {
            method: method.into(),
            device: gpu.describe(),
            commit: COMMIT.into(),
            date: utc_now(),
            batch: args.batch,
            heads: args.heads,
            tokens: t,
            head_dim: d,
            dtype: args.dtype.name().into(),
            mask: spec.into(),
            density: dm.density(),
            tiles: dm.tiles(),
            pass: pass.into(),
            runs: args.runs,
            ms,
            tflops: ms.map(|ms| flops / (ms * 1e9)),
            error,
        }
    };
    // check, then time
    let fwd = cuda::forward(gpu, q, k, v, &dm)?;
    let out = gpu.download(&fwd.out)?;
    drop(fwd);
    if let Err(e) = check_rows(host, &out, &mask, &score, args.dtype) {
        rows.push(row(masked, "fwd", None, Some(e)));
        return Ok(());
    }
    let ms = time(gpu, args.runs, || {
        cuda::forward(gpu, q, k, v, &dm).map(drop)
    })?;
    rows.push(row(masked, "fwd", Some(ms), None));
    let ms = time(gpu, args.runs, || {
        let fwd = cuda::forward(gpu, q, k, v, &dm)?;
        cuda::backward(gpu, q, k, v, &fwd, dout, &dm).map(drop)
    })?;
    rows.push(row(masked, "fwd+bwd", Some(ms), None));
    if mask.is_causal() && score.is_identity() {
        // the unmasked causal kernels the masked ones are built on
        let forward = |gpu: &Gpu| match kernels {
            Kernels::Hopper => step06_hopper::forward::forward(gpu, q, k, v),
            Kernels::Ampere => gpu.forward(q, k, v),
        };
        let ms = time(gpu, args.runs, || forward(gpu).map(drop))?;
        rows.push(row(peer, "fwd", Some(ms), None));
        let ms = time(gpu, args.runs, || {
            let fwd = forward(gpu)?;
            match kernels {
                Kernels::Hopper => {
                    step06_hopper::backward::backward(gpu, q, k, v, &fwd, dout).map(drop)
                }
                Kernels::Ampere => {
                    step04_backward::cuda::backward(gpu, q, k, v, &fwd, dout).map(drop)
                }
            }
        })?;
        rows.push(row(peer, "fwd+bwd", Some(ms), None));
    }
    Ok(())
}

fn print_row(r: &MaskRow) {
    let cell = |x: Option<f64>, p: usize| x.map_or("-".into(), |x| format!("{x:.p$}"));
    println!(
        "{:<12} {:<26} {:>4} {:>6} {:>7} {:>6.3} {:>9} {:>8}  {}",
        r.method,
        r.mask,
        r.head_dim,
        r.tokens,
        r.pass,
        r.density,
        cell(r.ms, 3),
        cell(r.tflops, 1),
        r.error.as_deref().unwrap_or("")
    );
}

fn main() -> ExitCode {
    let args = Args::parse();
    let out = match args
        .out
        .as_deref()
        .map(|p| RowsFile::check("--out", p))
        .transpose()
    {
        Ok(out) => out,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let gpu = match Gpu::shared() {
        Ok(gpu) => gpu,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let kernels = match args.kernels.map_or_else(|| Kernels::for_gpu(gpu), Ok) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = kernels.check(gpu) {
        eprintln!("error: --kernels {}: {e}", kernels.name());
        return ExitCode::FAILURE;
    }
    println!("{}", gpu.describe());
    println!(
        "{:<12} {:<26} {:>4} {:>6} {:>7} {:>6} {:>9} {:>8}",
        "method", "mask", "d", "tokens", "pass", "dens.", "ms", "TFLOP/s"
    );
    let mut rows: Vec<MaskRow> = Vec::new();
    let mut failed = false;
    for &d in &args.head_dims {
        for &t in &args.lengths {
            let qs = Shape::new(args.batch, args.heads, t, d);
            let host = [1u64, 2, 3].map(|s| random_normal(qs, 9000 + s));
            let dout = random_normal(qs, 9004);
            let up = |x: &Array4<f32>| gpu.upload(x.view(), args.dtype);
            let tensors = (|| {
                Ok::<_, AttnError>([
                    up(&host[0])?,
                    up(&host[1])?,
                    up(&host[2])?,
                    up(&dout)?,
                ])
            })();
            let tensors = match tensors {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("error: {e}");
                    failed = true;
                    continue;
                }
            };
            for spec in args.masks.split(';').filter(|s| !s.trim().is_empty()) {
                let before = rows.len();
                if let Err(e) = measure(
                    gpu,
                    &args,
                    kernels,
                    d,
                    t,
                    spec.trim(),
                    [&tensors[0], &tensors[1], &tensors[2], &tensors[3]],
                    [&host[0], &host[1], &host[2]],
                    &mut rows,
                ) {
                    eprintln!("{spec} d{d} {t}: {e}");
                    failed = true;
                }
                for r in &rows[before..] {
                    failed |= r.error.is_some();
                    print_row(r);
                }
                if let Some(out) = &out {
                    let _ = out.save_so_far(&flash_core::row::to_json_row_a_line(&rows));
                }
            }
        }
    }
    if let Some(out) = &out {
        let measured = rows.iter().any(|r| r.ms.is_some());
        match out.finish(
            &flash_core::row::to_json_row_a_line(&rows),
            rows.len(),
            measured,
        ) {
            Ok(said) => println!("{said}"),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
