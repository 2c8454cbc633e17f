//! Times the forward kernel in several tile shapes on the tutorial's GPU shape (4 sequences,
//! 12 heads, head dim 64, bf16, causal) and checks that they all give the same output: the
//! measurements behind the choice of `ForwardConfig::default()`.
//!
//! `forward-tune [--lengths 1024,4096,16384] [--runs 20] [--default-only]`

use std::process::ExitCode;

use cudarc::driver::sys::CUevent_flags;
use step01_naive::Shape;
use step01_naive::inputs::random_normal;
use step03_cuda_forward::{Dtype, ForwardConfig, Gpu};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let lengths: Vec<usize> = value("--lengths")
        .unwrap_or_else(|| "1024,2048,4096,8192,16384".into())
        .split(',')
        .map(|s| s.parse().expect("--lengths: numbers separated by commas"))
        .collect();
    let runs: usize = value("--runs")
        .map(|s| s.parse().expect("--runs: a number"))
        .unwrap_or(20);
    let gpu = match Gpu::new() {
        Ok(gpu) => gpu,
        Err(e) => {
            eprintln!("forward-tune: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("{}", gpu.describe());
    let base = ForwardConfig::for_head_dim(64);
    let configs = [
        base,
        ForwardConfig {
            head_group: 1,
            ..base
        },
        ForwardConfig {
            head_group: 16,
            ..base
        },
        ForwardConfig {
            block_n: 64,
            ..base
        },
        ForwardConfig { warps: 8, ..base },
    ];
    // --default-only: just the shape the library uses (for a profiler run)
    let configs: &[ForwardConfig] = if args.iter().any(|a| a == "--default-only") {
        &configs[..1]
    } else {
        &configs
    };
    // every tile shape computes the same function: outputs within a few bf16 roundings of each
    // other (other key-block sizes sum in another order, so bit-equality is not expected)
    let shape = Shape::new(2, 3, 1000, 64);
    let x = |seed| {
        gpu.upload(random_normal(shape, seed).view(), Dtype::Bf16)
            .unwrap()
    };
    let (q, k, v) = (x(1), x(2), x(3));
    let mut first = None;
    for &config in configs {
        let mut r = gpu.alloc_output(shape, Dtype::Bf16).unwrap();
        gpu.forward_with(config, &q, &k, &v, &mut r).unwrap();
        let out = gpu.download(&r.out).unwrap();
        match &first {
            None => first = Some(out),
            Some(f) => {
                let diff = (f - &out).fold(0.0f32, |m, x| m.max(x.abs()));
                println!("{config:?}: max abs difference from the first {diff:.2e}");
                if diff.is_nan() || diff > 0.02 {
                    eprintln!(
                        "forward-tune: {config:?} differs from {:?} by {diff}",
                        configs[0]
                    );
                    return ExitCode::FAILURE;
                }
            }
        }
    }

    print!("{:>7}", "T");
    for c in configs {
        print!(
            " {:>18}",
            format!(
                "w{}x{} n{} g{}{}",
                c.warps,
                c.m_tiles,
                c.block_n,
                c.head_group,
                if c.lazy_rescale { " lazy" } else { "" }
            )
        );
    }
    println!("   (TFLOP/s, median of {runs})");
    for &tokens in &lengths {
        let shape = Shape::new(4, 12, tokens, 64);
        let x = |seed| {
            gpu.upload(random_normal(shape, seed).view(), Dtype::Bf16)
                .unwrap()
        };
        let (q, k, v) = (x(1), x(2), x(3));
        let mut r = gpu.alloc_output(shape, Dtype::Bf16).unwrap();
        print!("{tokens:>7}");
        for &config in configs {
            let ctx = gpu.context();
            let mut times = Vec::new();
            for i in 0..runs + 3 {
                let start = ctx
                    .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .unwrap();
                let end = ctx
                    .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .unwrap();
                gpu.spin(500).unwrap();
                start.record(gpu.stream()).unwrap();
                gpu.forward_with(config, &q, &k, &v, &mut r).unwrap();
                end.record(gpu.stream()).unwrap();
                end.synchronize().unwrap();
                if i >= 3 {
                    times.push(start.elapsed_ms(&end).unwrap() as f64);
                }
            }
            times.sort_by(f64::total_cmp);
            let ms = times[times.len() / 2];
            print!(" {:>9.1} {:>7.3}ms", shape.forward_flops() / ms / 1e9, ms);
        }
        println!();
    }
    ExitCode::SUCCESS
}
