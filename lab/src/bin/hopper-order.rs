//! Times step 06's forward and backward in the order their rule picks and in the other
//! (`LONGEST_FIRST` on and off, `kernel::longest_first`)
//! at shapes of many heads (32 query heads, 16,384 tokens in all), plain and grouped, and at
//! chapter 6's 4 × 12 heads: whether the order that spreads a head's blocks over the whole
//! grid still pays when its keys and values no longer fit in L2. Both orders must give the
//! same bits (each block computes the same thing); the forward's outputs are compared.
//!
//! `cargo run --release -p flash-lab --bin hopper-order [-- --runs 10]`

use std::process::ExitCode;

use clap::Parser;
use flash_core::inputs::random_normal;
use flash_core::timing::{Warmup, median_ms};
use flash_core::{AttnError, Shape};
use step03_cuda_forward::gpu::{Dtype, Gpu};
use step06_hopper::kernel::{BackwardKernels, ForwardKernel};
use step06_hopper::{backward, forward};

#[derive(Parser, Debug)]
#[command(name = "hopper-order")]
struct Args {
    /// Timed runs of each measurement; the median is printed
    #[arg(long, default_value_t = 10)]
    runs: usize,
}

fn run(args: &Args) -> Result<(), AttnError> {
    let gpu = Gpu::new()?;
    println!("{}", gpu.describe());
    println!(
        "{:>4} {:>5} {:>3} {:>3} {:>6} {:>8} | {:>9} {:>9} {:>6} | {:>9} {:>9} {:>6}",
        "d",
        "batch",
        "h",
        "kv",
        "tokens",
        "kv MB",
        "fwd rule",
        "fwd flip",
        "ratio",
        "f+b rule",
        "f+b flip",
        "ratio"
    );
    let mut shapes = Vec::new();
    for d in [64, 128] {
        for (batch, heads, kv) in [(16, 32, 32), (16, 32, 8), (4, 12, 12)] {
            for tokens in [1024, 2048, 4096] {
                let batch = if heads == 32 {
                    batch * 1024 / tokens
                } else {
                    batch
                };
                shapes.push((d, batch, heads, kv, tokens));
            }
        }
    }
    for (d, batch, heads, kv, tokens) in shapes {
        let shape = Shape::new(batch, heads, tokens, d);
        let kvs = Shape { heads: kv, ..shape };
        let up = |s: Shape, seed| gpu.upload(random_normal(s, seed).view(), Dtype::Bf16);
        let (q, k, v, dout) = (up(shape, 1)?, up(kvs, 2)?, up(kvs, 3)?, up(shape, 4)?);
        let rule = ForwardKernel::for_shape(shape, kv);
        let flip = rule.other_order();
        let brule = BackwardKernels::for_shape(shape);
        let bflip = brule.other_order();
        let mut outs = Vec::new();
        let mut times = Vec::new();
        for (f, b) in [(rule, brule), (flip, bflip)] {
            let mut result = gpu.alloc_output(shape, Dtype::Bf16)?;
            forward::forward_with(&gpu, f, &q, &k, &v, &mut result)?;
            outs.push(gpu.download(&result.out)?);
            let fwd = median_ms(Warmup::Millis(200.0), args.runs, || {
                gpu.time_ms(|| forward::forward_with(&gpu, f, &q, &k, &v, &mut result))
            })?;
            let both = median_ms(Warmup::Millis(200.0), args.runs, || {
                gpu.time_ms(|| {
                    forward::forward_with(&gpu, f, &q, &k, &v, &mut result)?;
                    backward::backward_with(&gpu, b, &q, &k, &v, &result, &dout)
                })
            })?;
            times.push((fwd, both));
        }
        if outs[0] != outs[1] {
            return Err(AttnError::Device {
                what: format!("{shape} kv {kv}: the two orders' outputs differ"),
            });
        }
        let mb = (2 * batch * kv * tokens * d * 2) as f64 / 1e6;
        println!(
            "{d:>4} {batch:>5} {heads:>3} {kv:>3} {tokens:>6} {mb:>8.1} | {:>9.3} {:>9.3} {:>5.2}x | {:>9.3} {:>9.3} {:>5.2}x   (rule: longest first {} / {})",
            times[0].0,
            times[1].0,
            times[0].0 / times[1].0,
            times[0].1,
            times[1].1,
            times[0].1 / times[1].1,
            rule.longest_first,
            brule.dkdv.longest_first
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hopper-order: {e}");
            ExitCode::FAILURE
        }
    }
}
