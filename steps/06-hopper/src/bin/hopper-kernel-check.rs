//! Compiles every kernel this step's methods launch with NVRTC for `sm_90a` and assembles
//! it with `ptxas -v`, printing registers, shared memory and spills; exits non-zero on a
//! failed compile or any spill. Needs no GPU: CI runs it with NVRTC and ptxas from PyPI, as
//! step 03's `kernel-check`.
//!
//! `cargo run -p step06-hopper --bin hopper-kernel-check [-- --ptxas PATH]`

use std::process::ExitCode;

use clap::Parser;
use flash_core::Shape;
use step03_cuda_forward::gpu::{Dtype, compile};
use step03_cuda_forward::ptxas::{self, Variant};
use step06_hopper::kernel::{
    BackwardKernels, BackwardRung, ForwardKernel, ForwardRung, HEAD_DIMS,
};
use step06_hopper::layout::TmaRank;

/// Compiles every forward rung and backward kernel the methods launch, at both head dims,
/// in bf16 and f16, with the tensor maps of [batch, heads, tokens, head_dim] tensors and of
/// any strides (the trainer's), with NVRTC for `sm_90a`, and assembles each with `ptxas
/// -v`.
///
/// Exits non-zero on a failed compile or assembly, or on any spill. Needs NVRTC
/// (libnvrtc.so on LD_LIBRARY_PATH) and ptxas, but no GPU.
#[derive(Parser, Debug)]
#[command(name = "hopper-kernel-check")]
struct Args {
    #[command(flatten)]
    flags: ptxas::Flags,
    /// Only the kernels whose names hold one of these comma-separated strings (for example
    /// "forward_4")
    #[arg(long, value_name = "STRINGS", value_delimiter = ',')]
    only: Vec<String>,
}

/// Lengths on both sides of every threshold at which a method changes its kernels.
const LENGTHS: [usize; 5] = [1, 2049, 4097, 8193, 1 << 14];

fn main() -> ExitCode {
    let Args { mut flags, only } = Args::parse();
    let wanted =
        |name: &str| only.is_empty() || only.iter().any(|s| name.contains(s.as_str()));
    // wgmma and setmaxnreg exist on sm_90a only
    if flags.arch == "sm_90" {
        flags.arch = "sm_90a".into();
    }
    ptxas::main(flags, |arch| {
        let mut kernels = Vec::new();
        for dtype in [Dtype::Bf16, Dtype::F16] {
            for d in HEAD_DIMS {
                let mut forwards: Vec<ForwardKernel> = Vec::new();
                let mut backwards = Vec::new();
                // each kernel in both block orders: which one runs depends on the batch and
                // heads as well (kernel::longest_first)
                for t in LENGTHS {
                    let s = Shape::new(1, 1, t, d);
                    for f in ForwardRung::ALL.map(|r| r.shape(s, 1)) {
                        for f in [f, f.other_order()] {
                            if !forwards.contains(&f) {
                                forwards.push(f);
                            }
                        }
                    }
                    for rung in [BackwardRung::TwoPasses, BackwardRung::OnePass] {
                        let ks = BackwardKernels::rung(rung, s);
                        for k in ks.kernels().chain(ks.other_order().kernels()) {
                            if !backwards.contains(&k) {
                                backwards.push(k);
                            }
                        }
                    }
                }
                for rank in [TmaRank::Three, TmaRank::Four] {
                    let tag = |name: String| {
                        format!(
                            "{}_d{d}_{}_rank{}",
                            dtype.name(),
                            name.replace(' ', "_"),
                            rank.rank()
                        )
                    };
                    for f in &forwards {
                        let name = format!("forward_{}", tag(f.name()));
                        if wanted(&name) {
                            kernels.push(Variant::used(
                                name,
                                compile(&f.build(dtype, d, rank), arch),
                            ));
                        }
                    }
                    for k in &backwards {
                        let name = format!("backward_{}", tag(k.name()));
                        if wanted(&name) {
                            kernels.push(Variant::used(
                                name,
                                compile(&k.build(dtype, d, rank), arch),
                            ));
                        }
                    }
                }
            }
        }
        kernels
    })
}
