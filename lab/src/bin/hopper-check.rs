//! Checks step 06's kernels on the GPU in every block shape the lab compares
//! (`flash_lab::hopper_shapes`) and times them beside steps 03 and 04: each forward rung's
//! error against the f64 reference next to step 03's kernel's on the same inputs, then
//! TFLOP/s of both at 4 × 12 heads; then the same for the backward's rungs beside step 04's
//! kernels (`--forward` or `--backward` for one of them alone, `--head-dim D` for one head
//! dim). It first times a dense bf16 product (cuBLAS, 8192³), the rate the kernels' TFLOP/s
//! are a fraction of. Without a GPU it compiles the forward kernels (NVRTC, `sm_90a`) and,
//! with `--ptx DIR`, writes the PTX for `ptxas -v`.
//!
//! `--only NAMES` keeps the shapes whose names hold one of NAMES (and what the methods
//! launch).
//!
//! `cargo run --release -p flash-lab --bin hopper-check [-- [--forward | --backward]
//! [--head-dim 128] [--only NAMES] [--ptx DIR]]`

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

use flash_core::inputs::random_qkv;
use flash_core::reference::{attention_f64, error};
use flash_core::timing::{Warmup, median_ms};
use flash_core::{AttnError, Shape};
use flash_lab::hopper_shapes::{self, HopperForward};
use step03_cuda_forward::gpu::{Dtype, Gpu, compile};
use step04_backward::cuda as step04;
use step06_hopper::backward;
use step06_hopper::forward;
use step06_hopper::kernel::{
    BackwardKernels, BackwardPass, BackwardRung, ForwardKernel, HEAD_DIMS,
};
use step06_hopper::layout::TmaRank;

/// Checks every Hopper kernel shape against the f64 reference beside steps 03 and 04, then
/// times them at 4 × 12 heads in bf16, after a dense cuBLAS product. Without a GPU it
/// compiles the forward kernels and stops.
#[derive(Parser, Debug)]
#[command(name = "hopper-check")]
struct Args {
    /// The backward's block shapes only
    #[arg(long, conflicts_with = "forward")]
    backward: bool,
    /// The forward's block shapes only
    #[arg(long)]
    forward: bool,
    /// One head dim only, 64 or 128 [default: both]
    #[arg(long, value_parser = head_dim)]
    head_dim: Option<usize>,
    /// Write each forward variant's PTX into DIR (for `ptxas -v`)
    #[arg(long, value_name = "DIR")]
    ptx: Option<PathBuf>,
    /// Only the shapes whose name holds one of these, comma-separated (for example `rung
    /// 4,one pass`; a part of a name matches wherever it appears, and `=NAME` takes that
    /// name alone); what the methods launch is always kept [default: every shape]
    #[arg(long, value_name = "NAMES", value_delimiter = ',')]
    only: Vec<String>,
    /// The lengths to time, comma-separated
    #[arg(
        long,
        value_name = "TOKENS",
        value_delimiter = ',',
        default_value = "1024,2048,4096,8192,16384",
        value_parser = tokens
    )]
    lengths: Vec<usize>,
}

impl Args {
    /// Whether a block shape named `name` is checked and timed.
    fn takes(&self, name: &str) -> bool {
        self.only.is_empty()
            || self.only.iter().any(|o| match o.strip_prefix('=') {
                Some(exact) => name == exact,
                None => name.contains(o.as_str()),
            })
    }

    /// The forward kernels at head dim `d` to check and time.
    fn forward_kernels(&self, d: usize) -> Vec<HopperForward> {
        // at chapter 6's 4 × 12 heads
        let launched = [1, 1 << 14].map(|t| {
            HopperForward::of(ForwardKernel::for_shape(Shape::new(4, 12, t, d), 12))
        });
        hopper_shapes::forward(d)
            .into_iter()
            .filter(|k| launched.contains(k) || self.takes(&k.name()))
            .collect()
    }

    /// The backward's kernels at head dim `d` to check and time.
    fn backward_kernels(&self, d: usize) -> Vec<BackwardKernels> {
        let launched = [1, 1 << 14]
            .map(|t| BackwardKernels::rung(BackwardRung::OnePass, Shape::new(4, 12, t, d)));
        hopper_shapes::backward(d)
            .into_iter()
            .filter(|k| launched.contains(k) || self.takes(&k.name()))
            .collect()
    }
}

fn tokens(s: &str) -> Result<usize, String> {
    s.parse().ok().filter(|&t| t >= 1).ok_or_else(|| {
        format!("`{s}` is not a length: a whole number of tokens, 1 or more")
    })
}

fn head_dim(s: &str) -> Result<usize, String> {
    s.parse()
        .ok()
        .filter(|d| HEAD_DIMS.contains(d))
        .ok_or_else(|| format!("takes one of {:?}", HEAD_DIMS))
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<bool, AttnError> {
    let head_dims = match args.head_dim {
        Some(d) => vec![d],
        None => HEAD_DIMS.to_vec(),
    };
    for dtype in [Dtype::Bf16, Dtype::F16] {
        for &d in &head_dims {
            for kernel in args.forward_kernels(d) {
                let ptx = compile(&kernel.build(dtype, d, TmaRank::Three), "sm_90a")?;
                println!(
                    "hopper_forward {} d{d} {} compiles for sm_90a",
                    dtype.name(),
                    kernel.name()
                );
                if let Some(dir) = &args.ptx {
                    let path = dir.join(format!(
                        "hopper_forward_{}_d{d}_{}.ptx",
                        dtype.name(),
                        kernel.name().replace(' ', "_")
                    ));
                    std::fs::write(&path, ptx.to_src()).map_err(|e| AttnError::Device {
                        what: format!("{}: {e}", path.display()),
                    })?;
                }
            }
        }
    }
    let gpu = match Gpu::shared() {
        Ok(g) => g,
        Err(e) => {
            println!("no run: {e}");
            return Ok(true);
        }
    };
    println!("{}", gpu.describe());
    forward::check_hopper(gpu)?;
    dense_product(gpu)?;
    let mut all = true;
    if !args.backward {
        all &= check_forward(gpu, &head_dims, &args)?;
    }
    if !args.forward {
        all &= check_backward(gpu, &head_dims, &args)?;
    }
    Ok(all)
}

/// The chip's dense bf16 rate as cuBLAS reaches it: an 8192 × 8192 × 8192 product of random
/// values, f32 accumulation, median of 20.
fn dense_product(gpu: &Gpu) -> Result<(), AttnError> {
    use cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N;
    use cudarc::cublas::{GemmConfig, StridedBatchedConfig};
    const N: usize = 8192;
    let shape = Shape::new(1, 1, N, N);
    let [a, b, _] = random_qkv(shape, 3);
    let (a, b) = (
        gpu.upload(a.view(), Dtype::Bf16)?,
        gpu.upload(b.view(), Dtype::Bf16)?,
    );
    let mut c = gpu.upload(ndarray::Array4::zeros((1, 1, N, N)).view(), Dtype::Bf16)?;
    let n = N as i32;
    let cfg = StridedBatchedConfig {
        gemm: GemmConfig {
            transa: CUBLAS_OP_N,
            transb: CUBLAS_OP_N,
            m: n,
            n,
            k: n,
            alpha: half::bf16::ONE,
            lda: n,
            ldb: n,
            beta: half::bf16::ZERO,
            ldc: n,
        },
        batch_size: 1,
        stride_a: 0,
        stride_b: 0,
        stride_c: 0,
    };
    let ms = median_ms(Warmup::Millis(300.0), 20, || {
        gpu.time_ms(|| gpu.gemm(cfg, &a.data, &b.data, &mut c.data))
    })?;
    println!(
        "dense bf16 product (cuBLAS, {N}³): {ms:.3} ms, {:.1} TFLOP/s",
        2.0 * (N as f64).powi(3) / ms / 1e9
    );
    Ok(())
}

fn check_forward(gpu: &Gpu, head_dims: &[usize], args: &Args) -> Result<bool, AttnError> {
    let mut all = true;
    for dtype in [Dtype::Bf16, Dtype::F16] {
        for &d in head_dims {
            for (b, h, t) in [
                (1, 2, 64),
                (1, 2, 128),
                (2, 3, 1000),
                (1, 2, 2048),
                (1, 1, 4096),
            ] {
                for (config, ok, line) in check_shape(
                    gpu,
                    Shape::new(b, h, t, d),
                    dtype,
                    &args.forward_kernels(d),
                )? {
                    println!(
                        "{} {b}x{h}x{t} d{d} {}: {line}",
                        dtype.name(),
                        config.name()
                    );
                    all &= ok;
                }
            }
        }
    }

    // speed, bf16, 4 × 12 heads
    for &d in head_dims {
        println!(
            "\nhead dim {d}\n\n| T | kernel | hopper ms | hopper TFLOP/s | cuda_flash ms | cuda_flash TFLOP/s | ratio |"
        );
        println!("| --- | --- | --- | --- | --- | --- | --- |");
        for &t in &args.lengths {
            let shape = Shape::new(4, 12, t, d);
            let [q, k, v] = random_qkv(shape, 7);
            let up = |x: &ndarray::Array4<f32>| gpu.upload(x.view(), Dtype::Bf16);
            let (q, k, v) = (up(&q)?, up(&k)?, up(&v)?);
            let mut out = gpu.alloc_output(shape, Dtype::Bf16)?;
            let flash = median_ms(Warmup::Millis(300.0), 20, || {
                gpu.time_ms(|| gpu.forward_into(&q, &k, &v, &mut out))
            })?;
            let tf = |ms: f64| shape.forward_flops() / ms / 1e9;
            for config in args.forward_kernels(d) {
                let hopper = median_ms(Warmup::Millis(300.0), 20, || {
                    gpu.time_ms(|| {
                        hopper_shapes::run_forward(gpu, config, &q, &k, &v, &mut out)
                    })
                })?;
                println!(
                    "| {t} | {} | {hopper:.3} | {:.1} | {flash:.3} | {:.1} | {:.2} |",
                    config.name(),
                    tf(hopper),
                    tf(flash),
                    flash / hopper
                );
            }
        }
    }
    Ok(all)
}

fn check_shape(
    gpu: &Gpu,
    shape: Shape,
    dtype: Dtype,
    configs: &[HopperForward],
) -> Result<Vec<(HopperForward, bool, String)>, AttnError> {
    let [q, k, v] = random_qkv(shape, 11);
    let reference = attention_f64(q.view(), k.view(), v.view())?;
    let ours = gpu.attention(q.view(), k.view(), v.view(), dtype)?;
    let up = |x: &ndarray::Array4<f32>| gpu.upload(x.view(), dtype);
    let (dq, dk, dv) = (up(&q)?, up(&k)?, up(&v)?);
    let (e_f, l_f) = (
        error(&ours.out, &reference.out).max_abs,
        error(&ours.lse, &reference.lse).max_abs,
    );
    let mut lines = Vec::new();
    for config in configs.iter().copied() {
        let mut out = gpu.alloc_output(shape, dtype)?;
        hopper_shapes::run_forward(gpu, config, &dq, &dk, &dv, &mut out)?;
        let hopper = gpu.download_attention(&out)?;
        let e_h = error(&hopper.out, &reference.out).max_abs;
        let l_h = error(&hopper.lse, &reference.lse).max_abs;
        let ok = e_h <= (2.0 * e_f).max(1e-3) && l_h <= (2.0 * l_f).max(1e-3);
        lines.push((
            config,
            ok,
            format!(
                "out max |err| {e_h:.2e} (cuda_flash {e_f:.2e}), lse {l_h:.2e} (cuda_flash {l_f:.2e}) {}",
                if ok { "ok" } else { "WRONG" }
            ),
        ));
    }
    Ok(lines)
}

/// The backward's block shapes against the f64 reference beside step 04's kernels, then
/// their speed (the backward alone, after one forward) at 4 × 12 heads in bf16.
fn check_backward(gpu: &Gpu, head_dims: &[usize], args: &Args) -> Result<bool, AttnError> {
    use flash_core::inputs::random_normal;
    use step04_backward::reference::backward_f64;
    let mut all = true;
    for dtype in [Dtype::Bf16, Dtype::F16] {
        for &d in head_dims {
            for (b, h, t) in [(1, 2, 77), (2, 3, 1000), (1, 1, 4097)] {
                let shape = Shape::new(b, h, t, d);
                let [q, k, v] = random_qkv(shape, 12);
                let dout = random_normal(shape, 13);
                let want = backward_f64(q.view(), k.view(), v.view(), dout.view())?;
                let up = |x: &ndarray::Array4<f32>| gpu.upload(x.view(), dtype);
                let (q, k, v, dout) = (up(&q)?, up(&k)?, up(&v)?, up(&dout)?);
                let fwd = gpu.forward(&q, &k, &v)?;
                let errors = |g: &step04::DeviceGrads| -> Result<[f64; 3], AttnError> {
                    let got = [&g.dq, &g.dk, &g.dv].map(|x| gpu.download(x));
                    let want = [&want.dq, &want.dk, &want.dv];
                    let mut e = [0.0; 3];
                    for i in 0..3 {
                        e[i] =
                            error(got[i].as_ref().map_err(Clone::clone)?, want[i]).max_abs;
                    }
                    Ok(e)
                };
                let theirs = errors(&step04::backward(gpu, &q, &k, &v, &fwd, &dout)?)?;
                for configs in args.backward_kernels(d) {
                    let ours = errors(&backward::backward_with(
                        gpu, configs, &q, &k, &v, &fwd, &dout,
                    )?)?;
                    let ok = (0..3).all(|i| ours[i] <= (2.0 * theirs[i]).max(1e-3));
                    all &= ok;
                    if configs.dkdv.pass == BackwardPass::OnePass {
                        // dQ's sums in whatever order the blocks finish: how far two runs
                        // differ
                        let run = || -> Result<ndarray::Array4<f32>, AttnError> {
                            let g = backward::backward_with(
                                gpu, configs, &q, &k, &v, &fwd, &dout,
                            )?;
                            gpu.download(&g.dq)
                        };
                        let (first, again) = (run()?, run()?);
                        let pairs = || first.iter().zip(&again);
                        let differ = pairs().filter(|(x, y)| x != y).count();
                        let most = pairs().fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
                        println!(
                            "{} {b}x{h}x{t} d{d} {}: dq run to run: {differ} of {} values differ, by at most {most:.2e}",
                            dtype.name(),
                            configs.name(),
                            first.len()
                        );
                    }
                    println!(
                        "{} {b}x{h}x{t} d{d} {}: dq/dk/dv max |err| {:.2e} {:.2e} {:.2e} (step 04 {:.2e} {:.2e} {:.2e}) {}",
                        dtype.name(),
                        configs.name(),
                        ours[0],
                        ours[1],
                        ours[2],
                        theirs[0],
                        theirs[1],
                        theirs[2],
                        if ok { "ok" } else { "WRONG" }
                    );
                }
            }
        }
    }
    for &d in head_dims {
        println!(
            "\nbackward, head dim {d}\n\n| T | kernel | hopper ms | hopper TFLOP/s | step 04 ms | step 04 TFLOP/s | ratio |"
        );
        println!("| --- | --- | --- | --- | --- | --- | --- |");
        for &t in &args.lengths {
            let shape = Shape::new(4, 12, t, d);
            let [q, k, v] = random_qkv(shape, 7);
            let dout = random_normal(shape, 8);
            let up = |x: &ndarray::Array4<f32>| gpu.upload(x.view(), Dtype::Bf16);
            let (q, k, v, dout) = (up(&q)?, up(&k)?, up(&v)?, up(&dout)?);
            let fwd = gpu.forward(&q, &k, &v)?;
            let theirs = median_ms(Warmup::Millis(300.0), 20, || {
                gpu.time_ms(|| step04::backward(gpu, &q, &k, &v, &fwd, &dout))
            })?;
            let tf = |ms: f64| shape.backward_flops() / ms / 1e9;
            for configs in args.backward_kernels(d) {
                let ours = median_ms(Warmup::Millis(300.0), 20, || {
                    gpu.time_ms(|| {
                        backward::backward_with(gpu, configs, &q, &k, &v, &fwd, &dout)
                    })
                })?;
                println!(
                    "| {t} | {} | {ours:.3} | {:.1} | {theirs:.3} | {:.1} | {:.2} |",
                    configs.name(),
                    tf(ours),
                    tf(theirs),
                    theirs / ours
                );
            }
        }
    }
    Ok(all)
}
