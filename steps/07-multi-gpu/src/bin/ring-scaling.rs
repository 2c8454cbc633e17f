//! How the ring scales: the forward, and the forward and backward, at a fixed number of
//! tokens per GPU, on one GPU (step 03's and step 04's kernels over the whole sequence, `T
//! = N · per GPU`) and on N GPUs (the ring, one rank per GPU, NCCL). Prints TFLOP/s and the
//! scaling efficiency `t1 / (N · tN)`, the ring's time with only its transfers and with
//! only its blocks (the overlap: with perfect overlap the whole takes the longer of the
//! two), and the memory per GPU; from that memory per token, the longest sequence each GPU
//! count could take (computed, not run). Writes the numbers as JSON to `--out`.
//!
//! `ring-scaling [--gpus N] [--tokens-per-gpu 65536] [--batch 4] [--heads 12] [--runs 5]
//! [--out FILE]`

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use flash_core::timing::median;
use flash_core::{AttnError, Pass, Shape};
use ndarray::{Array4, Axis, concatenate};
use serde::Serialize;
use step03_cuda_forward::gpu::{Dtype, Gpu, device_error};
use step04_backward::cuda::backward;
use step07_multi_gpu::gpu::{Parts, Ranks, RingAttention, Shard, keep_pool_memory};
use step07_multi_gpu::methods::{peak_per_gpu, time_ring_ms};

/// Measures the GPU ring against one GPU at a fixed number of tokens per GPU.
#[derive(Parser, Debug)]
#[command(name = "ring-scaling")]
struct Args {
    /// GPUs of the ring [default: every GPU there is]
    #[arg(long)]
    gpus: Option<usize>,
    /// Tokens each GPU holds
    #[arg(long, default_value_t = 65536)]
    tokens_per_gpu: usize,
    /// Sequences (the benchmark's default on the GPU)
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Heads (the benchmark's default)
    #[arg(long, default_value_t = 12)]
    heads: usize,
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Timed runs after a warm-up; the median is reported
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Also time the forward and backward (takes about 3.5 times as long)
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    backward: bool,
    /// Where to write the JSON
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

#[derive(Serialize)]
struct Timing {
    /// "one GPU" (the single-GPU kernels), "ring" (every part), "ring, blocks only", "ring,
    /// transfers only"
    what: String,
    gpus: usize,
    pass: String,
    tokens: usize,
    ms: f64,
    tflops: f64,
    /// t1 / (N · tN), for the whole ring
    efficiency: Option<f64>,
    /// The largest of the GPUs' peaks above the inputs, in bytes.
    peak_bytes_per_gpu: Option<u64>,
    /// q, k, v (and dout) on one GPU, in bytes.
    input_bytes_per_gpu: u64,
}

#[derive(Serialize)]
struct Longest {
    gpus: usize,
    pass: String,
    /// Bytes per token on one GPU: inputs and peak over the measured run, divided by its
    /// tokens per GPU.
    bytes_per_token_per_gpu: f64,
    /// Computed from the memory per token and the GPU's memory, not run.
    computed_longest_tokens: usize,
}

#[derive(Serialize)]
struct Report {
    device: String,
    commit: String,
    date: String,
    batch: usize,
    heads: usize,
    head_dim: usize,
    dtype: String,
    tokens_per_gpu: usize,
    runs: usize,
    timings: Vec<Timing>,
    longest: Vec<Longest>,
}

/// Warm-up, then the median of `runs` timed calls.
fn timed(
    runs: usize,
    mut f: impl FnMut() -> Result<f64, AttnError>,
) -> Result<f64, AttnError> {
    let start = Instant::now();
    // at least two calls and 200 ms of warm-up (clocks up, kernels compiled, pools grown)
    let mut n = 0;
    while n < 2 || start.elapsed().as_secs_f64() < 0.2 {
        f()?;
        n += 1;
    }
    let xs = (0..runs.max(1))
        .map(|_| f())
        .collect::<Result<Vec<_>, _>>()?;
    Ok(median(xs))
}

/// A random `[b, h, t, d]` input, made from a 4096-token block repeated along the tokens
/// (making 10⁹ normal values on the host would take longer than the measurement).
fn input(shape: Shape, seed: u64) -> Array4<f32> {
    let block = 4096.min(shape.tokens);
    let base = flash_core::inputs::random_normal(
        Shape::new(shape.batch, shape.heads, block, shape.head_dim),
        seed,
    );
    let reps = shape.tokens / block;
    let views: Vec<_> = (0..reps).map(|_| base.view()).collect();
    concatenate(Axis(2), &views).expect("one shape")
}

fn run(args: &Args) -> Result<Report, AttnError> {
    let n = args.gpus.unwrap_or_else(Gpu::count).max(1);
    let dtype = Dtype::Bf16;
    let per = args.tokens_per_gpu;
    let tokens = n * per;
    let shape = Shape::new(args.batch, args.heads, tokens, args.head_dim);
    let gpu0 = Gpu::shared()?;
    for o in 0..n {
        keep_pool_memory(Gpu::shared_on(o)?)?;
    }
    let device = format!("{} × {n}", gpu0.describe());
    println!("{device}");
    println!(
        "batch {}, heads {}, head dim {}, bf16, causal; {per} tokens per GPU, T = {tokens}; median of {} runs",
        args.batch, args.heads, args.head_dim, args.runs
    );
    let passes: Vec<Pass> = if args.backward {
        vec![Pass::Forward, Pass::ForwardBackward]
    } else {
        vec![Pass::Forward]
    };
    let inputs = (
        input(shape, 1),
        input(shape, 2),
        input(shape, 3),
        input(shape, 4),
    );
    let total_mem = gpu0
        .context()
        .total_mem()
        .map_err(device_error("reading the GPU's memory"))? as f64;
    let (mut timings, t1) = time_one_gpu(args, gpu0, shape, &passes, &inputs)?;
    let (ring_timings, longest) =
        time_ring(args, n, shape, &passes, inputs, &t1, total_mem)?;
    timings.extend(ring_timings);
    print_longest(&longest, total_mem);
    Ok(Report {
        device,
        commit: flash_core::row::COMMIT.into(),
        date: flash_core::row::utc_now(),
        batch: args.batch,
        heads: args.heads,
        head_dim: args.head_dim,
        dtype: dtype.name().into(),
        tokens_per_gpu: per,
        runs: args.runs,
        timings,
        longest,
    })
}

/// q, k, v and dout on the host, `[B, H, T, D]` each.
type Inputs = (Array4<f32>, Array4<f32>, Array4<f32>, Array4<f32>);

/// Bytes of one bf16 tensor of `t` tokens.
fn tensor_bytes(args: &Args, t: usize) -> u64 {
    (args.batch * args.heads * t * args.head_dim * 2) as u64
}

/// One GPU: the single-GPU kernels over the whole sequence, each pass's timing and its
/// milliseconds (the efficiency's t1) by pass.
fn time_one_gpu(
    args: &Args,
    gpu0: &Gpu,
    shape: Shape,
    passes: &[Pass],
    (q, k, v, dout): &Inputs,
) -> Result<(Vec<Timing>, HashMap<&'static str, f64>), AttnError> {
    let dtype = Dtype::Bf16;
    let tokens = shape.tokens;
    let mut timings = Vec::new();
    let mut t1 = HashMap::new();
    let up = |x: &Array4<f32>| gpu0.upload(x.view(), dtype);
    let (qd, kd, vd, dd) = (up(q)?, up(k)?, up(v)?, up(dout)?);
    let mut out = gpu0.alloc_output(shape, dtype)?;
    for &pass in passes {
        let ms = match pass {
            Pass::Forward => timed(args.runs, || {
                gpu0.time_ms(|| gpu0.forward_into(&qd, &kd, &vd, &mut out))
            })?,
            _ => timed(args.runs, || {
                gpu0.time_ms(|| {
                    let fwd = gpu0.forward(&qd, &kd, &vd)?;
                    backward(gpu0, &qd, &kd, &vd, &fwd, &dd)
                })
            })?,
        };
        let peak = match pass {
            Pass::Forward => gpu0.peak_allocated(|| gpu0.forward(&qd, &kd, &vd))?.1,
            _ => {
                gpu0.peak_allocated(|| {
                    let fwd = gpu0.forward(&qd, &kd, &vd)?;
                    backward(gpu0, &qd, &kd, &vd, &fwd, &dd)
                })?
                .1
            }
        };
        t1.insert(pass.name(), ms);
        let inputs = tensor_bytes(args, tokens) * if pass == Pass::Forward { 3 } else { 4 };
        print_row("one GPU", 1, pass, shape, ms, None, peak);
        timings.push(Timing {
            what: "one GPU".into(),
            gpus: 1,
            pass: pass.name().into(),
            tokens,
            ms,
            tflops: shape.flops(pass) / (ms * 1e-3) / 1e12,
            efficiency: None,
            peak_bytes_per_gpu: peak,
            input_bytes_per_gpu: inputs,
        });
    }
    Ok((timings, t1))
}

/// The ring on `n` GPUs: every part, its blocks alone, its transfers alone; the timings,
/// and from the whole ring's memory per token the longest sequence that would fit.
fn time_ring(
    args: &Args,
    n: usize,
    shape: Shape,
    passes: &[Pass],
    (q, k, v, dout): Inputs,
    t1: &HashMap<&'static str, f64>,
    total_mem: f64,
) -> Result<(Vec<Timing>, Vec<Longest>), AttnError> {
    let dtype = Dtype::Bf16;
    let (per, tokens) = (args.tokens_per_gpu, shape.tokens);
    let mut timings = Vec::new();
    let mut longest = Vec::new();
    let mut ring = RingAttention::new(Ranks::Gpus(n), shape, dtype)?;
    let scatter = |ring: &RingAttention, x: &Array4<f32>| ring.scatter(x.view());
    let (qs, ks, vs, ds) = (
        scatter(&ring, &q)?,
        scatter(&ring, &k)?,
        scatter(&ring, &v)?,
        scatter(&ring, &dout)?,
    );
    drop((q, k, v, dout));
    for &pass in passes {
        let call = |ring: &RingAttention,
                    qs: &[Shard],
                    ks: &[Shard],
                    vs: &[Shard],
                    ds: &[Shard]| {
            let fwd = ring.forward(qs, ks, vs)?;
            if pass == Pass::Forward {
                return Ok((fwd, None));
            }
            let g = ring.backward(qs, ks, vs, &fwd, ds)?;
            Ok::<_, AttnError>((fwd, Some(g)))
        };
        for (what, parts) in [
            ("ring", Parts::Both),
            ("ring, blocks only", Parts::ComputeOnly),
            ("ring, transfers only", Parts::TransfersOnly),
        ] {
            ring.set_parts(parts);
            let ms = timed(args.runs, || {
                time_ring_ms(&ring, || call(&ring, &qs, &ks, &vs, &ds))
            })?;
            let (efficiency, peak) = if parts == Parts::Both {
                let peaks = peak_per_gpu(&ring, || call(&ring, &qs, &ks, &vs, &ds))?;
                let peak = peaks.into_iter().max();
                (t1.get(pass.name()).map(|t1| t1 / (n as f64 * ms)), peak)
            } else {
                (None, None)
            };
            let inputs =
                tensor_bytes(args, per) * if pass == Pass::Forward { 3 } else { 4 };
            print_row(what, n, pass, shape, ms, efficiency, peak);
            if let Some(peak) = peak {
                let per_token = (inputs + peak) as f64 / per as f64;
                // every GPU holds T / N tokens; the split needs a multiple of 2N, and 128
                // rows a block keeps the kernels' tiles whole
                let grain = 2 * n * 128;
                let fit = (0.95 * total_mem / per_token) as usize * n / grain * grain;
                longest.push(Longest {
                    gpus: n,
                    pass: pass.name().into(),
                    bytes_per_token_per_gpu: per_token,
                    computed_longest_tokens: fit,
                });
            }
            timings.push(Timing {
                what: what.into(),
                gpus: n,
                pass: pass.name().into(),
                tokens,
                ms,
                tflops: shape.flops(pass) / (ms * 1e-3) / 1e12,
                efficiency,
                peak_bytes_per_gpu: peak,
                input_bytes_per_gpu: inputs,
            });
        }
    }
    Ok((timings, longest))
}

/// The longest sequences the measured memory per token allows, computed and not run.
fn print_longest(longest: &[Longest], total_mem: f64) {
    println!();
    for l in longest {
        println!(
            "computed, not run: {} {}: {:.0} bytes per token per GPU; longest sequence that fits in 95% of {:.0} GB per GPU: {} tokens over {} GPU(s)",
            l.pass,
            l.gpus,
            l.bytes_per_token_per_gpu,
            total_mem / 1e9,
            l.computed_longest_tokens,
            l.gpus
        );
    }
}

fn print_row(
    what: &str,
    gpus: usize,
    pass: Pass,
    shape: Shape,
    ms: f64,
    efficiency: Option<f64>,
    peak: Option<u64>,
) {
    let tflops = shape.flops(pass) / (ms * 1e-3) / 1e12;
    println!(
        "{what:<22} {gpus} GPU(s) {:<8} T={:<7} {ms:>10.2} ms {tflops:>7.1} TFLOP/s{}{}",
        pass.name(),
        shape.tokens,
        efficiency.map_or(String::new(), |e| format!("  efficiency {:.1}%", 100.0 * e)),
        peak.map_or(String::new(), |p| format!(
            "  peak {:.2} GB/GPU above inputs",
            p as f64 / 1e9
        )),
    );
}

fn main() -> ExitCode {
    let args = Args::parse();
    // before the GPUs are touched: a run of minutes must not end in an unwritable path
    if let Some(out) = &args.out
        && let Err(e) = flash_core::files::check_output("--out", out)
    {
        eprintln!("ring-scaling: {e}");
        return ExitCode::FAILURE;
    }
    match run(&args) {
        Ok(report) => {
            if let Some(out) = &args.out {
                let json = flash_core::row::to_json_row_a_line(&report);
                // whole or not at all: an earlier report stays as it was if this one fails
                if let Err(e) = flash_core::files::write_atomic(out, json.as_bytes()) {
                    eprintln!("ring-scaling: {e}");
                    return ExitCode::FAILURE;
                }
                println!("wrote {}", out.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ring-scaling: {e}");
            ExitCode::FAILURE
        }
    }
}
