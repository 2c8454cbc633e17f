//! The command line, parsed by hand: a dozen flags do not need a parser crate's compile time.
//!
//! ## Layout
//!
//! - [`Command`]: the benchmark (no subcommand), `attend`, help, and the hidden child that
//!   measures one peak.
//! - [`parse`]: arguments to a [`Command`], or an error that says what is accepted.
//! - [`HELP`]: the text of `--help`.

use std::path::PathBuf;

use crate::attend::AttendArgs;
use crate::methods::{Device, Dtype};

/// The hidden first argument with which the benchmark runs itself to measure one peak.
pub const PEAK_CHILD: &str = "__measure-peak";

/// What to measure: the benchmark's flags with their defaults filled in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BenchArgs {
    pub device: Device,
    /// Method names; empty means every method of the device.
    pub methods: Vec<String>,
    pub lengths: Vec<usize>,
    pub batch: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub dtype: Dtype,
    pub runs: usize,
    pub backward: bool,
    pub out: Option<PathBuf>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    Help,
    Bench(BenchArgs),
    Attend(AttendArgs),
    /// Run one method once at one length and print the growth of the resident high-water mark.
    PeakChild(BenchArgs),
}

pub const HELP: &str = "\
flash-attention: the causal attention benchmark, and the `attend` command

USAGE
    cargo run --release -- [FLAGS]                    the benchmark
    cargo run --release -- attend [ATTEND FLAGS]      one method on .npy files

BENCHMARK FLAGS
    --device cpu|cuda        where to run (default cpu)
    --methods a,b            methods to run (default: every method of the device)
    --lengths 1024,2048      sequence lengths in tokens
                             (default 1024,2048,4096,8192; on cuda 1024,...,16384)
    --batch N                sequences (default 1; on cuda 4)
    --heads N                heads (default 12)
    --head-dim N             head dim (default 64)
    --dtype f32|bf16|f16     element type (default f32; on cuda bf16); CPU methods take f32
    --runs N                 timed runs after one warm-up; the median is reported (default 5)
    --backward               time forward and backward (pass fwd+bwd) instead of the forward
    --out FILE.json          also write the rows as JSON (charts/data/ feeds the charts)
    -h, --help               this text

    Time is the median of --runs calls after a warm-up, the call alone (inputs are made
    before). Peak memory is measured in a fresh process per method and length: the growth of
    the resident high-water mark over one call, on top of the inputs. A length that does not
    fit in memory is reported as out of memory, and the sweep goes on.

ATTEND FLAGS
    --method NAME            the method to run
    --q FILE --k FILE --v FILE
                             float32 .npy arrays of shape [batch, heads, tokens, head_dim]
    --dout FILE              optional: the output's gradient; also writes dq, dk, dv
    --out-dir DIR            where to write out.npy, lse.npy (and dq.npy, dk.npy, dv.npy)

EXAMPLES
    cargo run --release
    cargo run --release -- --methods naive --lengths 512,1024 --runs 3
    cargo run --release -- --out charts/data/cpu.json && cargo run -p charts
    cargo run --release -- --device cuda --backward --out charts/data/gpu-fwd-bwd.json
    cargo run --release -- attend --method naive --q q.npy --k k.npy --v v.npy --out-dir out/
";

const BENCH_FLAGS: &str = "--device, --methods, --lengths, --batch, --heads, --head-dim, \
                           --dtype, --runs, --backward, --out, --help";
const ATTEND_FLAGS: &str = "--method, --q, --k, --v, --dout, --out-dir";

/// Splits `--flag value` and `--flag=value` into (flag, value) pairs; flags without values
/// (`--backward`, `--help`) get `None`.
fn pairs(args: &[String], switches: &[&str]) -> Result<Vec<(String, Option<String>)>, String> {
    let mut out = Vec::new();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        if !arg.starts_with('-') {
            return Err(format!("unexpected argument {arg:?}: flags start with --"));
        }
        if let Some((flag, value)) = arg.split_once('=') {
            out.push((flag.to_string(), Some(value.to_string())));
        } else if switches.contains(&arg.as_str()) {
            out.push((arg.clone(), None));
        } else {
            let value = it
                .next()
                .ok_or_else(|| format!("{arg} needs a value"))?
                .clone();
            out.push((arg.clone(), Some(value)));
        }
    }
    Ok(out)
}

fn count(flag: &str, value: &str) -> Result<usize, String> {
    match value.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!(
            "{flag} takes a whole number of at least 1, not {value:?}"
        )),
    }
}

fn list(value: &str) -> impl Iterator<Item = &str> {
    value.split(',').map(str::trim).filter(|s| !s.is_empty())
}

/// Parses the arguments after the program's name.
pub fn parse(args: &[String]) -> Result<Command, String> {
    match args.first().map(String::as_str) {
        Some("attend") => parse_attend(&args[1..]),
        Some(PEAK_CHILD) => parse_bench(&args[1..]).map(|c| match c {
            Command::Bench(b) => Command::PeakChild(b),
            other => other,
        }),
        _ => parse_bench(args),
    }
}

fn parse_bench(args: &[String]) -> Result<Command, String> {
    let mut device = Device::Cpu;
    let (mut methods, mut lengths, mut batch, mut dtype) = (Vec::new(), None, None, None);
    let (mut heads, mut head_dim, mut runs, mut backward, mut out) = (12, 64, 5, false, None);
    for (flag, value) in pairs(args, &["--backward", "--help", "-h"])? {
        let value = value.unwrap_or_default();
        match flag.as_str() {
            "--help" | "-h" => return Ok(Command::Help),
            "--backward" => backward = true,
            "--device" => {
                device = match value.as_str() {
                    "cpu" => Device::Cpu,
                    "cuda" => Device::Cuda,
                    _ => return Err(format!("--device takes cpu or cuda, not {value:?}")),
                }
            }
            "--methods" => methods = list(&value).map(String::from).collect(),
            "--lengths" => {
                lengths = Some(
                    list(&value)
                        .map(|t| count("--lengths", t))
                        .collect::<Result<Vec<_>, _>>()?,
                )
            }
            "--batch" => batch = Some(count(&flag, &value)?),
            "--heads" => heads = count(&flag, &value)?,
            "--head-dim" => head_dim = count(&flag, &value)?,
            "--dtype" => dtype = Some(Dtype::parse(&value)?),
            "--runs" => runs = count(&flag, &value)?,
            "--out" => out = Some(PathBuf::from(value)),
            "--method" | "--q" | "--out-dir" => {
                return Err(format!(
                    "{flag} belongs to the attend command: `attend {flag} ...`"
                ));
            }
            _ => {
                return Err(format!(
                    "unknown flag {flag}; the benchmark takes {BENCH_FLAGS}"
                ));
            }
        }
    }
    let cuda = device == Device::Cuda;
    let lengths = lengths.unwrap_or_else(|| {
        let top = if cuda { 16384 } else { 8192 };
        (10..).map(|p| 1 << p).take_while(|&t| t <= top).collect()
    });
    if lengths.is_empty() {
        return Err("--lengths takes a comma-separated list such as 1024,2048".into());
    }
    Ok(Command::Bench(BenchArgs {
        device,
        methods,
        lengths,
        batch: batch.unwrap_or(if cuda { 4 } else { 1 }),
        heads,
        head_dim,
        dtype: dtype.unwrap_or(if cuda { Dtype::Bf16 } else { Dtype::F32 }),
        runs,
        backward,
        out,
    }))
}

fn parse_attend(args: &[String]) -> Result<Command, String> {
    let (mut method, mut q, mut k, mut v, mut dout, mut out_dir) =
        (None, None, None, None, None, None);
    for (flag, value) in pairs(args, &["--help", "-h"])? {
        let path = value.clone().map(PathBuf::from);
        match flag.as_str() {
            "--help" | "-h" => return Ok(Command::Help),
            "--method" => method = value,
            "--q" => q = path,
            "--k" => k = path,
            "--v" => v = path,
            "--dout" => dout = path,
            "--out-dir" => out_dir = path,
            _ => return Err(format!("unknown flag {flag}; attend takes {ATTEND_FLAGS}")),
        }
    }
    let need = |x: Option<PathBuf>, flag: &str| {
        x.ok_or_else(|| format!("attend needs {flag}; it takes {ATTEND_FLAGS}"))
    };
    Ok(Command::Attend(AttendArgs {
        method: method.ok_or_else(|| format!("attend needs --method; it takes {ATTEND_FLAGS}"))?,
        q: need(q, "--q FILE.npy")?,
        k: need(k, "--k FILE.npy")?,
        v: need(v, "--v FILE.npy")?,
        dout,
        out_dir: need(out_dir, "--out-dir DIR")?,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    fn bench(s: &str) -> BenchArgs {
        match parse(&args(s)).unwrap() {
            Command::Bench(b) => b,
            other => panic!("{s}: {other:?}"),
        }
    }

    #[test]
    fn defaults_follow_the_device() {
        let cpu = bench("");
        assert_eq!(cpu.lengths, [1024, 2048, 4096, 8192]);
        assert_eq!(
            (cpu.batch, cpu.heads, cpu.head_dim, cpu.runs),
            (1, 12, 64, 5)
        );
        assert_eq!(cpu.dtype, Dtype::F32);
        let gpu = bench("--device cuda");
        assert_eq!(gpu.lengths, [1024, 2048, 4096, 8192, 16384]);
        assert_eq!((gpu.batch, gpu.dtype), (4, Dtype::Bf16));
    }

    #[test]
    fn flags_take_both_spellings() {
        let b = bench(
            "--methods naive,x --lengths=16,32 --batch 2 --head-dim=8 --runs 1 --backward --out a.json",
        );
        assert_eq!(b.methods, ["naive", "x"]);
        assert_eq!(b.lengths, [16, 32]);
        assert_eq!((b.batch, b.head_dim, b.runs, b.backward), (2, 8, 1, true));
        assert_eq!(b.out, Some(PathBuf::from("a.json")));
        assert_eq!(parse(&args("attend --help")).unwrap(), Command::Help);
        assert!(matches!(
            parse(&args("__measure-peak --lengths 8")).unwrap(),
            Command::PeakChild(_)
        ));
    }

    #[test]
    fn bad_flags_say_what_is_accepted() {
        for (line, says) in [
            ("--device tpu", "cpu or cuda"),
            ("--dtype f64", "f32, bf16, f16"),
            ("--runs 0", "at least 1"),
            ("--lengths 1k", "whole number"),
            ("--frobnicate 3", "--lengths"),
            ("--heads", "needs a value"),
            ("attend --method naive --q q.npy", "--k"),
            ("attend --bogus x", "--out-dir"),
        ] {
            let err = parse(&args(line)).unwrap_err();
            assert!(err.contains(says), "{line}: {err}");
        }
    }
}
