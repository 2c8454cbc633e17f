//! Milliseconds of the CPU backward alone (from the forward's output and log-sum-exp to dq,
//! dk and dv) on the tutorial's CPU shape, 1 sequence × 12 heads × T × 64, f32, causal: one
//! pass with several block sizes, and the two passes of the GPU's split. The measurements
//! behind `BlockSizes::default()` and the choice of one pass.
//!
//! ```sh
//! cargo run --release -p step04-backward --example backward-speed [-- 1024,2048,4096,8192]
//! ```
//!
//! Each number is the median of 5 timed runs (3 from 4,096 tokens) after one untimed
//! warm-up. The output is a Markdown table (`book/src/output/backward-cpu-speed.txt`,
//! included by chapter 4). Every variant's gradients are checked against the default's
//! first. GFLOP/s use FlashAttention's count: the backward is 2.5 × the forward.

use clap::Parser;
use flash_core::Shape;
use flash_core::inputs::{random_normal, random_qkv};
use flash_core::timing::{Warmup, cpu_median_ms};
use ndarray::Array4;
use step03_cuda_forward::tool::at_least_one;
use step04_backward::{
    BlockSizes, Grads, backward_two_pass, backward_with_blocks, forward,
};

/// Milliseconds (and GFLOP/s, 2.5 × the forward's count) of the CPU backward alone, from
/// the forward's output and log-sum-exp to dq, dk and dv, on 1 sequence × 12 heads × T ×
/// 64, f32, causal: one pass with several block sizes, and the two passes of the GPU's
/// split.
///
/// Each number is the median of 5 timed runs (3 from 4,096 tokens) after one untimed
/// warm-up; every variant's gradients are checked against the default's first. Prints a
/// Markdown table.
#[derive(Parser, Debug)]
#[command(name = "backward-speed")]
struct Args {
    /// Sequence lengths to time, in tokens, separated by commas
    #[arg(value_delimiter = ',', value_parser = at_least_one, default_value = "1024,2048,4096,8192")]
    lengths: Vec<usize>,
}

/// The median of `runs` timed runs after one warm-up: the core's timing loop.
fn median_ms(runs: usize, f: &dyn Fn() -> Grads) -> f64 {
    cpu_median_ms(Warmup::Calls(1), runs, || Ok::<_, ()>(f())).expect("no errors")
}

fn max_diff(a: &Grads, b: &Grads) -> f32 {
    let d = |x: &Array4<f32>, y: &Array4<f32>| {
        x.iter()
            .zip(y)
            .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
    };
    d(&a.dq, &b.dq).max(d(&a.dk, &b.dk)).max(d(&a.dv, &b.dv))
}

fn main() {
    let lengths = Args::parse().lengths;
    let b = |queries, keys| BlockSizes { queries, keys };
    let variants: [(&str, BlockSizes, bool); 5] = [
        ("one pass 128×128", BlockSizes::default(), false),
        ("one pass 64×64", b(64, 64), false),
        ("one pass 256×256", b(256, 256), false),
        ("one pass 64×256", b(64, 256), false),
        ("two passes 128×128", BlockSizes::default(), true),
    ];
    // a Markdown table: the book includes the output as it is
    println!(
        "Backward alone, ms (GFLOP/s), 1 × 12 heads × T × 64, f32, causal, {} threads:",
        rayon::current_num_threads()
    );
    println!();
    print!("| T |");
    for (name, ..) in &variants {
        print!(" {name} |");
    }
    println!();
    println!("| ---: |{}", " ---: |".repeat(variants.len()));
    for tokens in lengths {
        let shape = Shape::new(1, 12, tokens, 64);
        let [q, k, v] = random_qkv(shape, 0);
        let dout = random_normal(shape, 1);
        let fwd = forward(q.view(), k.view(), v.view()).unwrap();
        let run = |blocks, two| {
            let f = if two {
                backward_two_pass
            } else {
                backward_with_blocks
            };
            f(q.view(), k.view(), v.view(), &fwd, dout.view(), blocks).unwrap()
        };
        let first = run(BlockSizes::default(), false);
        let runs = if tokens >= 4096 { 3 } else { 5 };
        print!("| {tokens} |");
        for &(name, blocks, two) in &variants {
            let d = max_diff(&run(blocks, two), &first);
            assert!(d < 1e-4, "{name}: differs from the default by {d}");
            let ms = median_ms(runs, &|| run(blocks, two));
            let gflops = shape.backward_flops() / ms / 1e6;
            print!(" {ms:.1} ({gflops:.0}) |");
        }
        println!();
    }
}
