//! Times the matrix products of step 05's CPU trainer in three crates, matrixmultiply
//! (`ndarray`'s, which the readable model uses), gemm and faer, on one thread and on two,
//! after checking that all three give the same product: the measurements behind the choice
//! of faer for `steps/05-train/src/fast.rs` (`lab/notes/05-train.md`).
//!
//! `cargo run --release -p flash-lab --bin cpu-products -- [--rows 1024] [--runs 15]`
//!
//! The shapes are those of chapter 5's small model (d_model 128, 256 bytes) over `--rows`
//! rows: 1,024 is one shard of a batch of 16 × 128 tokens on two cores, 2,048 the whole
//! batch. Every product writes `c = a · b`, row-major, with `a` or `b` read transposed
//! where the trainer reads them so.

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use flash_core::inputs::SplitMix64;
use flash_core::timing::median;
use rayon::prelude::*;

/// Times the CPU trainer's products in matrixmultiply, gemm and faer, on 1 and 2 threads.
#[derive(Parser)]
struct Args {
    /// Rows of the activations (batch × tokens of the work one call sees)
    #[arg(long, default_value_t = 1024)]
    rows: usize,
    /// Timed calls per product and crate (the median is printed), after one untimed
    #[arg(long, default_value_t = 15)]
    runs: usize,
}

/// `c[m, n] = a[m, k] · b[k, n]`; `at`: `a` is stored `[k, m]`, `bt`: `b` is stored `[n, k]`.
#[derive(Clone, Copy)]
struct Product {
    name: &'static str,
    m: usize,
    k: usize,
    n: usize,
    at: bool,
    bt: bool,
}

const CRATES: [&str; 3] = ["matrixmultiply", "gemm", "faer"];

/// Row and column strides of a logical `[r, c]` matrix, stored row-major or transposed.
fn strides(r: usize, c: usize, t: bool) -> (isize, isize) {
    if t { (1, r as isize) } else { (c as isize, 1) }
}

/// One product by one crate on `threads` threads. matrixmultiply has no thread pool of its
/// own here: its two threads are rayon's, each taking half of `c`'s rows.
fn product(which: &str, p: Product, threads: usize, a: &[f32], b: &[f32], c: &mut [f32]) {
    let (m, k, n) = (p.m, p.k, p.n);
    let (ars, acs) = strides(m, k, p.at);
    let (brs, bcs) = strides(k, n, p.bt);
    match which {
        "matrixmultiply" => {
            let per = m.div_ceil(threads);
            c.par_chunks_mut(per * n).enumerate().for_each(|(i, c)| {
                let rows = c.len() / n;
                // SAFETY: the strides describe `a` and `b` whole; this call reads rows
                // i·per.. of `a`, which exist, and writes its own rows of `c`
                unsafe {
                    let a = a.as_ptr().offset((i * per) as isize * ars);
                    matrixmultiply::sgemm(
                        rows,
                        k,
                        n,
                        1.0,
                        a,
                        ars,
                        acs,
                        b.as_ptr(),
                        brs,
                        bcs,
                        0.0,
                        c.as_mut_ptr(),
                        n as isize,
                        1,
                    )
                }
            });
        }
        "gemm" => {
            let par = match threads {
                1 => gemm::Parallelism::None,
                t => gemm::Parallelism::Rayon(t),
            };
            // SAFETY: as above; gemm takes column strides first
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    c.as_mut_ptr(),
                    1,
                    n as isize,
                    false,
                    a.as_ptr(),
                    acs,
                    ars,
                    b.as_ptr(),
                    bcs,
                    brs,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    par,
                )
            }
        }
        _ => {
            use faer::{Accum, MatMut, MatRef, Par};
            let par = match threads {
                1 => Par::Seq,
                t => Par::rayon(t),
            };
            let a = match p.at {
                true => MatRef::from_row_major_slice(a, k, m).transpose(),
                false => MatRef::from_row_major_slice(a, m, k),
            };
            let b = match p.bt {
                true => MatRef::from_row_major_slice(b, n, k).transpose(),
                false => MatRef::from_row_major_slice(b, k, n),
            };
            let c = MatMut::from_row_major_slice_mut(c, m, n);
            faer::linalg::matmul::matmul(c, Accum::Replace, a, b, 1.0f32, par);
        }
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.rows == 0 || args.runs == 0 {
        eprintln!("error: --rows and --runs take 1 or more");
        return ExitCode::FAILURE;
    }
    let (r, c, v) = (args.rows, 128, 256);
    #[rustfmt::skip]
    let products = [
        Product { name: "qkv: x·W", m: r, k: c, n: 3 * c, at: false, bt: false },
        Product { name: "proj: x·W", m: r, k: c, n: c, at: false, bt: false },
        Product { name: "fc: x·W", m: r, k: c, n: 4 * c, at: false, bt: false },
        Product { name: "fc_proj: x·W", m: r, k: 4 * c, n: c, at: false, bt: false },
        Product { name: "logits: h·wteᵀ", m: r, k: c, n: v, at: false, bt: true },
        Product { name: "dx qkv: dy·Wᵀ", m: r, k: 3 * c, n: c, at: false, bt: true },
        Product { name: "dx proj: dy·Wᵀ", m: r, k: c, n: c, at: false, bt: true },
        Product { name: "dx fc: dy·Wᵀ", m: r, k: 4 * c, n: c, at: false, bt: true },
        Product { name: "dx fc_proj: dy·Wᵀ", m: r, k: c, n: 4 * c, at: false, bt: true },
        Product { name: "dh: dlogits·wte", m: r, k: v, n: c, at: false, bt: false },
        Product { name: "dW qkv: xᵀ·dy", m: c, k: r, n: 3 * c, at: true, bt: false },
        Product { name: "dW proj: xᵀ·dy", m: c, k: r, n: c, at: true, bt: false },
        Product { name: "dW fc: xᵀ·dy", m: c, k: r, n: 4 * c, at: true, bt: false },
        Product { name: "dW fc_proj: xᵀ·dy", m: 4 * c, k: r, n: c, at: true, bt: false },
        Product { name: "dwte: dlogitsᵀ·h", m: v, k: r, n: c, at: true, bt: false },
    ];
    let mut rng = SplitMix64::new(1);
    println!(
        "{} rows; GFLOP/s, the median of {} calls; {} threads in rayon's pool",
        r,
        args.runs,
        rayon::current_num_threads()
    );
    println!(
        "{:<22} {:>7} {:>15} {:>8} {:>8}",
        "product", "threads", CRATES[0], CRATES[1], CRATES[2]
    );
    // seconds of each crate over all the products, on 1 and on 2 threads
    let mut totals = [[0.0f64; 3]; 2];
    for p in products {
        let a: Vec<f32> = (0..p.m * p.k).map(|_| rng.next_normal() as f32).collect();
        let b: Vec<f32> = (0..p.k * p.n).map(|_| rng.next_normal() as f32).collect();
        let mut want = vec![0.0f32; p.m * p.n];
        product("matrixmultiply", p, 1, &a, &b, &mut want);
        let flop = 2.0 * (p.m * p.k * p.n) as f64;
        for (ti, threads) in [1, 2].into_iter().enumerate() {
            let mut line = format!("{:<22} {threads:>7}", p.name);
            for (ci, which) in CRATES.iter().enumerate() {
                let mut got = vec![0.0f32; p.m * p.n];
                product(which, p, threads, &a, &b, &mut got);
                // sums of k products of two normals: a rounding error near √k · 2⁻²⁴ · k
                let worst = got
                    .iter()
                    .zip(&want)
                    .fold(0f32, |w, (x, y)| w.max((x - y).abs()));
                if worst > 1e-4 * p.k as f32 {
                    eprintln!("error: {which} gives {} wrong by {worst}", p.name);
                    return ExitCode::FAILURE;
                }
                let times: Vec<f64> = (0..args.runs)
                    .map(|_| {
                        let t = Instant::now();
                        product(which, p, threads, &a, &b, &mut got);
                        t.elapsed().as_secs_f64()
                    })
                    .collect();
                let s = median(times);
                totals[ti][ci] += s;
                let width = if ci == 0 { 15 } else { 8 };
                line += &format!(" {:>width$.1}", flop / s / 1e9);
            }
            println!("{line}");
        }
    }
    for (ti, t) in totals.iter().enumerate() {
        println!(
            "all {} products, {} thread{}: matrixmultiply {:.2} ms, gemm {:.2} ms, faer {:.2} ms",
            products.len(),
            ti + 1,
            if ti == 0 { "" } else { "s" },
            t[0] * 1e3,
            t[1] * 1e3,
            t[2] * 1e3
        );
    }
    ExitCode::SUCCESS
}
