//! Runs the `wgmma` probe with candidate descriptor offsets and prints which give the right
//! products. Without a GPU it only compiles the probe (NVRTC, `sm_90a`).
//!
//! `cargo run --release -p flash-lab --bin wgmma-probe`

use std::process::ExitCode;

use flash_lab::probe::{self, Load, Offsets, WgmmaProbe};
use step03_cuda_forward::gpu::{Gpu, compile};

fn main() -> ExitCode {
    let ptx = match compile(&WgmmaProbe, "sm_90a") {
        Ok(ptx) => ptx,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    // `--ptx PATH` writes the PTX, for `ptxas -arch=sm_90a -v PATH`
    let args: Vec<String> = std::env::args().collect();
    if let [_, flag, path] = &args[..]
        && flag == "--ptx"
        && let Err(e) = std::fs::write(path, ptx.to_src())
    {
        eprintln!("error: {path}: {e}");
        return ExitCode::FAILURE;
    }
    println!("wgmma_probe compiles for sm_90a");
    let gpu = match Gpu::shared() {
        Ok(g) => g,
        Err(e) => {
            println!("no run: {e}");
            return ExitCode::SUCCESS;
        }
    };
    println!("{}", gpu.describe());
    let o = |leading, stride| Offsets { leading, stride };
    let qk = [o(16, 1024), o(0, 1024), o(1024, 1024)];
    let v = [
        o(16, 1024),
        o(1024, 16),
        o(1024, 1024),
        o(8192, 1024),
        o(1024, 8192),
        o(2048, 1024),
        o(1024, 2048),
        o(0, 1024),
    ];
    let mut any = false;
    for (load, a, b) in qk
        .iter()
        .flat_map(|&a| v.iter().map(move |&b| (Load::Threads, a, b)))
        .chain([(Load::Tma, qk[0], v[0]), (Load::Tma, qk[0], v[3])])
    {
        {
            match probe::run(gpu, load, a, b) {
                Ok(err) => {
                    let ok = err.s < 1e-3 && err.o < 1e-2;
                    any |= ok;
                    println!(
                        "{:7} | q,k lbo {:5} sbo {:5} | v lbo {:5} sbo {:5} | max |ΔS| {:.2e} max |ΔO| {:.2e} {}",
                        format!("{load:?}"),
                        a.leading,
                        a.stride,
                        b.leading,
                        b.stride,
                        err.s,
                        err.o,
                        if ok { "ok" } else { "wrong" }
                    );
                }
                Err(e) => {
                    println!("{load:?} {a:?} {b:?}: error: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    if any {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
