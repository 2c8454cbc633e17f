//! Compiles every Hopper kernel variant with NVRTC for `sm_90a` and assembles it with
//! `ptxas -v`, printing registers, shared memory and spills; exits non-zero on a failed compile
//! or any spill. Needs no GPU: CI runs it with NVRTC and ptxas from PyPI, as step 03's
//! `kernel-check`.
//!
//! `cargo run -p step06-hopper --bin hopper-kernel-check [-- --ptxas PATH]`

use std::process::ExitCode;

use clap::Parser;
use step03_cuda_forward::Dtype;
use step03_cuda_forward::ptxas::{self, Variant};
use step06_hopper::backward::{self, BackwardConfigs};
use step06_hopper::forward::{self, HopperConfig};
use step06_hopper::layout::TmaRank;
use step06_hopper::probe;

/// Compiles the forward kernel in every block shape and head dim (bf16 and f16) and the `wgmma` probe with
/// NVRTC for `sm_90a`, and assembles each with `ptxas -v`.
///
/// Exits non-zero on a failed compile or assembly, or on any spill. Needs NVRTC (libnvrtc.so
/// on LD_LIBRARY_PATH) and ptxas, but no GPU.
#[derive(Parser, Debug)]
#[command(name = "hopper-kernel-check")]
struct Args {
    #[command(flatten)]
    flags: ptxas::Flags,
    /// Only the variants whose names hold one of these comma-separated strings (for example
    /// "d128_2x2x64+pwg+dqw"), the probe aside
    #[arg(long, value_name = "STRINGS", value_delimiter = ',')]
    only: Vec<String>,
}

fn main() -> ExitCode {
    let Args { mut flags, only } = Args::parse();
    let wanted = |name: &str| only.is_empty() || only.iter().any(|s| name.contains(s.as_str()));
    // wgmma and setmaxnreg exist on sm_90a only
    if flags.arch == "sm_90" {
        flags.arch = "sm_90a".into();
    }
    ptxas::main(flags, |_| {
        let mut kernels = vec![Variant::used("wgmma_probe".to_string(), probe::compile())];
        for dtype in [Dtype::Bf16, Dtype::F16] {
            for d in forward::HEAD_DIMS {
                // every candidate with the maps of [batch, heads, tokens, head_dim] tensors, and
                // the defaults with the maps of any strides (the trainer's)
                let ranks = |default: bool| {
                    if default {
                        &[TmaRank::Three, TmaRank::Four][..]
                    } else {
                        &[TmaRank::Three][..]
                    }
                };
                let picked = [
                    HopperConfig::for_shape(1, d),
                    HopperConfig::for_shape(1 << 14, d),
                ];
                for c in HopperConfig::candidates(d) {
                    for &rank in ranks(picked.contains(&c)) {
                        let name = format!(
                            "hopper_forward_{}_d{d}_{}_rank{}",
                            dtype.name(),
                            c.name(),
                            rank.rank()
                        );
                        if wanted(&name) {
                            let ptx = forward::compile(dtype, d, c, Default::default(), rank);
                            kernels.push(Variant::used(name, ptx));
                        }
                    }
                }
                let defaults = BackwardConfigs::defaults(d);
                for (entry, c) in BackwardConfigs::shapes(d) {
                    let used = defaults.iter().any(|p| c == p.dkdv || c == p.dq);
                    for &rank in ranks(used) {
                        let name = format!(
                            "{entry}_{}_d{d}_{}_rank{}",
                            dtype.name(),
                            c.name(),
                            rank.rank()
                        );
                        if wanted(&name) {
                            let ptx = backward::compile(dtype, d, entry, c, rank);
                            kernels.push(Variant::used(name, ptx));
                        }
                    }
                }
            }
        }
        kernels
    })
}
