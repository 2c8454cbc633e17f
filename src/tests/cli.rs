//! The benchmark and `attend` as a reader runs them: through the built binary.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use flash_attention::npy;
use flash_core::inputs::random_qkv;
use flash_core::row;
use flash_core::{Dtype, Pass, Shape};

/// The benchmark binary cargo built; a test binary copied to another machine with the
/// binaries (`.gpu/tests/` beside `.gpu/bin/`) finds it there.
fn binary() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_BIN_EXE_flash-attention"));
    if built.exists() {
        return built;
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("bin/flash-attention")))
        .filter(|p| p.exists())
        .unwrap_or(built)
}

fn run(args: &[&str]) -> Output {
    Command::new(binary())
        .args(args)
        .output()
        .expect("the benchmark binary runs")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Seeded q, k and v of `shape`, also written to `dir` as q.npy, k.npy and v.npy.
fn write_qkv(dir: &Path, shape: Shape, seed: u64) -> [ndarray::Array4<f32>; 3] {
    let qkv = random_qkv(shape, seed);
    for (name, x) in ["q", "k", "v"].iter().zip(&qkv) {
        npy::write_f32(&dir.join(format!("{name}.npy")), x.view()).unwrap();
    }
    qkv
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("flash-cli-{name}-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn benchmark_prints_a_table_and_writes_every_key() {
    let dir = temp_dir("bench");
    let out = dir.join("rows.json");
    let o = run(&[
        "--methods",
        "naive",
        "--lengths",
        "64,512",
        "--runs",
        "1",
        "--out",
        out.to_str().unwrap(),
    ]);
    let (stdout, stderr) = text(&o);
    assert!(o.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("device:") && stdout.contains("(step 01-naive)"),
        "{stdout}"
    );
    assert!(stderr.contains("[2/2] naive at 512 tokens"), "{stderr}");

    // the rows parse as the shared schema, which the charts read too
    let rows = row::from_json(&fs::read_to_string(&out).unwrap(), "rows.json").unwrap();
    assert_eq!(rows.len(), 2);
    let r = &rows[1];
    assert_eq!((r.tokens, r.heads), (512, 12));
    assert_eq!((r.dtype, r.pass), (Dtype::F32, Pass::Forward));
    assert_eq!(r.error, None);
    let ms = r.ms.unwrap();
    let tflops = r.tflops.unwrap();
    let expected = r.shape().flops(Pass::Forward) / (ms * 1e-3) / 1e12;
    assert!(
        (tflops / expected - 1.0).abs() < 1e-9,
        "{tflops} vs {expected}"
    );
    // the naive method keeps the whole 12 × 512 × 512 f32 table: its peak is at least that
    if Path::new("/proc/self/clear_refs").exists() {
        let peak = r.peak_bytes.expect("a measured peak");
        let table = 12 * 512 * 512 * 4;
        assert!(
            peak >= table && peak < 4 * table,
            "peak {peak}, table {table}"
        );
    }
    fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_length_that_does_not_fit_is_a_row_not_a_crash() {
    // 2^20 tokens of one head: inputs of 4 MB, a table of 4 TB, more than any machine's
    // memory and swap (refused before allocating, also where the kernel would overcommit)
    let o = run(&[
        "--methods",
        "naive",
        "--lengths",
        "1048576,32",
        "--heads",
        "1",
        "--head-dim",
        "1",
        "--runs",
        "1",
    ]);
    let (stdout, stderr) = text(&o);
    // a sweep goes on past a length that does not fit, and its exit status says some rows
    // failed
    assert_eq!(o.status.code(), Some(3), "{stdout}\n{stderr}");
    let lines: Vec<&str> = stdout.lines().filter(|l| l.starts_with("naive ")).collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    assert!(lines[0].contains("out of memory"), "{stdout}");
    assert!(!lines[1].contains("out of memory"), "{stdout}");
}

#[test]
fn bad_flags_fail_with_what_is_accepted() {
    for (args, says) in [
        (vec!["--device", "tpu"], "accepted: cpu"),
        (vec!["--methods", "nope"], "naive"),
        (vec!["--lengths", "0"], "at least 1"),
    ] {
        let o = run(&args);
        let (_, stderr) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    let o = run(&["--help"]);
    let (stdout, _) = text(&o);
    assert!(
        o.status.success() && stdout.contains("EXAMPLES") && stdout.contains("--lengths")
    );
}

#[test]
fn attend_round_trip_matches_the_in_process_result_exactly() {
    let dir = temp_dir("attend");
    let shape = Shape::new(1, 3, 130, 32);
    let [q, k, v] = write_qkv(&dir, shape, 11);
    let p = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let o = run(&[
        "attend",
        "--method",
        "naive",
        "--q",
        &p("q.npy"),
        "--k",
        &p("k.npy"),
        "--v",
        &p("v.npy"),
        "--out-dir",
        &p("out"),
    ]);
    let (stdout, stderr) = text(&o);
    assert!(o.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("out.npy") && stdout.contains("lse.npy"),
        "{stdout}"
    );

    let expected = step01_naive::attention(q.view(), k.view(), v.view()).unwrap();
    let out = npy::read_f32_4d(&dir.join("out/out.npy")).unwrap();
    let lse = npy::read_f32(&dir.join("out/lse.npy")).unwrap();
    assert!(
        out.iter()
            .zip(&expected.out)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );
    assert_eq!(lse.shape(), expected.lse.shape());
    assert!(
        lse.iter()
            .zip(&expected.lse)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );

    // a float64 file in place of v: refused, naming the file and the dtype expected
    let mut f64_file = b"\x93NUMPY\x01\x00".to_vec();
    let header = "{'descr': '<f8', 'fortran_order': False, 'shape': (1, 3, 130, 32), }\n";
    f64_file.extend((header.len() as u16).to_le_bytes());
    f64_file.extend(header.as_bytes());
    f64_file.extend(vec![0u8; 3 * 130 * 32 * 8]);
    fs::write(dir.join("v64.npy"), f64_file).unwrap();
    let o = run(&[
        "attend",
        "--method",
        "naive",
        "--q",
        &p("q.npy"),
        "--k",
        &p("k.npy"),
        "--v",
        &p("v64.npy"),
        "--out-dir",
        &p("out"),
    ]);
    let (_, stderr) = text(&o);
    assert!(!o.status.success());
    assert!(
        stderr.contains("v64.npy") && stderr.contains("'<f4'"),
        "{stderr}"
    );

    // a missing file and a missing flag
    let o = run(&[
        "attend",
        "--method",
        "naive",
        "--q",
        &p("nope.npy"),
        "--k",
        &p("k.npy"),
        "--v",
        &p("v.npy"),
        "--out-dir",
        &p("out"),
    ]);
    let (_, stderr) = text(&o);
    assert!(
        stderr.contains("nope.npy") && stderr.contains("cannot read"),
        "{stderr}"
    );
    let (_, stderr) = text(&run(&["attend", "--method", "naive"]));
    assert!(stderr.contains("--q"), "{stderr}");
    fs::remove_dir_all(dir).unwrap();
}

/// One mistake a user can make, and what the binary must answer.
struct BadInput {
    args: Vec<String>,
    /// The exit status: 2 for an argument error, 1 for a failure after parsing.
    status: i32,
    /// What the message must say: the problem, by name.
    says: &'static str,
}

fn bad(args: &[&str], status: i32, says: &'static str) -> BadInput {
    BadInput {
        args: args.iter().map(|a| a.to_string()).collect(),
        status,
        says,
    }
}

/// Runs each case and checks: the expected non-zero status (never 101, a panic), a message
/// naming the problem, and nothing written where the results would have gone.
fn check_bad_inputs(cases: Vec<BadInput>, outputs: &[&Path]) {
    for case in cases {
        let o = Command::new(binary())
            .args(&case.args)
            .output()
            .expect("the benchmark binary runs");
        let (stdout, stderr) = text(&o);
        let args = case.args.join(" ");
        assert_ne!(o.status.code(), Some(101), "{args}: a panic\n{stderr}");
        assert_eq!(
            o.status.code(),
            Some(case.status),
            "{args}\n{stdout}\n{stderr}"
        );
        assert!(
            stderr.contains(case.says),
            "{args}: expected {:?} in\n{stderr}",
            case.says
        );
        for path in outputs {
            assert!(!path.exists(), "{args}: wrote {}", path.display());
        }
    }
}

#[test]
fn bad_arguments_are_refused_with_status_2_and_nothing_written() {
    let dir = temp_dir("bad-args");
    let out = dir.join("rows.json");
    let out_flag = out.to_str().unwrap();
    let mut cases = Vec::new();
    for (args, says) in [
        (vec!["--lengths", "0"], "at least 1"),
        (vec!["--lengths", "-5"], "invalid value '-5' for '--lengths"),
        (vec!["--lengths", "abc"], "invalid value 'abc'"),
        (vec!["--lengths", ","], "a whole number of at least 1"),
        (vec!["--methods", ""], "a method name"),
        (vec!["--methods", "nope"], "no method named \"nope\""),
        (vec!["--frobnicate"], "unexpected argument '--frobnicate'"),
        (
            vec!["--frobnicate", "3"],
            "unexpected argument '--frobnicate'",
        ),
        (
            vec!["--batch", "18446744073709551615"],
            "more values than this machine can address",
        ),
        (
            vec!["--lengths", "4294967296", "--heads", "4294967296"],
            "more values than this machine can address",
        ),
        (vec!["--q", "q.npy"], "unexpected argument '--q'"),
        (vec!["--k", "k.npy"], "unexpected argument '--k'"),
        (vec!["--v", "v.npy"], "unexpected argument '--v'"),
        // [step 04]
        (vec!["--dout", "dout.npy"], "unexpected argument '--dout'"),
        // [/step 04]
    ] {
        let mut args = args;
        args.extend(["--out", out_flag]);
        cases.push(bad(&args, 2, says));
    }
    // --out itself: a folder, and a file under a folder that cannot be made
    cases.push(bad(&["--out", "/tmp"], 2, "is a folder"));
    cases.push(bad(
        &["--out", "/proc/x/y.json"],
        2,
        "cannot make its folder /proc/x",
    ));
    check_bad_inputs(cases, &[&out, Path::new("/proc/x")]);
    fs::remove_dir_all(dir).unwrap();
}

#[test]
fn attend_refuses_a_missing_file_and_a_nan_and_writes_nothing() {
    let dir = temp_dir("attend-bad");
    let shape = Shape::new(1, 2, 8, 4);
    let [mut q, k, v] = random_qkv(shape, 3);
    q[[0, 1, 3, 2]] = f32::NAN;
    for (name, x) in [("q_nan", &q), ("k", &k), ("v", &v)] {
        npy::write_f32(&dir.join(format!("{name}.npy")), x.view()).unwrap();
    }
    let p = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let out_dir = dir.join("out");
    let attend = |q: &str| {
        let (q, k, v, out) = (p(q), p("k.npy"), p("v.npy"), p("out"));
        [
            "attend",
            "--method",
            "naive",
            "--q",
            &q,
            "--k",
            &k,
            "--v",
            &v,
            "--out-dir",
            &out,
        ]
        .map(String::from)
        .to_vec()
    };
    let cases = vec![
        BadInput {
            args: attend("missing.npy"),
            status: 1,
            says: "missing.npy: cannot read",
        },
        // a NaN is refused before any work: the message names the tensor and the position
        BadInput {
            args: attend("q_nan.npy"),
            status: 1,
            says: "non-finite input: q[0, 1, 3, 2] is NaN",
        },
        // attend's flags are the benchmark's argument errors too
        BadInput {
            args: ["attend", "--method", "naive", "--q", &p("k.npy")]
                .map(String::from)
                .to_vec(),
            status: 2,
            says: "--k",
        },
    ];
    check_bad_inputs(cases, &[&out_dir.join("out.npy"), &out_dir]);
    fs::remove_dir_all(dir).unwrap();
}

// [step 02]
#[test]
fn inputs_larger_than_memory_are_an_out_of_memory_row_not_a_crash() {
    // 100000 heads of 4096 tokens: 105 GB for each of q, k and v
    let dir = temp_dir("huge");
    let out = dir.join("rows.json");
    let started = std::time::Instant::now();
    let o = run(&[
        "--heads",
        "100000",
        "--lengths",
        "4096",
        "--methods",
        "online",
        "--runs",
        "1",
        "--out",
        out.to_str().unwrap(),
    ]);
    let (stdout, stderr) = text(&o);
    assert_eq!(o.status.code(), Some(3), "{stdout}\n{stderr}");
    let line = stdout
        .lines()
        .find(|l| l.starts_with("online "))
        .unwrap_or_else(|| panic!("no row in\n{stdout}"));
    assert!(line.contains("out of memory"), "{line}");
    assert!(
        started.elapsed().as_secs() < 30,
        "took {:?}",
        started.elapsed()
    );
    // the row is kept, with its reason
    let rows = row::from_json(&fs::read_to_string(&out).unwrap(), "rows.json").unwrap();
    assert!(rows[0].error.as_deref().unwrap().contains("out of memory"));
    fs::remove_dir_all(dir).unwrap();
}
// [/step 02]

// [step 03]
/// `attend --dtype f16` on a GPU method computes in f16: the result is the method's own in
/// f16, bit for bit, and differs from its bf16 result.
#[test]
#[ignore = "needs a CUDA GPU"]
fn attend_on_the_gpu_computes_in_the_dtype_asked_for() {
    let dir = temp_dir("attend-f16");
    let shape = Shape::new(1, 2, 130, 64);
    let [q, k, v] = write_qkv(&dir, shape, 12);
    let p = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let o = run(&[
        "attend",
        "--method",
        "cuda_flash",
        "--dtype",
        "f16",
        "--q",
        &p("q.npy"),
        "--k",
        &p("k.npy"),
        "--v",
        &p("v.npy"),
        "--out-dir",
        &p("out"),
    ]);
    let (stdout, stderr) = text(&o);
    assert!(o.status.success(), "{stdout}\n{stderr}");
    let out = npy::read_f32_4d(&dir.join("out/out.npy")).unwrap();
    use flash_core::Method;
    let flash = step03_cuda_forward::CudaFlash;
    let f16 = flash
        .forward(q.view(), k.view(), v.view(), Dtype::F16)
        .unwrap();
    let bf16 = flash
        .forward(q.view(), k.view(), v.view(), Dtype::Bf16)
        .unwrap();
    assert_eq!(out, f16.out);
    assert_ne!(out, bf16.out);
    fs::remove_dir_all(dir).unwrap();
}
// [/step 03]

// [step 05]
/// What the book shows as "run this, you will see this": each file under `book/src/output/`
/// is a command on its first line and what it prints after it, and must be what the binary
/// prints now. `UPDATE_BOOK_OUTPUT=1` writes them instead of comparing.
#[test]
fn the_book_shows_what_the_binary_prints() {
    let update =
        "UPDATE_BOOK_OUTPUT=1 cargo test -p flash-attention --test cli the_book_shows";
    for (name, args) in [
        ("bench-help.txt", &["--help"][..]),
        ("attend-help.txt", &["attend", "--help"][..]),
    ] {
        let o = run(args);
        let (stdout, stderr) = text(&o);
        assert!(o.status.success(), "{args:?}: {stderr}");
        let shown = format!("$ cargo run --release -- {}\n{stdout}", args.join(" "));
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("book/src/output");
        let dir = if dir.is_dir() {
            dir
        } else {
            PathBuf::from("book/src/output")
        };
        let path = dir.join(name);
        if std::env::var_os("UPDATE_BOOK_OUTPUT").is_some() {
            fs::create_dir_all(&dir).unwrap();
            fs::write(&path, &shown).unwrap();
            continue;
        }
        let committed = fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == shown,
            "book/src/output/{name} differs from what the binary prints now: \
             run `{update}` to update book/src/output/{name}\n--- now:\n{shown}"
        );
    }
}
// [/step 05]
