//! Compiles what decoding launches with NVRTC for `sm_90` and assembles it with `ptxas -v`,
//! printing registers, shared memory and spills: `kernels/decode.cu` in bf16 and f16 at
//! every head dim, for one and two tiles of query rows, on a contiguous cache and on pages
//! of 16 and 64 tokens, then `kernels/read.cu`, `kernels/fill.cu` and `kernels/append.cu`.
//! Exits non-zero on a failed compile or any spill. Needs no GPU: CI runs it with NVRTC
//! and ptxas from PyPI, as step 03's `kernel-check`.
//!
//! `cargo run -p step08-inference --bin decode-kernel-check [-- --ptxas PATH]`

use std::process::ExitCode;

use clap::Parser;
use step03_cuda_forward::gpu::{Dtype, KernelSpec, compile};
use step03_cuda_forward::kernel::HEAD_DIMS;
use step03_cuda_forward::ptxas::{self, Variant};
use step08_inference::kernel::{DecodeKernel, READ_KERNEL, append_kernel, fill_kernel};

/// Compiles the decoding kernels (decode.cu, read.cu, fill.cu, append.cu) for
/// every dtype, head dim, tile of query rows and page size the library launches, and
/// assembles each with `ptxas -v`.
///
/// Exits non-zero on a failed compile or assembly, or on any spill. Needs NVRTC
/// (libnvrtc.so on LD_LIBRARY_PATH) and ptxas, but no GPU.
#[derive(Parser, Debug)]
#[command(name = "decode-kernel-check")]
struct Args {
    #[command(flatten)]
    flags: ptxas::Flags,
}

fn main() -> ExitCode {
    ptxas::main(Args::parse().flags, |arch| {
        let mut kernels = Vec::new();
        for dtype in [Dtype::Bf16, Dtype::F16] {
            for head_dim in HEAD_DIMS {
                for rows in [16, 32] {
                    for page_size in [0, 16, 64] {
                        let kernel = DecodeKernel::new(dtype, head_dim, rows, page_size)
                            .expect("a shape the library takes");
                        let name = kernel.name().trim_end_matches(".cu").to_string();
                        kernels.push(Variant::used(name, compile(&kernel, arch)));
                    }
                }
                let tag = format!("{}_d{head_dim}", dtype.name());
                kernels.push(Variant::used(
                    format!("fill_{tag}"),
                    compile(&fill_kernel(dtype, head_dim), arch),
                ));
                kernels.push(Variant::used(
                    format!("append_{tag}"),
                    compile(&append_kernel(dtype, head_dim), arch),
                ));
            }
        }
        kernels.push(Variant::used("read".into(), compile(&READ_KERNEL, arch)));
        kernels
    })
}
