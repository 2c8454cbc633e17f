//! Times the backward kernels in several tile shapes on the tutorial's GPU shape (4
//! sequences, 12 heads, head dim 64 or another, bf16, causal) and checks that they all give
//! the same gradients: the measurements behind the tile of step 04's `flash_backward.cu`.
//! The shapes are [`backward_shapes::candidates`](flash_lab::backward_shapes::candidates).
//!
//! `cargo run --release -p flash-lab --bin backward-tune -- [--lengths 4096,16384] [--runs
//! 20] [--head-dim 128] [--split]`
//!
//! `--split` times, for the default shape only, the forward and each backward kernel on its
//! own (events between the launches), with each kernel's rate in the products it really
//! does.

use std::process::ExitCode;

use clap::Parser;
use cudarc::driver::sys::CUevent_flags;
use flash_core::Shape;
use flash_core::timing::median;
use flash_lab::backward_shapes;
use flash_lab::backward_shapes::{BackwardShape, backward, backward_marked};
use flash_lab::tool::{Tool, at_least_one, median_ms, random_input};
use step03_cuda_forward::gpu::{Gpu, cudarc};
use step04_backward::cuda::HEAD_DIMS;

/// Times the backward kernels in several tile shapes (4 sequences, 12 heads, bf16, causal)
/// after checking that they all give the same gradients. Needs a CUDA GPU.
///
/// Prints, per length, each candidate `BackwardShape`'s backward TFLOP/s (2.5 x the
/// forward's FLOPs) and milliseconds (the median of --runs timed calls after 3 untimed
/// ones): the measurements behind step 04's tile. The first column is the
/// shape the library uses for the head dim.
#[derive(Parser, Debug)]
#[command(name = "backward-tune")]
struct Args {
    /// Sequence lengths to time, in tokens, separated by commas
    #[arg(long, value_delimiter = ',', value_parser = at_least_one, default_value = "4096,16384")]
    lengths: Vec<usize>,
    /// Timed calls per measurement; each number printed is their median
    #[arg(long, value_parser = at_least_one, default_value_t = 20)]
    runs: usize,
    /// The head dim to time, one the kernels are compiled for
    #[arg(long, default_value_t = 64, value_parser = head_dim)]
    head_dim: usize,
    /// For the default tile shape only, time the forward and each backward kernel on its
    /// own (CUDA events between the launches), with each kernel's rate in the products it
    /// really does
    #[arg(long)]
    split: bool,
}

/// One of the kernels' head dims: clap's `value_parser` for `--head-dim`.
fn head_dim(s: &str) -> Result<usize, String> {
    s.trim()
        .parse::<usize>()
        .ok()
        .filter(|d| HEAD_DIMS.contains(d))
        .ok_or_else(|| format!("{s:?} is not one of the kernels' head dims {HEAD_DIMS:?}"))
}

fn main() -> ExitCode {
    let args = Args::parse();
    let tool = match Tool::start("backward-tune", args.lengths, args.runs) {
        Ok(tool) => tool,
        Err(code) => return code,
    };
    let (gpu, lengths, runs, head_dim) =
        (&tool.gpu, &tool.lengths, tool.runs, args.head_dim);
    if args.split {
        split(gpu, lengths, runs, head_dim);
        return ExitCode::SUCCESS;
    }
    let configs = backward_shapes::candidates(head_dim);
    let base = configs[0];
    // every tile shape computes the same gradients, within a few bf16 roundings (other
    // sizes sum in another order)
    let shape = Shape::new(2, 3, 1000, head_dim);
    let x = |seed| random_input(gpu, shape, seed);
    let (q, k, v, dout) = (x(1), x(2), x(3), x(4));
    let fwd = gpu.forward(&q, &k, &v).unwrap();
    let mut first = None;
    for &config in &configs {
        let g = backward(gpu, config, &q, &k, &v, &fwd, &dout).unwrap();
        let got = [&g.dq, &g.dk, &g.dv].map(|t| gpu.download(t).unwrap());
        match &first {
            None => first = Some(got),
            Some(f) => {
                let diff = f
                    .iter()
                    .zip(&got)
                    .map(|(a, b)| (a - b).fold(0.0f32, |m, x| m.max(x.abs())))
                    .fold(0.0f32, f32::max);
                println!("{config:?}: max abs difference from the first {diff:.2e}");
                if diff.is_nan() || diff > 0.05 {
                    eprintln!("backward-tune: {config:?} differs from {base:?} by {diff}");
                    return ExitCode::FAILURE;
                }
            }
        }
    }

    // a column per candidate, as wide as its label
    let widths: Vec<usize> = configs.iter().map(|c| c.label().len().max(22)).collect();
    print!("{:>7}", "T");
    for (c, w) in configs.iter().zip(&widths) {
        print!(" {:>w$}", c.label());
    }
    println!(
        "   (backward TFLOP/s, 2.5 x the forward's FLOPs; head dim {head_dim}; median of {runs})"
    );
    for &tokens in lengths {
        let shape = Shape::new(4, 12, tokens, head_dim);
        let x = |seed| random_input(gpu, shape, seed);
        let (q, k, v, dout) = (x(1), x(2), x(3), x(4));
        let fwd = gpu.forward(&q, &k, &v).unwrap();
        print!("{tokens:>7}");
        for (&config, w) in configs.iter().zip(&widths) {
            let ms = match median_ms(gpu, runs, || {
                backward(gpu, config, &q, &k, &v, &fwd, &dout)
            }) {
                Ok(ms) => ms,
                Err(code) => return code,
            };
            let cell = format!("{:.1} {:>6.3}ms", shape.backward_flops() / ms / 1e9, ms);
            print!(" {cell:>w$}");
        }
        println!();
    }
    ExitCode::SUCCESS
}

/// Median milliseconds of the forward and of the three backward kernels, each between
/// events.
fn split(gpu: &Gpu, lengths: &[usize], runs: usize, head_dim: usize) {
    // the kernels' own shape, built by the lab so that each launch can be marked
    let tile = BackwardShape::kernels(head_dim);
    println!("{}", tile.describe());
    println!(
        "{:>7} {:>9} {:>9} {:>9} {:>9}   TFLOP/s of the products each kernel does (forward 2, dK/dV 4, dQ 3)",
        "T", "fwd ms", "delta ms", "dkdv ms", "dq ms"
    );
    for &tokens in lengths {
        let shape = Shape::new(4, 12, tokens, head_dim);
        let x = |seed| random_input(gpu, shape, seed);
        let (q, k, v, dout) = (x(1), x(2), x(3), x(4));
        let ctx = gpu.context();
        let event = || {
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .unwrap()
        };
        let mut times: [Vec<f64>; 4] = Default::default();
        for i in 0..runs + 3 {
            gpu.spin(500).unwrap();
            let marks = [event(), event(), event(), event(), event()];
            marks[0].record(gpu.stream()).unwrap();
            let fwd = gpu.forward(&q, &k, &v).unwrap();
            let mut next = 1;
            let g = backward_marked(gpu, tile, &q, &k, &v, &fwd, &dout, &mut || {
                // the first mark (before δ) ends the forward and the allocations
                marks[next].record(gpu.stream()).unwrap();
                next += 1;
                Ok(())
            })
            .unwrap();
            marks[4].synchronize().unwrap();
            drop(g);
            if i >= 3 {
                for (j, t) in times.iter_mut().enumerate() {
                    t.push(marks[j].elapsed_ms(&marks[j + 1]).unwrap() as f64);
                }
            }
        }
        let ms = times.map(median);
        let f = shape.forward_flops();
        println!(
            "{tokens:>7} {:>9.3} {:>9.3} {:>9.3} {:>9.3}   forward {:.1}, dK/dV {:.1}, dQ {:.1}",
            ms[0],
            ms[1],
            ms[2],
            ms[3],
            f / ms[0] / 1e9,
            2.0 * f / ms[2] / 1e9,
            1.5 * f / ms[3] / 1e9
        );
    }
}
