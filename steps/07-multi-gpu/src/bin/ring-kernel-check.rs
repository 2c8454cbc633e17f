//! Compiles what the GPU ring launches with NVRTC for `sm_90` and assembles it with `ptxas
//! -v`, printing registers, shared memory and spills: the forward and backward kernels
//! without the causal mask (`CAUSAL=0`, for the blocks wholly in the past), the backward
//! kernels that add into f32 sums (`ACCUMULATE=1`, with and without the mask) and
//! `kernels/ring.cu`, in bf16 and f16 at every head dim. Exits non-zero on a failed compile
//! or any spill but those [`EXPECTED_SPILLS`] lists. Needs no GPU: CI runs it with NVRTC and
//! ptxas from PyPI, as step 03's `kernel-check`.
//!
//! `cargo run -p step07-multi-gpu --bin ring-kernel-check [-- --ptxas PATH]`

use std::process::ExitCode;

use clap::Parser;
use step03_cuda_forward::ForwardConfig;
use step03_cuda_forward::gpu::{Dtype, compile};
use step03_cuda_forward::kernel::{ForwardKernel, HEAD_DIMS};
use step03_cuda_forward::ptxas::{self, Variant};
use step04_backward::cuda::{BackwardConfig, BackwardKernel};
use step07_multi_gpu::gpu::{accumulating_backward, ring_kernel};

/// Compiles the ring's kernels (the unmasked forward and backward, and ring.cu's merge,
/// round and add) in bf16 and f16 at every head dim, and assembles each with `ptxas -v`.
///
/// Exits non-zero on a failed compile or assembly, or on any spill but the few its source
/// lists as expected (EXPECTED_SPILLS). Needs NVRTC (libnvrtc.so on LD_LIBRARY_PATH) and
/// ptxas, but no GPU.
#[derive(Parser, Debug)]
#[command(name = "ring-kernel-check")]
struct Args {
    #[command(flatten)]
    flags: ptxas::Flags,
}

/// The spills ptxas 13.5 (CI's, from NVIDIA's wheels) reports in kernels the ring launches:
/// (variant, entry point, bytes of spill stores, bytes of spill loads). The unmasked
/// backward (`CAUSAL=0`, the blocks wholly in the past) runs dK and dV with the tile shape
/// tuned for the causal one, and at head dim 64 needs a few bytes more than its 255
/// registers; retuning that tile shape for `CAUSAL=0` would empty this list. Each is checked
/// here: a listed variant that spills more, or in another entry point, fails, and so does
/// one that no longer spills (take it off), so the list never hides a new spill.
// one spill a line, in columns
#[rustfmt::skip]
const EXPECTED_SPILLS: &[(&str, &str, u64, u64)] = &[
    ("flash_backward_full_bf16_d64",            "backward_dkdv", 8, 12),
    ("flash_backward_accumulate_full_bf16_d64", "backward_dkdv", 8, 12),
    ("flash_backward_full_f16_d64",             "backward_dkdv", 8, 12),
    ("flash_backward_accumulate_full_f16_d64",  "backward_dkdv", 8, 12),
];

fn main() -> ExitCode {
    let flags = Args::parse().flags;
    // the ptxas that ptxas::main runs, for the variants with listed spills checked here
    let ptxas_path = flags.ptxas.clone().or_else(|| std::env::var("PTXAS").ok());
    let ptxas_path = ptxas_path.unwrap_or_else(|| "ptxas".into());
    let failed = std::cell::Cell::new(false);
    let code = ptxas::main(flags, |arch| {
        let mut kernels = Vec::new();
        for dtype in [Dtype::Bf16, Dtype::F16] {
            for head_dim in HEAD_DIMS {
                let tag = format!("{}_d{head_dim}", dtype.name());
                kernels.push(Variant::used(
                    format!("flash_forward_full_{tag}"),
                    compile(
                        &ForwardKernel {
                            causal: false,
                            ..ForwardKernel::new(
                                dtype,
                                head_dim,
                                ForwardConfig::for_head_dim(head_dim),
                            )
                        },
                        arch,
                    ),
                ));
                let full = BackwardKernel {
                    causal: false,
                    ..BackwardKernel::new(
                        dtype,
                        head_dim,
                        BackwardConfig::for_head_dim(head_dim),
                    )
                };
                let backward = compile(&full, arch);
                let name = format!("flash_backward_full_{tag}");
                kernels.push(Variant::used(name, backward));
                for causal in [true, false] {
                    let what = if causal { "causal" } else { "full" };
                    let name = format!("flash_backward_accumulate_{what}_{tag}");
                    let ptx =
                        compile(&accumulating_backward(dtype, head_dim, causal), arch);
                    kernels.push(Variant::used(name, ptx));
                }
                kernels.push(Variant::used(
                    format!("ring_{tag}"),
                    compile(&ring_kernel(dtype, head_dim), arch),
                ));
            }
        }
        check_expected_spills(kernels, arch, &ptxas_path, &failed)
    });
    if failed.get() {
        ExitCode::FAILURE
    } else {
        code
    }
}

/// Takes the variants [`EXPECTED_SPILLS`] names out of `kernels`, assembles each with
/// `ptxas -v` and holds its report to the list, printing its rows as `ptxas::main` prints
/// the others; sets `failed` on a failed compile or assembly, a spill beyond the list's, a
/// listed spill that is gone, or an entry of the list that names no variant. Returns the
/// other variants, for `ptxas::main`, where any spill fails.
fn check_expected_spills(
    kernels: Vec<Variant>,
    arch: &str,
    ptxas: &str,
    failed: &std::cell::Cell<bool>,
) -> Vec<Variant> {
    let listed = |name: &str| EXPECTED_SPILLS.iter().any(|s| s.0 == name);
    for (name, ..) in EXPECTED_SPILLS {
        if !kernels.iter().any(|k| k.name == *name) {
            eprintln!("EXPECTED_SPILLS names {name}, which this check does not compile");
            failed.set(true);
        }
    }
    let (checked, rest): (Vec<_>, Vec<_>) =
        kernels.into_iter().partition(|k| listed(&k.name));
    for Variant { name, ptx, .. } in checked {
        let log = ptx
            .map_err(|e| e.to_string())
            .and_then(|ptx| assemble(&ptx, arch, ptxas, &name));
        let reports = match log {
            Ok(log) => ptxas::parse(&log),
            Err(e) => {
                eprintln!("{name}: {e}");
                failed.set(true);
                continue;
            }
        };
        for (_, function, ..) in EXPECTED_SPILLS.iter().filter(|s| s.0 == name) {
            if !reports.iter().any(|r| r.function == *function) {
                eprintln!("{name}: no entry point {function} in ptxas's report");
                failed.set(true);
            }
        }
        for r in reports {
            let label = format!("{name} {}", r.function);
            println!(
                "{label:<52} {:>9} {:>12} {:>12} {:>12}",
                r.registers, r.smem_bytes, r.spill_stores, r.spill_loads
            );
            let expected = EXPECTED_SPILLS
                .iter()
                .find(|s| s.0 == name && s.1 == r.function);
            let (stores, loads) = expected.map_or((0, 0), |s| (s.2, s.3));
            if r.spill_stores > stores || r.spill_loads > loads {
                eprintln!(
                    "{label}: spills registers to local memory beyond EXPECTED_SPILLS's \
                     {stores} B stored and {loads} B loaded"
                );
                failed.set(true);
            } else if expected.is_some() && r.spill_stores == 0 && r.spill_loads == 0 {
                eprintln!("{label}: no longer spills: take it off EXPECTED_SPILLS");
                failed.set(true);
            } else if expected.is_some() {
                println!("{label}: spills as EXPECTED_SPILLS lists");
            }
        }
    }
    rest
}

/// `ptxas -v` on `ptx` (written to a temporary file named after the variant): its report.
fn assemble(
    ptx: &step03_cuda_forward::gpu::cudarc::nvrtc::Ptx,
    arch: &str,
    ptxas: &str,
    name: &str,
) -> Result<String, String> {
    let file = std::env::temp_dir().join(format!(
        "ring-kernel-check-{}-{name}.ptx",
        std::process::id()
    ));
    std::fs::write(&file, ptx.to_src())
        .map_err(|e| format!("writing {}: {e}", file.display()))?;
    let output = std::process::Command::new(ptxas)
        .args([&format!("-arch={arch}"), "-v", "-o", "/dev/null"])
        .arg(&file)
        .output();
    std::fs::remove_file(&file).ok();
    let output = output
        .map_err(|e| format!("cannot run {ptxas}: {e}; give --ptxas PATH or set PTXAS"))?;
    let log = String::from_utf8_lossy(&output.stderr).into_owned()
        + &String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!("ptxas failed:\n{log}"));
    }
    Ok(log)
}
