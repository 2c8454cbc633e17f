//! Compiles every tile shape the lab's tools time (`forward_shapes`, `backward_shapes`)
//! with NVRTC for `sm_90` and assembles it with `ptxas -v`, printing registers, shared
//! memory and spills, so that the lab's candidates cannot rot. Exits non-zero on a failed
//! compile or assembly, or on a spill in a default (the library's own checks compile those
//! too); a candidate's spill is reported. Needs no GPU: CI runs it with NVRTC and ptxas
//! from PyPI, as step 03's `kernel-check`. Shapes that differ only in the heads scheduled
//! together (a launch parameter) are one kernel, compiled once.
//!
//! `cargo run -p flash-lab --bin lab-kernel-check [-- --arch sm_90] [--ptxas PATH]`

use std::process::ExitCode;

use clap::Parser;
use flash_lab::{backward_shapes, forward_shapes};
use step03_cuda_forward::ForwardConfig;
use step03_cuda_forward::gpu::{Dtype, compile};
use step03_cuda_forward::kernel::{ForwardKernel, HEAD_DIMS};
use step03_cuda_forward::ptxas::{self, Variant};
use step04_backward::cuda::{BackwardConfig, BackwardKernel};

/// Compiles every tile shape of the lab's forward and backward candidates (bf16 and f16,
/// every head dim) with NVRTC and assembles it with `ptxas -v`, printing registers, shared
/// memory and spills per kernel.
///
/// Exits non-zero on a failed compile or assembly, or on a spill in a default shape (a
/// candidate's spill is reported). Needs NVRTC (libnvrtc.so on LD_LIBRARY_PATH) and ptxas,
/// but no GPU.
#[derive(Parser, Debug)]
#[command(name = "lab-kernel-check")]
struct Args {
    #[command(flatten)]
    flags: ptxas::Flags,
}

fn main() -> ExitCode {
    ptxas::main(Args::parse().flags, |arch| {
        let mut kernels = Vec::new();
        for dtype in [Dtype::Bf16, Dtype::F16] {
            for head_dim in HEAD_DIMS {
                let name = format!("flash_forward_{}_d{head_dim}", dtype.name());
                let mut compiled = Vec::new();
                for config in forward_shapes::candidates(head_dim) {
                    // the heads scheduled together are a launch parameter: the same kernel
                    let kernel = ForwardConfig {
                        head_group: 0,
                        ..config
                    };
                    if compiled.contains(&kernel) {
                        continue;
                    }
                    compiled.push(kernel);
                    let ptx = compile(&ForwardKernel::new(dtype, head_dim, kernel), arch);
                    let label = kernel.label().replace(' ', "_");
                    kernels.push(if kernel == ForwardConfig::for_head_dim(head_dim) {
                        Variant::used(format!("{name}_{label}"), ptx)
                    } else {
                        Variant::candidate(format!("{name}_{label}"), ptx)
                    });
                }
                let name = format!("flash_backward_{}_d{head_dim}", dtype.name());
                for config in backward_shapes::candidates(head_dim) {
                    let ptx = compile(&BackwardKernel::new(dtype, head_dim, config), arch);
                    let label = config.label().replace([' ', '/'], "_");
                    kernels.push(if config == BackwardConfig::for_head_dim(head_dim) {
                        Variant::used(format!("{name}_{label}"), ptx)
                    } else {
                        Variant::candidate(format!("{name}_{label}"), ptx)
                    });
                }
            }
        }
        kernels
    })
}
