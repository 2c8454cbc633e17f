//! `grouped-bench`: grouped-query attention in the training kernels, checked then timed.

use std::process::ExitCode;

use clap::Parser;
use flash_core::reference::error;
use flash_core::row::RowsFile;
use flash_core::row::{COMMIT, utc_now};
use flash_core::timing::{Warmup, median_ms};
use flash_core::{AttnError, Pass, Shape};
use ndarray::{Array4, s};
use rayon::prelude::*;
use step03_cuda_forward::DeviceAttention;
use step03_cuda_forward::gpu::{DeviceTensor, Dtype, Gpu, parse_half_dtype};
use step03_cuda_forward::tool::at_least_one;
use step06_hopper::kernel::ForwardKernel;
use step08_inference::cuda::cache_value;
use step08_inference::grouped::Forward;
use step08_inference::reference::{by_hand_rows_low_precision, decode_f64};
use step08_inference::rows::{GroupedRow, keep_so_far, write_out};

/// Causal attention with grouped-query attention on the GPU: step 03's forward and step
/// 06's Hopper forward (pass fwd), each with its backward (step 04's, step 06's: pass
/// fwd+bwd), at kv heads as many as the query heads (plain attention) and fewer.
///
/// For every combination of the lists below it makes the inputs (a fixed function of each
/// value's place, exact in bf16 and f16), checks two rows of each forward against the f64
/// reference (FlashAttention's rule: at most twice the error of attention by hand in the
/// same precision), then times each pass (CUDA events, a warm-up, the median of --runs)
/// and reports milliseconds and TFLOP/s (the FLOPs of the query heads, as for plain
/// attention).
#[derive(Parser, Debug)]
#[command(name = "grouped-bench")]
struct Args {
    /// Tokens of each sequence
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1024,2048,4096,8192,16384",
        value_parser = at_least_one
    )]
    lengths: Vec<usize>,
    /// Tokens of all the sequences together: the batch is this over the length (at least 1)
    #[arg(long, default_value_t = 16384, value_parser = at_least_one)]
    total_tokens: usize,
    /// Query heads
    #[arg(long, default_value_t = 32, value_parser = at_least_one)]
    heads: usize,
    /// Kv heads, each dividing the query heads
    #[arg(long, value_delimiter = ',', default_value = "32,8", value_parser = at_least_one)]
    kv_heads: Vec<usize>,
    /// Head dims (64 or 128: the Hopper kernels' own)
    #[arg(long, value_delimiter = ',', default_value = "64,128", value_parser = at_least_one)]
    head_dims: Vec<usize>,
    /// bf16 or f16
    #[arg(long, default_value = "bf16", value_parser = parse_half_dtype)]
    dtype: Dtype,
    /// Timed runs of each pass after the warm-up; the median is reported
    #[arg(long, default_value_t = 10, value_parser = at_least_one)]
    runs: usize,
    /// Write the rows as JSON, one row a line (e.g. charts/data/grouped.json): checked
    /// before any work, written whole at the end; meanwhile the rows so far are kept in
    /// FILE.partial.json
    #[arg(long, value_name = "FILE")]
    out: Option<std::path::PathBuf>,
}

/// A tensor of `shape` whose values are [`cache_value`] of their index and `seed`.
fn values(shape: Shape, seed: u32) -> Array4<f32> {
    let v: Vec<f32> = (0..shape.len() as u64)
        .into_par_iter()
        .map(|e| cache_value(seed, e))
        .collect();
    Array4::from_shape_vec(shape.dims(), v).expect("the shape's values")
}

/// Row `i` of query head `h` of sequence `b` against the f64 reference, with the rule.
fn check_row(
    [q, k, v]: [&Array4<f32>; 3],
    got: &Array4<f32>,
    (b, h, i): (usize, usize, usize),
    g: usize,
    dtype: Dtype,
) -> Result<(), String> {
    let kv = h / g;
    let q = q.slice(s![b..b + 1, h..h + 1, i..i + 1, ..]);
    let k = k.slice(s![b..b + 1, kv..kv + 1, ..=i, ..]);
    let v = v.slice(s![b..b + 1, kv..kv + 1, ..=i, ..]);
    let exact = decode_f64(q, k, v).map_err(|e| e.to_string())?;
    let by_hand = by_hand_rows_low_precision(q, k, v, dtype).map_err(|e| e.to_string())?;
    let ours = error(&got.slice(s![b..b + 1, h..h + 1, i..i + 1, ..]), &exact.out);
    let by_hand = error(&by_hand, &exact.out);
    if ours.max_abs <= 2.0 * by_hand.max_abs + 1e-5 {
        Ok(())
    } else {
        Err(format!(
            "row {i} of head {h} of sequence {b}: ours {ours} is more than twice by hand's {by_hand}"
        ))
    }
}

struct Inputs {
    host: [Array4<f32>; 3],
    q: DeviceTensor,
    k: DeviceTensor,
    v: DeviceTensor,
    dout: DeviceTensor,
}

fn inputs(gpu: &Gpu, shape: Shape, kv: Shape, dtype: Dtype) -> Result<Inputs, AttnError> {
    let host = [values(shape, 1), values(kv, 2), values(kv, 3)];
    let dout = values(shape, 4);
    Ok(Inputs {
        q: gpu.upload(host[0].view(), dtype)?,
        k: gpu.upload(host[1].view(), dtype)?,
        v: gpu.upload(host[2].view(), dtype)?,
        dout: gpu.upload(dout.view(), dtype)?,
        host,
    })
}

fn forward_into(
    gpu: &Gpu,
    kernel: Forward,
    x: &Inputs,
    result: &mut DeviceAttention,
) -> Result<(), AttnError> {
    match kernel {
        Forward::Step03 => gpu.forward_into(&x.q, &x.k, &x.v, result),
        Forward::Hopper => step06_hopper::forward::forward_with(
            gpu,
            ForwardKernel::for_shape(x.q.shape, x.k.shape.heads),
            &x.q,
            &x.k,
            &x.v,
            result,
        ),
    }
}

/// Checks then times one pass; `Err` names what failed.
fn measure(
    gpu: &Gpu,
    x: &Inputs,
    kernel: Forward,
    pass: Pass,
    args: &Args,
) -> Result<f64, String> {
    let shape = x.q.shape;
    let g = shape.heads / x.k.shape.heads;
    let mut result = gpu
        .alloc_output(shape, args.dtype)
        .map_err(|e| e.to_string())?;
    forward_into(gpu, kernel, x, &mut result).map_err(|e| e.to_string())?;
    let got = gpu.download(&result.out).map_err(|e| e.to_string())?;
    let [q, k, v] = &x.host;
    for row in [
        (0, 0, shape.tokens - 1),
        (shape.batch - 1, shape.heads - 1, shape.tokens / 2),
    ] {
        check_row([q, k, v], &got, row, g, args.dtype)?;
    }
    let once = || -> Result<f64, AttnError> {
        gpu.time_ms(|| {
            forward_into(gpu, kernel, x, &mut result)?;
            if pass == Pass::ForwardBackward {
                let grads = kernel.backward(gpu, [&x.q, &x.k, &x.v], &result, &x.dout)?;
                return Ok(Some(grads));
            }
            Ok(None)
        })
    };
    median_ms(Warmup::Millis(200.0), args.runs, once).map_err(|e| e.to_string())
}

fn run(args: &Args, out: Option<&RowsFile>) -> Result<Vec<GroupedRow>, AttnError> {
    let gpu = Gpu::new()?;
    let device = gpu.describe();
    println!("device: {device}");
    println!(
        "{} query heads, {} tokens in all, {}; median of {} runs",
        args.heads,
        args.total_tokens,
        args.dtype.name(),
        args.runs
    );
    println!(
        "{:>4} {:>3} {:>6} {:>5} {:<12} {:<8} | {:>9} {:>8}  note",
        "d", "kv", "tokens", "batch", "method", "pass", "ms", "TFLOP/s"
    );
    let (mut rows, date) = (Vec::new(), utc_now());
    for &d in &args.head_dims {
        for &kv_heads in &args.kv_heads {
            for &tokens in &args.lengths {
                let batch = (args.total_tokens / tokens).max(1);
                let shape = Shape::new(batch, args.heads, tokens, d);
                let kv = flash_core::check::grouped_kv(shape, kv_heads)?;
                let x = inputs(&gpu, shape, kv, args.dtype)?;
                let runs = [
                    (Forward::Step03, Pass::Forward),
                    (Forward::Hopper, Pass::Forward),
                    (Forward::Step03, Pass::ForwardBackward),
                    (Forward::Hopper, Pass::ForwardBackward),
                ];
                for (kernel, pass) in runs {
                    let measured = measure(&gpu, &x, kernel, pass, args);
                    let (ms, err) = match measured {
                        Ok(ms) => (Some(ms), None),
                        Err(e) => (None, Some(e)),
                    };
                    let tflops = ms.map(|ms| shape.flops(pass) / (ms * 1e-3) / 1e12);
                    let method = kernel.name().to_string();
                    println!(
                        "{d:>4} {kv_heads:>3} {tokens:>6} {batch:>5} {method:<12} {:<8} | {:>9} {:>8}  {}",
                        pass.name(),
                        ms.map_or("-".into(), |m| format!("{m:.3}")),
                        tflops.map_or("-".into(), |t| format!("{t:.1}")),
                        err.as_deref().unwrap_or("")
                    );
                    rows.push(GroupedRow {
                        implementation: implementation(kernel, pass),
                        method,
                        device: device.clone(),
                        commit: COMMIT.to_string(),
                        date: date.clone(),
                        batch,
                        heads: args.heads,
                        kv_heads,
                        tokens,
                        head_dim: d,
                        dtype: args.dtype.name().to_string(),
                        pass: pass.name().to_string(),
                        runs: args.runs,
                        ms,
                        tflops,
                        error: err,
                    });
                    keep_so_far(out, &rows);
                }
            }
        }
    }
    Ok(rows)
}

fn implementation(kernel: Forward, pass: Pass) -> String {
    let what = match (kernel, pass) {
        (Forward::Step03, Pass::Forward) => "step 03's flash_forward (mma.sync)",
        (Forward::Hopper, Pass::Forward) => "step 06's Hopper forward (wgmma, TMA)",
        (Forward::Step03, _) => "step 03's flash_forward, step 04's backward (mma.sync)",
        (Forward::Hopper, _) => {
            "step 06's Hopper forward and one-pass backward (wgmma, TMA)"
        }
    };
    match pass {
        Pass::Forward => what.to_string(),
        _ => format!("{what}; dK and dV for each query head, each group's summed"),
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(&kv) = args
        .kv_heads
        .iter()
        .find(|&&kv| !args.heads.is_multiple_of(kv))
    {
        eprintln!(
            "grouped-bench: --kv-heads {kv} does not divide --heads {}: each kv head serves a whole group of query heads",
            args.heads
        );
        return ExitCode::FAILURE;
    }
    // on the CPU, before the GPU is touched
    let out = match args.out.as_deref().map(|out| RowsFile::check("--out", out)) {
        None => None,
        Some(Ok(out)) => Some(out),
        Some(Err(e)) => {
            eprintln!("grouped-bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    match run(&args, out.as_ref()) {
        Ok(rows) => {
            let failed = rows.iter().filter(|r| r.error.is_some()).count();
            if let Err(e) = write_out(out.as_ref(), &rows, failed < rows.len()) {
                eprintln!("grouped-bench: {e}");
                return ExitCode::FAILURE;
            }
            if failed > 0 {
                eprintln!("grouped-bench: {failed} rows failed their check or their run");
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("grouped-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
