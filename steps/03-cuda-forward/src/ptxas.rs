//! What the kernel-check binaries share: compile kernels with NVRTC, assemble the PTX with
//! `ptxas -v`, and read registers, shared memory and spills per entry point off its report.
//! Needs no GPU, so CI runs it with NVRTC and ptxas from NVIDIA's Python wheels.

use std::path::Path;
use std::process::{Command, ExitCode};

use cudarc::nvrtc::Ptx;
use flash_core::AttnError;

use crate::gpu::require_nvrtc;

/// One entry point as ptxas reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub function: String,
    pub registers: u64,
    pub smem_bytes: u64,
    pub spill_stores: u64,
    pub spill_loads: u64,
}

/// Reads every "Compiling entry function" section of a `ptxas -v` log.
pub fn parse(log: &str) -> Vec<Report> {
    log.split("Compiling entry function '")
        .skip(1)
        .filter_map(|section| {
            let function = section.split('\'').next()?.to_string();
            // "Used 96 registers, used 1 barriers, 512 bytes smem" and "0 bytes spill
            // stores": the number just before each name
            let number_before = |what: &str| {
                section
                    .split([',', '\n'])
                    .find(|part| part.contains(what))
                    .and_then(|part| {
                        part[..part.find(what)?]
                            .split_whitespace()
                            .rev()
                            .find_map(|w| w.parse::<u64>().ok())
                    })
            };
            Some(Report {
                function,
                registers: number_before("registers")?,
                smem_bytes: number_before("bytes smem").unwrap_or(0),
                spill_stores: number_before("spill stores").unwrap_or(0),
                spill_loads: number_before("spill loads").unwrap_or(0),
            })
        })
        .collect()
}

fn assemble(ptx: &Ptx, arch: &str, ptxas: &str, file: &Path) -> Result<String, String> {
    std::fs::write(file, ptx.to_src())
        .map_err(|e| format!("writing {}: {e}", file.display()))?;
    let output = Command::new(ptxas)
        .args([&format!("-arch={arch}"), "-v", "-o", "/dev/null"])
        .arg(file)
        .output()
        .map_err(|e| format!("cannot run {ptxas}: {e}; give --ptxas PATH or set PTXAS"))?;
    let log = String::from_utf8_lossy(&output.stderr).into_owned()
        + &String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!("ptxas failed:\n{log}"));
    }
    Ok(log)
}

/// The flags of both kernel-check binaries (each flattens these into its own `Parser`).
#[derive(clap::Args, Debug)]
pub struct Flags {
    /// The GPU architecture to compile and assemble for (NVRTC's and ptxas's `-arch`)
    #[arg(long, default_value = "sm_90")]
    pub arch: String,
    /// The ptxas to run [default: $PTXAS, else `ptxas` on the PATH]
    #[arg(long, value_name = "PATH")]
    pub ptxas: Option<String>,
    /// Also print ptxas's whole report for every kernel
    #[arg(long)]
    pub verbose: bool,
}

/// One kernel variant to check: its name, what NVRTC made of it, and whether a spill fails
/// the check (a variant the library launches) or is only reported (a shape a tuner may
/// time). A launched variant may list the spills it is known to have, each as (entry
/// point, bytes stored, bytes loaded): more than listed fails, and so does a listed spill
/// that is gone (take it off the list), so a list never hides a new spill.
pub struct Variant {
    pub name: String,
    pub ptx: Result<Ptx, AttnError>,
    pub used: bool,
    pub expected_spills: Vec<(&'static str, u64, u64)>,
}

impl Variant {
    /// A variant the library launches: any spill fails the check.
    pub fn used(name: String, ptx: Result<Ptx, AttnError>) -> Variant {
        Variant {
            name,
            ptx,
            used: true,
            expected_spills: Vec::new(),
        }
    }

    /// A shape a tuner may time: it must compile and assemble; a spill is reported.
    pub fn candidate(name: String, ptx: Result<Ptx, AttnError>) -> Variant {
        Variant {
            used: false,
            ..Variant::used(name, ptx)
        }
    }
}

/// `kernels` with the spills `listed` knows of, each as (variant, entry point, bytes stored,
/// bytes loaded), given to the variants of that name; a name the list gives and no variant
/// has fails the check, so the list never outlives the kernels it speaks of.
pub fn with_listed_spills(
    mut kernels: Vec<Variant>,
    listed: &[(&str, &'static str, u64, u64)],
) -> Vec<Variant> {
    for k in &mut kernels {
        k.expected_spills = listed
            .iter()
            .filter(|s| s.0 == k.name)
            .map(|s| (s.1, s.2, s.3))
            .collect();
    }
    for (name, ..) in listed {
        if !kernels.iter().any(|k| k.name == *name) {
            let what =
                "a kernel the list of expected spills names and the check does not compile";
            let ptx = Err(AttnError::Unsupported { what: what.into() });
            kernels.push(Variant::used(name.to_string(), ptx));
        }
    }
    kernels
}

/// What is wrong with an entry point's spills, given what its variant lists: `None` when
/// it spills no more than listed (and some, if anything is listed), or not at all.
fn spill_fault(report: &Report, expected: &[(&'static str, u64, u64)]) -> Option<String> {
    let listed = expected.iter().find(|s| s.0 == report.function);
    let (stores, loads) = listed.map_or((0, 0), |s| (s.1, s.2));
    let (st, ld) = (report.spill_stores, report.spill_loads);
    if st > stores || ld > loads {
        Some(if listed.is_some() {
            format!(
                "spills {st} B stored and {ld} B loaded, more than the {stores} and {loads} listed"
            )
        } else {
            "spills registers to local memory".into()
        })
    } else if listed.is_some() && st == 0 && ld == 0 {
        Some("no longer spills: take it off the list".into())
    } else {
        None
    }
}

/// The whole kernel-check program, once its flags are parsed. `kernels` compiles every
/// variant for an architecture. Prints one line per entry point; fails on a failed compile,
/// a failed assembly, or any spill or serialised `wgmma` in a variant the library launches.
pub fn main(flags: Flags, kernels: impl Fn(&'static str) -> Vec<Variant>) -> ExitCode {
    // the compile functions take the architecture for as long as the program runs
    let arch: &'static str = Box::leak(flags.arch.into_boxed_str());
    let ptxas = flags
        .ptxas
        .or_else(|| std::env::var("PTXAS").ok())
        .unwrap_or_else(|| "ptxas".into());
    if let Err(e) = require_nvrtc() {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    let dir = std::env::temp_dir().join(format!("kernel-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    let mut failed = false;
    println!(
        "{:<52} {:>9} {:>12} {:>12} {:>12}",
        "kernel", "registers", "shared (B)", "spill st (B)", "spill ld (B)"
    );
    for Variant {
        name,
        ptx,
        used,
        expected_spills,
    } in kernels(arch)
    {
        let log = ptx
            .map_err(|e| e.to_string())
            .and_then(|ptx| assemble(&ptx, arch, &ptxas, &dir.join(format!("{name}.ptx"))));
        let log = match log {
            Ok(log) => log,
            Err(e) => {
                eprintln!("{name}: {e}");
                failed = true;
                continue;
            }
        };
        if flags.verbose {
            println!("{log}");
        }
        // ptxas says when it had to serialise asynchronous products (wgmma) for want of
        // registers: the kernel runs, but without the overlap it was written for
        let serialised: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("Performance Loss"))
            .collect();
        for line in &serialised {
            if used {
                eprintln!("{name}: {}", line.trim());
                failed = true;
            } else {
                println!("{name}: {} (a tuning candidate)", line.trim());
            }
        }
        let reports = parse(&log);
        if reports.is_empty() {
            eprintln!("{name}: no entry point in ptxas's report:\n{log}");
            failed = true;
        }
        for (function, ..) in &expected_spills {
            if !reports.iter().any(|r| r.function == *function) {
                eprintln!(
                    "{name}: a spill is listed for {function}, which it does not have"
                );
                failed = true;
            }
        }
        for r in reports {
            let label = format!("{name} {}", r.function);
            println!(
                "{label:<52} {:>9} {:>12} {:>12} {:>12}",
                r.registers, r.smem_bytes, r.spill_stores, r.spill_loads
            );
            match spill_fault(&r, &expected_spills) {
                Some(fault) if used => {
                    eprintln!("{label}: {fault}");
                    failed = true;
                }
                Some(_) => {
                    println!(
                        "{label}: spills (a tuning candidate, not launched by the library)"
                    )
                }
                None if r.spill_stores > 0 || r.spill_loads > 0 => {
                    println!("{label}: spills as listed")
                }
                None => {}
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_every_entry_of_a_ptxas_report() {
        let log = "ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'a' for 'sm_90'
ptxas info    : Function properties for a
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 20 registers, used 0 barriers
ptxas info    : Compiling entry function 'b' for 'sm_90'
ptxas info    : Function properties for b
    8 bytes stack frame, 16 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 33280 bytes smem
";
        let r = parse(log);
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0],
            Report {
                function: "a".into(),
                registers: 20,
                smem_bytes: 0,
                spill_stores: 0,
                spill_loads: 0
            }
        );
        assert_eq!(
            r[1],
            Report {
                function: "b".into(),
                registers: 255,
                smem_bytes: 33280,
                spill_stores: 16,
                spill_loads: 12
            }
        );
    }

    fn report(function: &str, stores: u64, loads: u64) -> Report {
        Report {
            function: function.into(),
            registers: 168,
            smem_bytes: 0,
            spill_stores: stores,
            spill_loads: loads,
        }
    }

    #[test]
    fn a_spill_passes_only_where_it_is_listed_and_no_larger() {
        let listed = [("dkdv", 8, 12)];
        assert_eq!(spill_fault(&report("dkdv", 0, 0), &[]), None);
        assert!(spill_fault(&report("dkdv", 4, 4), &[]).is_some());
        assert_eq!(spill_fault(&report("dkdv", 8, 12), &listed), None);
        assert_eq!(spill_fault(&report("dkdv", 4, 8), &listed), None);
        assert!(spill_fault(&report("dkdv", 8, 16), &listed).is_some());
        assert!(spill_fault(&report("dkdv", 0, 0), &listed).is_some());
        assert!(spill_fault(&report("dq", 4, 4), &listed).is_some());
    }

    #[test]
    fn a_list_gives_its_spills_by_name_and_fails_on_a_name_no_variant_has() {
        let unbuilt = || Err(AttnError::Unsupported { what: "x".into() });
        let kernels = vec![
            Variant::used("a".into(), unbuilt()),
            Variant::used("b".into(), unbuilt()),
        ];
        let listed = [("b", "dkdv", 8, 12), ("gone", "dkdv", 4, 4)];
        let v = with_listed_spills(kernels, &listed);
        assert_eq!(v.len(), 3);
        assert!(v[0].expected_spills.is_empty());
        assert_eq!(v[1].expected_spills, vec![("dkdv", 8, 12)]);
        assert_eq!(v[2].name, "gone");
        assert!(v[2].used && v[2].ptx.is_err());
    }
}
