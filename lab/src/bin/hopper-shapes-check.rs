//! Compiles every shape of step 06's kernels that `hopper-check` compares
//! (`flash_lab::hopper_shapes`) with NVRTC for `sm_90a` and assembles it with `ptxas -v`;
//! exits non-zero on a failed compile or a spill in a kernel the methods launch (a spill
//! elsewhere is reported: such a shape loses anyway). No GPU needed; CI runs it, so the
//! lab's shapes cannot rot.
//!
//! `cargo run -p flash-lab --bin hopper-shapes-check [-- --ptxas PATH]`

use std::process::ExitCode;

use clap::Parser;
use flash_core::Shape;
use flash_lab::hopper_shapes::{self, HopperForward};
use step03_cuda_forward::gpu::{Dtype, compile};
use step03_cuda_forward::ptxas::{self, Variant};
use step06_hopper::kernel::{BackwardKernels, BackwardRung, ForwardRung, HEAD_DIMS};
use step06_hopper::layout::TmaRank;

/// Compiles every forward and backward shape `hopper-check` compares, at both head dims, in
/// bf16, with NVRTC for `sm_90a`, and assembles each with `ptxas -v`.
#[derive(Parser, Debug)]
#[command(name = "hopper-shapes-check")]
struct Args {
    #[command(flatten)]
    flags: ptxas::Flags,
}

fn main() -> ExitCode {
    let Args { mut flags } = Args::parse();
    if flags.arch == "sm_90" {
        flags.arch = "sm_90a".into();
    }
    ptxas::main(flags, |arch| {
        let mut kernels = Vec::new();
        for d in HEAD_DIMS {
            let lengths = [1, 4097, 8193, 1 << 14];
            // in both block orders: which one runs depends on the batch and heads as well
            let launched_f: Vec<HopperForward> = lengths
                .iter()
                .flat_map(|&t| ForwardRung::ALL.map(|r| r.shape(Shape::new(1, 1, t, d), 1)))
                .flat_map(|k| [k, k.other_order()].map(HopperForward::of))
                .collect();
            let launched_b: Vec<BackwardKernels> = lengths
                .iter()
                .flat_map(|&t| {
                    [BackwardRung::TwoPasses, BackwardRung::OnePass]
                        .map(|r| BackwardKernels::rung(r, Shape::new(1, 1, t, d)))
                })
                .flat_map(|k| [k, k.other_order()])
                .collect();
            for k in hopper_shapes::forward(d) {
                let name = format!("forward_d{d}_{}", k.name().replace(' ', "_"));
                kernels.push(if launched_f.contains(&k) {
                    // as the step builds it
                    let build = k.kernel.build(Dtype::Bf16, d, TmaRank::Three);
                    Variant::used(name, compile(&build, arch))
                } else {
                    let build = k.build(Dtype::Bf16, d, TmaRank::Three);
                    Variant::candidate(name, compile(&build, arch))
                });
            }
            let mut seen = Vec::new();
            for ks in hopper_shapes::backward(d) {
                let launched = launched_b.contains(&ks);
                for k in ks.kernels() {
                    if seen.contains(&(k, launched)) {
                        continue;
                    }
                    seen.push((k, launched));
                    let name = format!("backward_d{d}_{}", k.name().replace(' ', "_"));
                    let ptx = compile(&k.build(Dtype::Bf16, d, TmaRank::Three), arch);
                    kernels.push(if launched {
                        Variant::used(name, ptx)
                    } else {
                        Variant::candidate(name, ptx)
                    });
                }
            }
        }
        kernels
    })
}
