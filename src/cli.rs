//! The command line, parsed by clap: the benchmark (no subcommand), `attend`, and the
//! hidden child that measures one peak. Every argument error, whether clap finds it or a
//! check after it does, prints in clap's style and exits with status 2 ([`EXIT_USAGE`]).
//!
//! ## Layout
//!
//! - [`Cli`]: the flags as clap reads them.
//! - [`parse`]: arguments to a [`Command`], every flag checked and every name resolved
//!   ([`methods::resolve`]) before any work: the commands are given what was resolved.
//! - [`BenchArgs`]: the benchmark's flags with their defaults filled in.

use std::path::PathBuf;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, Subcommand};
use flash_core::Pass;
use flash_core::check::at_least_one;
use flash_core::row::RowsFile;

use crate::attend::AttendArgs;
use crate::methods::{self, Describe, Device, Dtype, Entry, Method};

/// The hidden subcommand with which the benchmark runs itself to measure one peak.
pub const PEAK_CHILD: &str = "__measure-peak";

/// Exit status of an argument error.
pub const EXIT_USAGE: u8 = 2;

const EXAMPLES: &str = "\
EXIT STATUS
    0  every row was measured       2  bad arguments
    1  nothing ran (an error before the sweep, or writing --out failed)
    3  some rows could not run (out of memory, an unsupported shape, a device error)
    4  a method's result was wrong: the check before timing failed
  130  stopped by Ctrl-C: --out unchanged, the rows so far in FILE.partial.json

EXAMPLES
    cargo run --release
    cargo run --release -- --methods naive --lengths 512,1024 --runs 3
    cargo run --release -- --out charts/data/cpu.json && cargo run -p charts
    cargo run --release -- attend --method naive --q q.npy --k k.npy --v v.npy --out-dir out/";

/// The causal attention benchmark: every chosen method at every length, time and peak
/// memory, each result checked against the f64 reference before it is timed.
#[derive(Parser, Debug)]
#[command(
    name = "flash-attention",
    args_conflicts_with_subcommands = true,
    after_help = EXAMPLES,
    long_about = "The causal attention benchmark: every chosen method at every length, each result \
checked against the f64 reference before it is timed.\n\nTime is the median of --runs calls after \
a warm-up, the call alone (inputs are made before). Peak memory is measured in a fresh process per \
method and length: the growth of the resident high-water mark over one call, on top of the inputs. \
A length that does not fit in memory is reported as out of memory, and the sweep goes on.\n\n\
attend refuses inputs holding a NaN or an infinity, naming the tensor and the first such \
position: a block-wise method would spread one to rows that cannot see it."
)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Sub>,
    #[command(flatten)]
    bench: BenchFlags,
}

#[derive(Subcommand, Debug)]
enum Sub {
    /// Run one method on q, k, v from .npy files and write out.npy and lse.npy
    // clap joins a paragraph's lines with a space: the text reads whole with or without
    // step 04's words
    // [step 04]
    /// (and, with --dout, dq.npy, dk.npy, dv.npy),
    // [/step 04]
    /// to check it against any framework.
    Attend(AttendFlags),
    #[command(name = PEAK_CHILD, hide = true)]
    PeakChild(BenchFlags),
}

#[derive(clap::Args, Debug, Clone)]
struct BenchFlags {
    /// Where to run: cpu, or cuda once step 03 is there
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    device: Device,
    /// Methods to run, separated by commas (default: every method of the device); the list
    /// is under METHODS below
    #[arg(long, value_delimiter = ',', value_parser = non_empty)]
    methods: Vec<String>,
    /// Sequence lengths in tokens [default: 1024,2048,4096,8192; on cuda up to 16384]
    #[arg(long, value_delimiter = ',', value_parser = at_least_one, allow_negative_numbers = true)]
    lengths: Vec<usize>,
    /// Sequences [default: 1; on cuda 4]
    #[arg(long, allow_negative_numbers = true, value_parser = at_least_one)]
    batch: Option<usize>,
    /// Heads
    #[arg(long, default_value_t = 12, allow_negative_numbers = true, value_parser = at_least_one)]
    heads: usize,
    /// Head dim
    #[arg(long, default_value_t = 64, allow_negative_numbers = true, value_parser = at_least_one)]
    head_dim: usize,
    /// Element type; the CPU methods take f32 [default: f32; on cuda bf16]
    #[arg(long, value_parser = parse_dtype)]
    dtype: Option<Dtype>,
    /// Timed runs after the warm-up; the median is reported
    #[arg(long, default_value_t = 5, allow_negative_numbers = true, value_parser = at_least_one)]
    runs: usize,
    // [step 04]
    /// Time the forward and the backward together (pass fwd+bwd) instead of the forward
    #[arg(long)]
    backward: bool,
    // [/step 04]
    // [step 07]
    /// GPUs to spread each call over, for a method that can (cuda_ring); the others take 1
    /// [default: 1]
    #[arg(long, default_value_t = 1, hide_default_value = true, allow_negative_numbers = true, value_parser = at_least_one)]
    gpus: usize,
    // [/step 07]
    // [step 09]
    /// Time step 09's masked attention on the CPU with this mask and score function, as
    /// attend --mask takes them (sliding:1024, documents:FILE, prefix:1024, softcap:30...),
    /// one row a length named masked, in the place of the CPU methods; its result is
    /// checked against step 09's f64 reference first, the row gives the mask's density (the
    /// fraction of scores it keeps), and GFLOP/s count only the scores kept
    #[arg(long, value_name = "SPEC", value_parser = parse_mask)]
    mask: Option<String>,
    // [/step 09]
    /// Also write the rows as JSON (charts/data/ feeds the charts): checked before any
    /// work, written whole at the end (over an earlier file only if a row was measured);
    /// meanwhile the rows so far are kept in FILE.partial.json
    #[arg(long, value_name = "FILE.json")]
    out: Option<PathBuf>,
}

#[derive(clap::Args, Debug, Clone)]
struct AttendFlags {
    /// The method to run (the list is in the benchmark's --help)
    #[arg(long)]
    method: String,
    /// q: a float32 .npy array [batch, heads, tokens, head_dim]
    #[arg(long, value_name = "FILE.npy")]
    q: PathBuf,
    /// k, of q's shape
    #[arg(long, value_name = "FILE.npy")]
    k: PathBuf,
    /// v, of q's shape
    #[arg(long, value_name = "FILE.npy")]
    v: PathBuf,
    // [step 03]
    /// Element type of a GPU method: bf16 or f16; the CPU methods take f32 [default: f32;
    /// for a GPU method bf16]
    #[arg(long, value_parser = parse_dtype)]
    dtype: Option<Dtype>,
    // [/step 03]
    // [step 04]
    /// The output's gradient, of q's shape: asks for the backward too (dq, dk, dv)
    #[arg(long, value_name = "FILE.npy")]
    dout: Option<PathBuf>,
    // [/step 04]
    // [step 09]
    #[arg(long, value_name = "SPEC", help = mask_help(), value_parser = parse_mask)]
    mask: Option<String>,
    // [/step 09]
    /// Where to write the results
    #[arg(long, value_name = "DIR")]
    out_dir: PathBuf,
}

// [step 09]
/// `--mask`'s line in `attend --help`: what it does, and the terms step 09's parser accepts,
/// from the parser's own list.
fn mask_help() -> String {
    format!(
        "A mask and a score function (step 09): step 09's masked attention runs in the \
         method's place on its device (the CPU's blockwise forward and backward, or the GPU's \
         kernels: step 06's on a Hopper, steps 03's and 04's on other GPUs from Ampere), and \
         k and v may have more tokens than q (q's rows are the last positions) and fewer \
         heads (grouped-query attention); {}",
        step09_masks::mask::ACCEPTED
    )
}

/// The refusal of `--mask` with a decoder, from [`parse`] and from `attend` alike.
pub fn masked_decoder(name: &str) -> String {
    format!(
        "--mask: {name:?} is a decoder, query rows against a cache with the causal diagonal \
         built in, and takes no mask; a mask runs with a method in its place (naive on the \
         CPU, cuda_hopper on the GPU)"
    )
}

/// `--mask` checked where it is given, by step 09's one parser; the text is kept for
/// `attend`, which resolves it against the inputs' shape (and reads a documents file).
fn parse_mask(s: &str) -> Result<String, String> {
    step09_masks::MaskSpec::parse(s)
        .map(|_| s.to_string())
        .map_err(|e| e.to_string())
}

/// The benchmark's `--mask`: step 09's masked attention runs on the CPU in the place of the
/// CPU methods, so a GPU or a decoder is refused; the mask and the score function are
/// resolved and checked at every length before any work (a documents file must add up to
/// each length, a mask from a `.cu` file has no CPU twin).
fn check_bench_mask(
    text: &str,
    names: &[String],
    args: &BenchArgs,
) -> Result<step09_masks::MaskSpec, String> {
    let on_cpu = "the benchmark's masked attention runs on the CPU (step 09's blockwise \
                  forward and backward); on a GPU, step 09's mask-bench measures the masked \
                  kernels (cargo run --release -p step09-masks --bin mask-bench)";
    if args.device != Device::Cpu {
        return Err(format!(
            "--mask with --device {}: {on_cpu}",
            args.device.name()
        ));
    }
    for name in names {
        match methods::resolve(name)? {
            Entry::Decoder(d) => return Err(masked_decoder(d.name())),
            Entry::Method(m) if m.device() != Device::Cpu => {
                return Err(format!(
                    "--mask: method {name:?} runs on {}; {on_cpu}",
                    m.device().name()
                ));
            }
            Entry::Method(_) => {}
        }
    }
    let spec = step09_masks::MaskSpec::parse(text).map_err(|e| e.to_string())?;
    for &tokens in &args.lengths {
        let (mask, score) = spec
            .resolve(args.batch, args.heads, tokens)
            .map_err(|e| format!("{e} (at --lengths {tokens})"))?;
        mask.check(args.batch, tokens)
            .and_then(|()| score.check(args.heads))
            .map_err(|e| format!("--mask {text:?} at --lengths {tokens}: {e}"))?;
    }
    Ok(spec)
}
// [/step 09]

fn parse_device(s: &str) -> Result<Device, String> {
    Device::ALL
        .iter()
        .find(|d| d.name() == s)
        .copied()
        .ok_or_else(|| format!("accepted: {}", names(Device::ALL.iter().map(|d| d.name()))))
}

fn parse_dtype(s: &str) -> Result<Dtype, String> {
    Dtype::ALL
        .iter()
        .find(|d| d.name() == s)
        .copied()
        .ok_or_else(|| format!("accepted: {}", names(Dtype::ALL.iter().map(|d| d.name()))))
}

fn non_empty(s: &str) -> Result<String, String> {
    match s.trim() {
        "" => Err("a method name; the list is under METHODS in --help".into()),
        name => Ok(name.to_string()),
    }
}

fn names<'a>(xs: impl Iterator<Item = &'a str>) -> String {
    xs.collect::<Vec<_>>().join(", ")
}

/// What to measure: the benchmark's flags with their defaults filled in, and the methods
/// they choose.
#[derive(Clone, Debug)]
pub struct BenchArgs {
    pub device: Device,
    /// The methods to run, resolved from `--methods` once ([`parse`]) and checked against
    /// the device, the dtype, the pass and the GPUs; without `--methods`, every method of
    /// the device that can run what the flags ask for.
    pub methods: Vec<&'static dyn Method>,
    /// Without `--methods`: the device's methods that were not chosen, which the sweep's
    /// header names.
    pub left_out: Vec<&'static str>,
    pub lengths: Vec<usize>,
    pub batch: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub dtype: Dtype,
    pub runs: usize,
    // [step 04]
    pub backward: bool,
    // [/step 04]
    pub gpus: usize, // [step 07]
    // [step 09]
    /// `--mask`, parsed: step 09's masked attention runs on the CPU in the methods' place,
    /// checked against each length before any work.
    pub mask: Option<step09_masks::MaskSpec>,
    // [/step 09]
    pub out: Option<PathBuf>,
}

impl BenchArgs {
    /// The pass the flags ask for.
    pub fn pass(&self) -> Pass {
        // [step 04]
        if self.backward {
            return Pass::ForwardBackward;
        }
        // [/step 04]
        Pass::Forward
    }
}

#[derive(Clone, Debug)]
pub enum Command {
    Bench(BenchArgs),
    Attend(AttendArgs),
    /// Run one method once at one length and print the growth of the resident high-water
    /// mark.
    PeakChild(BenchArgs),
}

/// Every entry of the registry with its device and step, for the end of `--help`: a
/// heading for each kind of entry, then its lines.
fn method_list() -> String {
    let mut text = String::new();
    let mut section = "";
    for entry in methods::entries() {
        let (heading, width) = match entry {
            Entry::Method(_) => ("METHODS\n", 14),
            // [step 08]
            Entry::Decoder(_) => (
                "\nDECODERS (attend only: q [batch, q_heads, q_rows, head_dim] against k and v\n\
                 [batch, kv_heads, context, head_dim], q_rows <= context, q_heads a multiple of\n\
                 kv_heads, the causal diagonal at the cache's end)\n",
                18,
            ),
            // [/step 08]
        };
        if heading != section {
            section = heading;
            text += heading;
        }
        let d = entry.descriptor();
        text += &format!(
            "    {:<width$} {:<5} step {}: {}\n",
            d.name,
            d.device.name(),
            d.step,
            d.about
        );
    }
    text
}

/// The clap command with the method list appended to its help.
pub fn command() -> clap::Command {
    Cli::command()
        .before_long_help(method_list())
        .after_long_help(format!("{}\n\n{EXAMPLES}", method_list()))
}

/// Parses the arguments (the program's name first) and checks every flag that can be
/// checked before any work; on an error, returns clap's error, which prints itself and
/// knows its exit status.
pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Command, clap::Error> {
    let mut cmd = command();
    let matches = cmd.try_get_matches_from_mut(args)?;
    let cli = <Cli as clap::FromArgMatches>::from_arg_matches(&matches)
        .map_err(|e| e.format(&mut cmd))?;
    let invalid =
        |cmd: &mut clap::Command, why: String| cmd.error(ErrorKind::ValueValidation, why);
    match cli.command {
        Some(Sub::Attend(a)) => {
            let args = attend_args(a).map_err(|why| invalid(&mut cmd, why))?;
            // [step 09]
            if let (Some(_), Entry::Decoder(d)) = (&args.mask, args.method) {
                return Err(invalid(&mut cmd, masked_decoder(d.name())));
            }
            // [/step 09]
            // [step 03]
            if let Some(dtype) = args.dtype {
                crate::attend::check_dtype(args.method, dtype)
                    .map_err(|e| invalid(&mut cmd, e))?;
            }
            // [/step 03]
            Ok(Command::Attend(args))
        }
        Some(Sub::PeakChild(b)) => {
            let args = bench_args(b).map_err(|why| invalid(&mut cmd, why))?;
            Ok(Command::PeakChild(args))
        }
        None => {
            let args = bench_args(cli.bench).map_err(|why| invalid(&mut cmd, why))?;
            for &tokens in &args.lengths {
                let shape =
                    flash_core::Shape::new(args.batch, args.heads, tokens, args.head_dim);
                shape
                    .checked_len()
                    .map_err(|e| invalid(&mut cmd, e.to_string()))?;
            }
            if let Some(out) = &args.out {
                RowsFile::check("--out", out)
                    .map_err(|e| invalid(&mut cmd, e.to_string()))?;
            }
            Ok(Command::Bench(args))
        }
    }
}

/// The methods the flags choose, each of `names` resolved once and checked against the
/// device, the dtype and the pass: an unknown name, a decoder, or a method of another
/// device, is an argument error.
fn choose(names: &[String], args: &BenchArgs) -> Result<Vec<&'static dyn Method>, String> {
    let of_device: Vec<&dyn Method> = methods::all()
        .into_iter()
        .filter(|m| m.device() == args.device)
        .collect();
    let listed =
        |ms: &[&dyn Method]| ms.iter().map(|m| m.name()).collect::<Vec<_>>().join(", ");
    let chosen: Vec<&dyn Method> = if names.is_empty() {
        of_device.clone()
    } else {
        let mut chosen = Vec::new();
        for name in names {
            match methods::resolve(name)? {
                // [step 08]
                Entry::Decoder(_) => {
                    return Err(format!(
                        "{name:?} is a decoder, query rows against a cache: `attend --method \
                         {name}` runs it, and step 08's decode-cpu and decode-bench measure it"
                    ));
                }
                // [/step 08]
                Entry::Method(m) if m.device() != args.device => {
                    return Err(format!(
                        "method {name:?} runs on {}, not {}; the {} methods are: {}",
                        m.device().name(),
                        args.device.name(),
                        args.device.name(),
                        listed(&of_device)
                    ));
                }
                Entry::Method(m) => chosen.push(m),
            }
        }
        chosen
    };
    if args.device == Device::Cpu && args.dtype != Dtype::F32 {
        return Err(format!(
            "--dtype {}: the CPU methods compute in f32; bf16 and f16 are for --device cuda",
            args.dtype
        ));
    }
    // [step 04]
    if args.backward {
        let without: Vec<&str> = chosen
            .iter()
            .filter(|m| !m.has_backward())
            .map(|m| m.name())
            .collect();
        let with: Vec<&dyn Method> = of_device
            .iter()
            .filter(|m| m.has_backward())
            .copied()
            .collect();
        if !without.is_empty() {
            if names.is_empty() {
                return Ok(with);
            }
            return Err(format!(
                "--backward: {} has no backward pass; the methods with one are: {}",
                without.join(", "),
                listed(&with)
            ));
        }
    }
    // [/step 04]
    // [step 07]
    if args.gpus > 1 {
        if args.device == Device::Cpu {
            return Err(format!(
                "--gpus {}: spreading a call over GPUs needs --device cuda",
                args.gpus
            ));
        }
        let single: Vec<&str> = chosen
            .iter()
            .filter(|m| !m.multi_gpu())
            .map(|m| m.name())
            .collect();
        let multi: Vec<&dyn Method> =
            chosen.iter().filter(|m| m.multi_gpu()).copied().collect();
        if !single.is_empty() {
            if names.is_empty() {
                return Ok(multi);
            }
            let all: Vec<&dyn Method> = of_device
                .iter()
                .filter(|m| m.multi_gpu())
                .copied()
                .collect();
            return Err(format!(
                "--gpus {}: {} runs on one GPU; the methods that spread over several are: {}",
                args.gpus,
                single.join(", "),
                listed(&all)
            ));
        }
    }
    // [/step 07]
    Ok(chosen)
}

/// `attend`'s flags, the method's name resolved once ([`methods::resolve`]).
fn attend_args(a: AttendFlags) -> Result<AttendArgs, String> {
    Ok(AttendArgs {
        method: methods::resolve(&a.method).map_err(|e| format!("--method: {e}"))?,
        q: a.q,
        k: a.k,
        v: a.v,
        // [step 03]
        dtype: a.dtype,
        // [/step 03]
        // [step 04]
        dout: a.dout,
        // [/step 04]
        mask: a.mask, // [step 09]
        out_dir: a.out_dir,
    })
}

/// The benchmark's flags with their defaults filled in, and the methods they choose
/// ([`choose`]).
fn bench_args(b: BenchFlags) -> Result<BenchArgs, String> {
    let cuda = b.device != Device::Cpu;
    let lengths = if b.lengths.is_empty() {
        let top = if cuda { 16384 } else { 8192 };
        (10..).map(|p| 1 << p).take_while(|&t| t <= top).collect()
    } else {
        b.lengths
    };
    let dtype = Dtype::F32;
    // [step 03]
    let dtype = if cuda { Dtype::Bf16 } else { dtype };
    // [/step 03]
    let mut args = BenchArgs {
        device: b.device,
        methods: Vec::new(),
        left_out: Vec::new(),
        lengths,
        batch: b.batch.unwrap_or(if cuda { 4 } else { 1 }),
        heads: b.heads,
        head_dim: b.head_dim,
        dtype: b.dtype.unwrap_or(dtype),
        runs: b.runs,
        // [step 04]
        backward: b.backward,
        // [/step 04]
        gpus: b.gpus, // [step 07]
        mask: None,   // [step 09]
        out: b.out,
    };
    // [step 09]
    if let Some(text) = &b.mask {
        args.mask = Some(check_bench_mask(text, &b.methods, &args)?);
    }
    // [/step 09]
    args.methods = choose(&b.methods, &args)?;
    if b.methods.is_empty() {
        args.left_out = methods::all()
            .into_iter()
            .filter(|m| {
                m.device() == args.device
                    && !args.methods.iter().any(|c| c.name() == m.name())
            })
            .map(|m| m.name())
            .collect();
    }
    Ok(args)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_line(s: &str) -> Result<Command, clap::Error> {
        parse(
            std::iter::once("flash-attention".to_string())
                .chain(s.split_whitespace().map(String::from)),
        )
    }

    fn bench(s: &str) -> BenchArgs {
        match parse_line(s).unwrap() {
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
        // [step 03]
        let gpu = bench("--device cuda");
        assert_eq!(gpu.lengths, [1024, 2048, 4096, 8192, 16384]);
        assert_eq!((gpu.batch, gpu.dtype), (4, Dtype::Bf16));
        // [/step 03]
    }

    #[test]
    fn flags_take_both_spellings() {
        let b =
            bench("--methods naive,naive --lengths=16,32 --batch 2 --head-dim=8 --runs 1");
        let names: Vec<&str> = b.methods.iter().map(|m| m.name()).collect();
        assert_eq!(names, ["naive", "naive"]);
        assert_eq!(b.lengths, [16, 32]);
        assert_eq!((b.batch, b.head_dim, b.runs), (2, 8, 1));
        assert!(matches!(
            parse_line("__measure-peak --lengths 8").unwrap(),
            Command::PeakChild(_)
        ));
    }

    #[test]
    fn bad_flags_say_what_is_accepted_with_one_exit_status() {
        for (line, says) in [
            ("--device tpu", "accepted: cpu"),
            ("--dtype f64", "accepted: f32"),
            ("--runs 0", "at least 1"),
            ("--lengths 1k", "whole number"),
            ("--lengths ,", "whole number"),
            ("--lengths -5", "invalid value '-5' for '--lengths"),
            ("--heads -1", "at least 1"),
            ("--methods ,", "method name"),
            ("--methods=", "method name"),
            ("--frobnicate", "unexpected argument '--frobnicate'"),
            ("--frobnicate 3", "unexpected argument '--frobnicate'"),
            ("--heads", "a value is required"),
            ("attend --method naive --q q.npy", "--k"),
            ("attend --bogus x", "unexpected argument '--bogus'"),
            (
                "attend --method nope --q a --k b --v c --out-dir d",
                "no method named \"nope\"",
            ),
            ("--q q.npy", "unexpected argument '--q'"),
            ("--k k.npy", "unexpected argument '--k'"),
            ("--out /", "--out names a folder"),
            // [step 03]
            (
                "attend --method naive --dtype bf16 --q a --k b --v c --out-dir d",
                "method \"naive\" runs on cpu and computes in f32",
            ),
            (
                "attend --method cuda_flash --dtype f32 --q a --k b --v c --out-dir d",
                "computes in bf16 or f16",
            ),
            // [/step 03]
            // [step 07]
            ("--gpus 0", "at least 1"),
            ("--gpus 2", "needs --device cuda"),
            (
                "--device cuda --methods cuda_flash --gpus 2",
                "cuda_flash runs on one GPU; the methods that spread over several are: cuda_ring",
            ),
            // [/step 07]
        ] {
            let err = parse_line(line).unwrap_err();
            let text = err.render().to_string();
            assert!(text.contains(says), "{line}: {text}");
            assert_eq!(err.exit_code(), EXIT_USAGE as i32, "{line}");
        }
    }

    // [step 03]
    #[test]
    fn attend_takes_a_dtype_for_the_gpu_methods() {
        let attend = |line: &str| match parse_line(line).unwrap() {
            Command::Attend(a) => a,
            other => panic!("{line}: {other:?}"),
        };
        let files = "--q a --k b --v c --out-dir d";
        let a = attend(&format!("attend --method cuda_flash --dtype f16 {files}"));
        assert_eq!(a.dtype, Some(Dtype::F16));
        // no --dtype: the method's own default (bf16 on the GPU, f32 on the CPU)
        assert_eq!(
            attend(&format!("attend --method cuda_flash {files}")).dtype,
            None
        );
        let a = attend(&format!("attend --method naive --dtype f32 {files}"));
        assert_eq!(a.dtype, Some(Dtype::F32));
    }
    // [/step 03]

    // [step 07]
    #[test]
    fn several_gpus_choose_the_methods_that_spread_over_them() {
        let b = bench("--device cuda --gpus 2");
        assert_eq!(b.gpus, 2);
        let names: Vec<&str> = b.methods.iter().map(|m| m.name()).collect();
        assert_eq!(names, ["cuda_ring"]);
        assert_eq!(bench("").gpus, 1);
    }
    // [/step 07]

    #[test]
    fn help_lists_the_methods() {
        let help = command().render_long_help().to_string();
        // a line each: the name, then its device, step and line of help
        for e in methods::entries() {
            let d = e.descriptor();
            let rest = format!("{:<5} step {}: {}", d.device.name(), d.step, d.about);
            let line = help
                .lines()
                .find(|l| l.trim_start().starts_with(&format!("{} ", d.name)));
            assert!(
                line.is_some_and(|l| l.ends_with(&rest)),
                "{}: {help}",
                d.name
            );
        }
        assert!(help.contains("EXIT STATUS"), "{help}");
    }

    // [step 08]
    #[test]
    fn decoders_are_for_attend_and_the_help_says_so() {
        let help = command().render_long_help().to_string();
        let heading = help
            .find("DECODERS (attend only")
            .expect("the decoders' heading");
        assert!(
            help.find("    cuda_ring ").is_some_and(|at| at < heading),
            "{help}"
        );
        assert!(
            help.find("    decode ").is_some_and(|at| at > heading),
            "{help}"
        );
        let e = parse_line("--methods decode").unwrap_err().to_string();
        assert!(
            e.contains("is a decoder") && e.contains("attend --method"),
            "{e}"
        );
        let line = "attend --method flash_decode --q q.npy --k k.npy --v v.npy --out-dir o";
        // resolved once, to the decoder, which `attend` is given
        assert!(matches!(
            parse_line(line).unwrap(),
            Command::Attend(AttendArgs {
                method: Entry::Decoder(d),
                ..
            }) if d.name() == "flash_decode"
        ));
        let e = parse_line(&format!("{line} --dtype f32"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("computes in bf16 or f16"), "{e}");
        let e = parse_line("attend --method nope --q q --k k --v v --out-dir o")
            .unwrap_err()
            .to_string();
        assert!(e.contains("attend also takes the decoders: decode"), "{e}");
    }
    // [/step 08]
}
