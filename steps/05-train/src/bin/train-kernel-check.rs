//! Compiles `kernels/train.cu` (every kernel of the GPU trainer besides the attention and
//! the products) with NVRTC for `sm_90` and assembles it with `ptxas -v`; fails on a failed
//! compile or any spill. Needs no GPU.
//!
//! `cargo run -p step05-train --bin train-kernel-check [-- --arch sm_90] [--ptxas PATH]`

use std::process::ExitCode;

use clap::Parser;
use step03_cuda_forward::gpu::compile;
use step03_cuda_forward::ptxas::{self, Variant};
use step05_train::cuda::kernels::TrainKernels;

/// Compiles the GPU trainer's kernels with NVRTC and assembles them with `ptxas -v`,
/// printing registers, shared memory and spills per kernel.
///
/// Exits non-zero on a failed compile or assembly, or on any spill. Needs NVRTC
/// (libnvrtc.so on LD_LIBRARY_PATH) and ptxas, but no GPU.
#[derive(Parser, Debug)]
#[command(name = "train-kernel-check")]
struct Args {
    #[command(flatten)]
    flags: ptxas::Flags,
}

fn main() -> ExitCode {
    ptxas::main(Args::parse().flags, |arch| {
        vec![Variant::used(
            "train".to_string(),
            compile(&TrainKernels, arch),
        )]
    })
}
