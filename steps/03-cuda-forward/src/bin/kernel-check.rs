//! Compiles every kernel variant with NVRTC for `sm_90` and assembles it with `ptxas -v`,
//! printing registers, shared memory and spills; exits non-zero on a failed compile or any
//! spill. Needs no GPU: CI runs it with NVRTC and ptxas from PyPI.
//!
//! `cargo run -p step03-cuda-forward --bin kernel-check [-- --arch sm_90] [--ptxas PATH]`

use std::process::{Command, ExitCode};

use step03_cuda_forward::kernel::{HEAD_DIMS, compile_forward, nvrtc_present};
use step03_cuda_forward::{Dtype, ForwardConfig};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!(
            "kernel-check [--arch sm_90] [--ptxas PATH] [--verbose]: compile every kernel with NVRTC, assemble with ptxas -v, fail on spills"
        );
        return ExitCode::SUCCESS;
    }
    let arch: &'static str = Box::leak(
        value("--arch")
            .unwrap_or_else(|| "sm_90".into())
            .into_boxed_str(),
    );
    let ptxas = value("--ptxas")
        .or_else(|| std::env::var("PTXAS").ok())
        .unwrap_or_else(|| "ptxas".into());
    if !nvrtc_present() {
        eprintln!(
            "kernel-check: NVRTC (libnvrtc.so) not found; put its lib folder on LD_LIBRARY_PATH"
        );
        return ExitCode::FAILURE;
    }
    let dir = std::env::temp_dir().join(format!("kernel-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    let mut failed = false;
    println!(
        "{:<28} {:>9} {:>12} {:>12} {:>12}",
        "kernel", "registers", "shared (B)", "spill st (B)", "spill ld (B)"
    );
    for dtype in [Dtype::Bf16, Dtype::F16] {
        for head_dim in HEAD_DIMS {
            let name = format!("flash_forward_{}_d{head_dim}", dtype.name());
            let ptx =
                match compile_forward(dtype, head_dim, ForwardConfig::for_head_dim(head_dim), arch)
                {
                    Ok(ptx) => ptx,
                    Err(e) => {
                        eprintln!("{name}: {e}");
                        failed = true;
                        continue;
                    }
                };
            let file = dir.join(format!("{name}.ptx"));
            std::fs::write(&file, ptx.to_src()).expect("writing the PTX");
            let output = match Command::new(&ptxas)
                .args([&format!("-arch={arch}"), "-v", "-o", "/dev/null"])
                .arg(&file)
                .output()
            {
                Ok(o) => o,
                Err(e) => {
                    eprintln!(
                        "kernel-check: cannot run {ptxas}: {e}; give --ptxas PATH or set PTXAS"
                    );
                    return ExitCode::FAILURE;
                }
            };
            let log = String::from_utf8_lossy(&output.stderr).into_owned()
                + &String::from_utf8_lossy(&output.stdout);
            if args.iter().any(|a| a == "--verbose") {
                println!("{log}");
            }
            if !output.status.success() {
                eprintln!("{name}: ptxas failed:\n{log}");
                failed = true;
                continue;
            }
            // ptxas reports "Used 96 registers, used 1 barriers" and "0 bytes spill stores, ...":
            // the number just before each name
            let number_before = |what: &str| {
                log.split([',', '\n'])
                    .find(|part| part.contains(what))
                    .and_then(|part| {
                        part[..part.find(what).unwrap()]
                            .split_whitespace()
                            .rev()
                            .find_map(|w| w.parse::<u64>().ok())
                    })
            };
            let registers = number_before("registers");
            let smem = number_before("smem").unwrap_or(0);
            let spill_stores = number_before("spill stores").unwrap_or(0);
            let spill_loads = number_before("spill loads").unwrap_or(0);
            let Some(registers) = registers else {
                eprintln!("{name}: no register count in ptxas's report:\n{log}");
                failed = true;
                continue;
            };
            println!("{name:<28} {registers:>9} {smem:>12} {spill_stores:>12} {spill_loads:>12}");
            if spill_stores > 0 || spill_loads > 0 {
                eprintln!("{name}: spills registers to local memory");
                failed = true;
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
