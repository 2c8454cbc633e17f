//! Compiles every kernel the library launches with NVRTC for `sm_90` and assembles it with
//! `ptxas -v`, printing registers, shared memory and spills; exits non-zero on a failed
//! compile or any spill. Needs no GPU: CI runs it with NVRTC and ptxas from PyPI. The rungs
//! of the ladder (`ladder.rs`) come first, the step's kernel (rung 5) in the tile shape of
//! each head dim after them, then the exercise's template (`exercises/rows.cu`, which must
//! compile before a reader fills it in). (The other tile shapes the lab times are compiled
//! by its own check, `lab-kernel-check`.)
//!
//! `cargo run -p step03-cuda-forward --bin kernel-check [-- --arch sm_90] [--ptxas PATH]`

use std::process::ExitCode;

use clap::Parser;
use step03_cuda_forward::Rung;
use step03_cuda_forward::gpu::{Dtype, compile};
use step03_cuda_forward::kernel::{
    ForwardKernel, HEAD_DIMS, SoftmaxKernel, TENSOR_CORES_CUH,
};
use step03_cuda_forward::ptxas::{self, Variant};

/// Compiles every kernel the library launches (bf16 and f16, every head dim) with NVRTC and
/// assembles it with `ptxas -v`, printing registers, shared memory and spills per kernel.
///
/// Exits non-zero on a failed compile or assembly, or on any spill. Needs NVRTC
/// (libnvrtc.so on LD_LIBRARY_PATH) and ptxas, but no GPU.
/// Chapter 3's exercise as it stands in the crate's folder: the template, or a reader's
/// kernel.
const ROWS_EXERCISE: &str = include_str!("../../exercises/rows.cu");

#[derive(Parser, Debug)]
#[command(name = "kernel-check")]
struct Args {
    #[command(flatten)]
    flags: ptxas::Flags,
}

fn main() -> ExitCode {
    ptxas::main(Args::parse().flags, |arch| {
        let mut kernels = Vec::new();
        for dtype in [Dtype::Bf16, Dtype::F16] {
            for rung in Rung::ALL.into_iter().filter(|&r| r != Rung::Flash) {
                for &head_dim in rung.head_dims() {
                    kernels.push(Variant::used(
                        format!("rung{}_{}_d{head_dim}", rung.number(), dtype.name()),
                        rung.compile(dtype, head_dim, arch),
                    ));
                }
            }
            for head_dim in HEAD_DIMS {
                kernels.push(Variant::used(
                    format!("flash_forward_{}_d{head_dim}", dtype.name()),
                    compile(&ForwardKernel::new(dtype, head_dim), arch),
                ));
            }
            kernels.push(Variant::used(
                format!("causal_softmax_{}", dtype.name()),
                compile(&SoftmaxKernel { dtype }, arch),
            ));
            let exercise = [TENSOR_CORES_CUH, ROWS_EXERCISE].concat();
            for &head_dim in Rung::Rows.head_dims() {
                kernels.push(Variant::used(
                    format!("exercise_rows_{}_d{head_dim}", dtype.name()),
                    Rung::Rows.compile_source(&exercise, dtype, head_dim, arch),
                ));
            }
        }
        kernels
    })
}
