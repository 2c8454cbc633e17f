//! Compiles every tile shape the lab's tools time (`forward_shapes`, `backward_shapes`)
//! with NVRTC for `sm_90` and assembles it with `ptxas -v`, printing registers, shared
//! memory and spills, so that the lab's candidates cannot rot. Exits non-zero on a failed
//! compile or assembly, or on a spill in a default (the library's own checks compile those
//! too); a candidate's spill is reported, and the forward kernel's own shape, as the lab
//! patches it, must give the kernel's own PTX. Needs no GPU: CI runs it with NVRTC and
//! ptxas from PyPI, as step 03's `kernel-check`.
//!
//! `cargo run -p flash-lab --bin lab-kernel-check [-- --arch sm_90] [--ptxas PATH]`

use std::process::ExitCode;

use cudarc::nvrtc::Ptx;

use clap::Parser;
use flash_core::AttnError;
use flash_lab::backward_shapes::{BackwardShape, BackwardShapeKernel};
use flash_lab::forward_shapes::{ForwardShape, ForwardShapeKernel};
use flash_lab::{backward_shapes, forward_shapes};
use step03_cuda_forward::gpu::{Dtype, compile};
use step03_cuda_forward::kernel::{ForwardKernel, HEAD_DIMS};
use step03_cuda_forward::ptxas::{self, Variant};
use step04_backward::cuda::BackwardKernel;

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
                for shape in forward_shapes::candidates(head_dim) {
                    let build = ForwardShapeKernel {
                        dtype,
                        head_dim,
                        shape,
                    };
                    let ptx = compile(&build, arch);
                    let label = shape.label().replace(' ', "_");
                    if shape != ForwardShape::kernel(head_dim) {
                        kernels.push(Variant::candidate(format!("{name}_{label}"), ptx));
                        continue;
                    }
                    let taught = compile(&ForwardKernel::new(dtype, head_dim), arch);
                    kernels.push(Variant::used(
                        format!("{name}_{label}"),
                        same_as_taught(ptx, &taught, "forward_shapes", "flash_forward.cu"),
                    ));
                }
                let name = format!("flash_backward_{}_d{head_dim}", dtype.name());
                for shape in backward_shapes::candidates(head_dim) {
                    let build = BackwardShapeKernel {
                        dtype,
                        head_dim,
                        shape,
                    };
                    let ptx = compile(&build, arch);
                    let label = shape.label().replace([' ', '/'], "_");
                    if shape != BackwardShape::kernels(head_dim) {
                        kernels.push(Variant::candidate(format!("{name}_{label}"), ptx));
                        continue;
                    }
                    let taught = compile(&BackwardKernel::new(dtype, head_dim), arch);
                    kernels.push(Variant::used(
                        format!("{name}_{label}"),
                        same_as_taught(
                            ptx,
                            &taught,
                            "backward_shapes",
                            "flash_backward.cu",
                        ),
                    ));
                }
            }
        }
        kernels
    })
}

/// The lab's build of a kernel's own shape (`ptx`), which must be the kernel (`taught`):
/// else an error saying that the lab's `module` no longer sets what `file` fixes.
fn same_as_taught(
    ptx: Result<Ptx, AttnError>,
    taught: &Result<Ptx, AttnError>,
    module: &str,
    file: &str,
) -> Result<Ptx, AttnError> {
    match (ptx, taught) {
        (Ok(ptx), Ok(taught)) if ptx.to_src() != taught.to_src() => {
            Err(AttnError::Unsupported {
                what: format!(
                    "the lab's build of the kernels' own shape gives other PTX than the kernels: {module} no longer sets what {file} fixes"
                ),
            })
        }
        (ptx, _) => ptx,
    }
}
