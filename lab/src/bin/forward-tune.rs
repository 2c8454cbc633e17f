//! Times the forward kernel in several tile shapes on the tutorial's GPU shape (4
//! sequences, 12 heads, head dim 64 or another, bf16, causal) and checks that they all give
//! the same output: the measurements behind step 03's tile (`kernels/flash_forward.cu`). The
//! shapes are [`forward_shapes::candidates`](flash_lab::forward_shapes::candidates).
//!
//! `cargo run --release -p flash-lab --bin forward-tune -- [--lengths 1024,4096,16384]
//! [--runs 20] [--head-dim 128] [--default-only]`

use std::process::ExitCode;

use clap::Parser;
use flash_core::Shape;
use flash_lab::forward_shapes;
use flash_lab::forward_shapes::ForwardShape;
use flash_lab::tool::{Tool, at_least_one, median_ms, random_input};
use step03_cuda_forward::gpu::Dtype;
use step03_cuda_forward::kernel::HEAD_DIMS;

/// Times the forward kernel in several tile shapes (4 sequences, 12 heads, bf16, causal)
/// after checking that they all give the same output. Needs a CUDA GPU.
///
/// Prints, per length, each tile shape's TFLOP/s and milliseconds (the median of --runs
/// timed launches after 3 untimed ones): the measurements behind step 03's tile. The first
/// column is the shape the kernel has at the head dim.
#[derive(Parser, Debug)]
#[command(name = "forward-tune")]
struct Args {
    /// Sequence lengths to time, in tokens, separated by commas
    #[arg(long, value_delimiter = ',', value_parser = at_least_one, default_value = "1024,2048,4096,8192,16384")]
    lengths: Vec<usize>,
    /// Timed launches per measurement; each number printed is their median
    #[arg(long, value_parser = at_least_one, default_value_t = 20)]
    runs: usize,
    /// The head dim to time, one the kernel is compiled for
    #[arg(long, default_value_t = 64, value_parser = head_dim)]
    head_dim: usize,
    /// Time only the tile shape the library uses (for a profiler run)
    #[arg(long)]
    default_only: bool,
    /// Time only these tile shapes, by their labels in the table's header (for example
    /// "w4x2 n64 g8"), separated by commas; the library's shape is always the first column
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "LABELS",
        conflicts_with = "default_only"
    )]
    only: Vec<String>,
}

/// One of the kernel's head dims: clap's `value_parser` for `--head-dim`.
fn head_dim(s: &str) -> Result<usize, String> {
    s.trim()
        .parse::<usize>()
        .ok()
        .filter(|d| HEAD_DIMS.contains(d))
        .ok_or_else(|| format!("{s:?} is not one of the kernel's head dims {HEAD_DIMS:?}"))
}

fn main() -> ExitCode {
    let args = Args::parse();
    let head_dim = args.head_dim;
    let mut configs = forward_shapes::candidates(head_dim);
    // --default-only: just the shape the library uses (for a profiler run); --only: it and
    // the shapes named
    if args.default_only {
        configs.truncate(1);
    } else if !args.only.is_empty() {
        let labels: Vec<String> = configs.iter().map(ForwardShape::label).collect();
        if let Some(unknown) = args
            .only
            .iter()
            .find(|l| !labels.contains(&l.trim().to_string()))
        {
            eprintln!(
                "forward-tune: --only: no tile shape at head dim {head_dim} is labelled {unknown:?}; the labels are: {}",
                labels.join(", ")
            );
            return ExitCode::from(2);
        }
        let keep = |(i, c): &(usize, &ForwardShape)| {
            *i == 0 || args.only.iter().any(|l| l.trim() == c.label())
        };
        configs = configs
            .iter()
            .enumerate()
            .filter(keep)
            .map(|(_, &c)| c)
            .collect();
    }
    let configs: &[ForwardShape] = &configs;
    let tool = match Tool::start("forward-tune", args.lengths, args.runs) {
        Ok(tool) => tool,
        Err(code) => return code,
    };
    let (gpu, lengths, runs) = (&tool.gpu, &tool.lengths, tool.runs);
    // every tile shape computes the same function: outputs within a few bf16 roundings of
    // each other (other key-block sizes sum in another order, so bit-equality is not
    // expected)
    let shape = Shape::new(2, 3, 1000, head_dim);
    let x = |seed| random_input(gpu, shape, seed);
    let (q, k, v) = (x(1), x(2), x(3));
    let mut first = None;
    for &config in configs {
        let mut r = gpu.alloc_output(shape, Dtype::Bf16).unwrap();
        forward_shapes::forward(gpu, config, &q, &k, &v, &mut r).unwrap();
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

    // a column per tile shape, as wide as its label
    let widths: Vec<usize> = configs.iter().map(|c| c.label().len().max(18)).collect();
    print!("{:>7}", "T");
    for (c, w) in configs.iter().zip(&widths) {
        print!(" {:>w$}", c.label());
    }
    println!("   (TFLOP/s, head dim {head_dim}, median of {runs})");
    for &tokens in lengths {
        let shape = Shape::new(4, 12, tokens, head_dim);
        let x = |seed| random_input(gpu, shape, seed);
        let (q, k, v) = (x(1), x(2), x(3));
        let mut r = gpu.alloc_output(shape, Dtype::Bf16).unwrap();
        print!("{tokens:>7}");
        for (&config, w) in configs.iter().zip(&widths) {
            let ms = match median_ms(gpu, runs, || {
                forward_shapes::forward(gpu, config, &q, &k, &v, &mut r)
            }) {
                Ok(ms) => ms,
                Err(code) => return code,
            };
            let cell = format!("{:.1} {:>7.3}ms", shape.forward_flops() / ms / 1e9, ms);
            print!(" {cell:>w$}");
        }
        println!();
    }
    ExitCode::SUCCESS
}
