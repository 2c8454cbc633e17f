//! Milliseconds and GFLOP/s of the online softmax on the tutorial's CPU shape, 1 sequence ×
//! 12 heads × T × 64, f32, causal, and of the alternatives that chose the fast version's
//! design.
//!
//! ```sh
//! cargo run --release -p step02-online-softmax --example online-speed               #
//! online, online_loop cargo run --release -p step02-online-softmax --example online-speed
//! -- variants   # the alternatives
//! ```
//!
//! Each number is the median of several timed runs after one untimed warm-up; the result is
//! checked against step 01's f64 reference once per length first (only up to 1024 tokens,
//! where the reference is quick). GFLOP/s use FlashAttention's causal count
//! (`Shape::forward_flops`).

use std::time::Instant;

use flash_core::timing::{Warmup, cpu_median_ms};

use clap::Parser;
use flash_core::inputs::random_qkv;
use flash_core::reference::{attention_f64, error};
use flash_core::{Attention, AttnError, Shape};
use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, Array3, Array4, ArrayView2, ArrayView4, s};
use rayon::prelude::*;
use step02_online_softmax::{Config, Isa, attention, attention_loop, attention_with};

type Forward = dyn Fn(
    ArrayView4<f32>,
    ArrayView4<f32>,
    ArrayView4<f32>,
) -> Result<Attention, AttnError>;

/// This process's CPU time (user + system) in seconds, from /proc (Linux; 0 elsewhere), to
/// tell how many of the cores the timed runs really had while others share the machine.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // the fields after the command name, which is in parentheses; utime and stime are 14
    // and 15
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<f64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|x| x.parse().ok())
        .collect();
    f.iter().sum::<f64>() / 100.0 // clock ticks of 1/100 s
}

/// The median of `runs` timed runs after one warm-up (the core's timing loop), in ms, and
/// the cores used on average over them.
fn median_ms(runs: usize, f: &dyn Fn()) -> (f64, f64) {
    let (cpu0, wall0) = (cpu_seconds(), Instant::now());
    let ms = cpu_median_ms(Warmup::Calls(1), runs, || {
        f();
        Ok::<_, ()>(())
    })
    .expect("no errors");
    let cores = (cpu_seconds() - cpu0) / wall0.elapsed().as_secs_f64();
    (ms, cores)
}

fn row(name: &str, tokens: usize, runs: usize, forward: &Forward, peak: f64) {
    let shape = Shape::new(1, 12, tokens, 64);
    let [q, k, v] = random_qkv(shape, 0);
    if tokens <= 1024 {
        let got = forward(q.view(), k.view(), v.view()).unwrap();
        let want = attention_f64(q.view(), k.view(), v.view()).unwrap();
        let err = error(&got.out, &want.out);
        assert!(err.max_abs < 1e-5, "{name} at {tokens}: {err}");
    }
    let (ms, cores) = median_ms(runs, &|| {
        forward(q.view(), k.view(), v.view()).unwrap();
    });
    let gflops = shape.forward_flops() / (ms * 1e-3) / 1e9;
    let share = 100.0 * gflops / peak;
    println!("| {name} | {tokens} | {ms:.1} | {gflops:.1} | {share:.0}% | {cores:.2} |");
}

fn with(cfg: Config) -> Box<Forward> {
    Box::new(move |q, k, v| attention_with(q, k, v, cfg))
}

/// The design this crate did not take: the same online softmax over blocks of 64, with
/// ndarray's matrix product (matrixmultiply) for both products and the standard library's
/// exp.
fn ndarray_blocks(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
) -> Result<Attention, AttnError> {
    let shape = flash_core::check_qkv(&q, &k, &v)?;
    let [b_n, h_n, t_n, d_n] = shape.dims();
    let scale = shape.scale() as f32;
    let blk = 64;
    let mut out = Array4::<f32>::zeros(shape.dims());
    let mut lse = Array3::<f32>::zeros((b_n, h_n, t_n));
    for b in 0..b_n {
        for h in 0..h_n {
            let (q, k, v) = (
                q.slice(s![b, h, .., ..]),
                k.slice(s![b, h, .., ..]),
                v.slice(s![b, h, .., ..]),
            );
            let blocks: Vec<(usize, Array2<f32>, Vec<f32>)> = (0..t_n.div_ceil(blk))
                .into_par_iter()
                .map(|qb| one_block(q, k, v, qb * blk, blk, scale))
                .collect();
            for (q0, o, l) in blocks {
                let rows = o.nrows();
                out.slice_mut(s![b, h, q0..q0 + rows, ..]).assign(&o);
                lse.slice_mut(s![b, h, q0..q0 + rows])
                    .assign(&ndarray::ArrayView1::from(&l));
            }
        }
    }
    let _ = d_n;
    Ok(Attention { out, lse })
}

fn one_block(
    q: ArrayView2<f32>,
    k: ArrayView2<f32>,
    v: ArrayView2<f32>,
    q0: usize,
    blk: usize,
    scale: f32,
) -> (usize, Array2<f32>, Vec<f32>) {
    let t_n = q.nrows();
    let rows = blk.min(t_n - q0);
    let qb = q.slice(s![q0..q0 + rows, ..]);
    let mut o = Array2::<f32>::zeros((rows, q.ncols()));
    let mut m = vec![f32::NEG_INFINITY; rows];
    let mut l = vec![0.0f32; rows];
    let mut sc = Array2::<f32>::zeros((rows, blk));
    for k0 in (0..q0 + rows).step_by(blk) {
        let cols = blk.min(t_n - k0);
        let mut sb = sc.slice_mut(s![.., ..cols]);
        general_mat_mul(
            scale,
            &qb,
            &k.slice(s![k0..k0 + cols, ..]).t(),
            0.0,
            &mut sb,
        );
        for (i, mut srow) in sb.rows_mut().into_iter().enumerate() {
            for (j, x) in srow.iter_mut().enumerate() {
                if k0 + j > q0 + i {
                    *x = f32::NEG_INFINITY;
                }
            }
            let m_new = srow.fold(m[i], |a, &x| a.max(x));
            let alpha = (m[i] - m_new).exp();
            srow.mapv_inplace(|x| (x - m_new).exp());
            l[i] = alpha * l[i] + srow.sum();
            o.row_mut(i).mapv_inplace(|x| x * alpha);
            m[i] = m_new;
        }
        general_mat_mul(1.0, &sb, &v.slice(s![k0..k0 + cols, ..]), 1.0, &mut o);
    }
    for (i, mut orow) in o.rows_mut().into_iter().enumerate() {
        orow.mapv_inplace(|x| x / l[i]);
        l[i] = m[i] + l[i].ln();
    }
    (q0, o, l)
}

/// Milliseconds and GFLOP/s of the online softmax on 1 sequence × 12 heads × T × 64, f32,
/// causal (each the median of several timed runs after one untimed warm-up, checked against
/// step 01's f64 reference first up to 1024 tokens), as a Markdown table.
#[derive(Parser, Debug)]
#[command(name = "online-speed")]
struct Args {
    /// What to time: nothing for `online` at 1k to 8k tokens and `online_loop` at 1k and
    /// 2k; `variants` for the alternatives that chose the fast version's design (block
    /// sizes, log2(e) folding, exp2, instruction sets, ndarray's matrix product) at 1k and
    /// 4k; `quick` for `online` alone, to iterate on the kernels; `T=2048` for `online` at
    /// that length only, unchecked, for profiling
    #[arg(value_parser = what)]
    what: Option<What>,
}

#[derive(Clone, Copy, Debug)]
enum What {
    Variants,
    Quick,
    Only(usize),
}

fn what(s: &str) -> Result<What, String> {
    match s {
        "variants" => Ok(What::Variants),
        "quick" => Ok(What::Quick),
        _ => s
            .strip_prefix("T=")
            .and_then(|t| t.parse().ok())
            .filter(|&t| t > 0)
            .map(What::Only)
            .ok_or_else(|| {
                "expected `variants`, `quick` or `T=<tokens>`, such as T=2048".into()
            }),
    }
}

fn main() {
    let what = Args::parse().what;
    let variants = matches!(what, Some(What::Variants));
    let quick = matches!(what, Some(What::Quick));
    let only = match what {
        Some(What::Only(t)) => Some(t),
        _ => None,
    };
    let lengths = [1024, 2048, 4096, 8192];
    let isa = Isa::detect();
    let peak = step02_online_softmax::peak::f32_peak_gflops(isa).expect("the detected ISA");
    println!(
        "1 × 12 heads × T × 64, f32, causal; {} threads; median ms; this machine's f32 peak, \
         measured with {isa:?} multiply-add chains on every thread: {peak:.0} GFLOP/s",
        rayon::current_num_threads()
    );
    println!(
        "| method | T | ms | GFLOP/s | of peak | cores used |\n| --- | --- | --- | --- | --- | --- |"
    );
    if let Some(t) = only {
        let shape = Shape::new(1, 12, t, 64);
        let [q, k, v] = random_qkv(shape, 0);
        let (ms, cores) = median_ms(9, &|| {
            attention(q.view(), k.view(), v.view()).unwrap();
        });
        let gflops = shape.forward_flops() / (ms * 1e-3) / 1e9;
        let share = 100.0 * gflops / peak;
        println!("| online | {t} | {ms:.1} | {gflops:.1} | {share:.0}% | {cores:.2} |");
        return;
    }
    if !variants {
        for t in lengths {
            row("online", t, if t >= 8192 { 5 } else { 9 }, &attention, peak);
        }
        if !quick {
            for t in [1024, 2048] {
                row("online_loop", t, 3, &attention_loop, peak);
            }
        }
        return;
    }
    let base = Config::default();
    let mut cases: Vec<(String, Config)> = vec![("default".into(), base)];
    for (bq, bk) in [
        (32, 64),
        (64, 32),
        (64, 128),
        (128, 64),
        (128, 128),
        (256, 64),
    ] {
        cases.push((
            format!("blocks {bq}x{bk}"),
            Config {
                block_q: bq,
                block_k: bk,
                ..base
            },
        ));
    }
    cases.push((
        "log2e not folded".into(),
        Config {
            fold_log2e: false,
            ..base
        },
    ));
    cases.push((
        "std exp2".into(),
        Config {
            fast_exp: false,
            ..base
        },
    ));
    for isa in [Isa::Avx2, Isa::Scalar] {
        if isa.is_available() {
            cases.push((format!("{isa:?}"), Config { isa, ..base }));
        }
    }
    for t in [1024, 4096] {
        for (name, cfg) in &cases {
            row(name, t, 7, &*with(*cfg), peak);
        }
        row("ndarray gemm blocks", t, 5, &ndarray_blocks, peak);
    }
}
