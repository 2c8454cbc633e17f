//! Compiles every backward kernel the library launches with NVRTC for `sm_90` and assembles
//! it with `ptxas -v`; fails on a failed compile or any spill. Needs no GPU. The kernels of
//! the backward by hand (`kernels/by_hand_backward.cu`) come after the FlashAttention ones,
//! then chapter 4's exercise (`exercises/softmax_backward.cu`, which must compile before a
//! reader fills it in). (The
//! other tile shapes the lab times are compiled by its own check, `lab-kernel-check`.)
//!
//! `cargo run -p step04-backward --bin backward-kernel-check [-- --arch sm_90] [--ptxas
//! PATH]`

use std::process::ExitCode;

use clap::Parser;
use step03_cuda_forward::gpu::{Dtype, compile};
use step03_cuda_forward::ptxas::{self, Variant};
use step04_backward::cuda::{BackwardKernel, HEAD_DIMS};
use step04_backward::cuda_by_hand::ByHandBackwardKernel;

/// Chapter 4's exercise as it stands in the crate's folder: the template, or a reader's
/// kernel.
const SOFTMAX_BACKWARD_EXERCISE: &str = include_str!("../../exercises/softmax_backward.cu");

/// Compiles every backward kernel the library launches (bf16 and f16, every head dim) with
/// NVRTC and assembles it with `ptxas -v`, printing registers, shared memory and spills per
/// kernel.
///
/// Exits non-zero on a failed compile or assembly, or on any spill. Needs NVRTC
/// (libnvrtc.so on LD_LIBRARY_PATH) and ptxas, but no GPU.
#[derive(Parser, Debug)]
#[command(name = "backward-kernel-check")]
struct Args {
    #[command(flatten)]
    flags: ptxas::Flags,
}

fn main() -> ExitCode {
    ptxas::main(Args::parse().flags, |arch| {
        let mut kernels = Vec::new();
        for dtype in [Dtype::Bf16, Dtype::F16] {
            for head_dim in HEAD_DIMS {
                kernels.push(Variant::used(
                    format!("flash_backward_{}_d{head_dim}", dtype.name()),
                    compile(&BackwardKernel::new(dtype, head_dim), arch),
                ));
            }
        }
        for dtype in [Dtype::Bf16, Dtype::F16] {
            kernels.push(Variant::used(
                format!("by_hand_backward_{}", dtype.name()),
                compile(&ByHandBackwardKernel::new(dtype), arch),
            ));
            kernels.push(Variant::used(
                format!("exercise_softmax_backward_{}", dtype.name()),
                compile(
                    &ByHandBackwardKernel {
                        source: SOFTMAX_BACKWARD_EXERCISE,
                        dtype,
                    },
                    arch,
                ),
            ));
        }
        kernels
    })
}
