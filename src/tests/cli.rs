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
    // [step 09]
    // a row without a mask leaves the mask's fields out: files from before step 09 read and
    // write as they did
    let json = fs::read_to_string(&out).unwrap();
    assert!(
        !json.contains("\"mask\"") && !json.contains("\"density\""),
        "{json}"
    );
    assert!(rows.iter().all(|r| r.mask.is_none() && r.density.is_none()));
    // [/step 09]
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
    // --out itself, refused before any measuring: a folder, a file in a folder that does
    // not exist (not made: a typo would scatter folders), a folder that takes no files
    cases.push(bad(&["--out", "/tmp"], 2, "--out names a folder"));
    let missing = dir.join("no/such/rows.json");
    cases.push(bad(
        &["--out", missing.to_str().unwrap()],
        2,
        "does not exist; create it first",
    ));
    // (Linux's /proc takes no new files, not even from root, who ignores permissions)
    if cfg!(target_os = "linux") {
        cases.push(bad(
            &["--out", "/proc/rows.json"],
            2,
            "--out: cannot write in the folder /proc",
        ));
    }
    check_bad_inputs(
        cases,
        &[&out, &dir.join("no"), Path::new("/proc/rows.json")],
    );
    fs::remove_dir_all(dir).unwrap();
}

/// The files in `dir` and their bytes, to compare a folder before and after a run.
fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, fs::read(&p).unwrap())
        })
        .collect();
    files.sort();
    files
}

/// rows.json as an earlier, complete sweep left it: the file a failed or stopped sweep must
/// leave as it was.
fn earlier_rows(dir: &Path) -> PathBuf {
    let out = dir.join("rows.json");
    fs::write(&out, "[the complete rows of an earlier sweep]\n").unwrap();
    out
}

#[test]
fn a_sweep_that_measures_nothing_leaves_the_old_out_whole() {
    let dir = temp_dir("measured-nothing");
    let out = earlier_rows(&dir);
    let before = snapshot(&dir);
    // 2^20 tokens of one head: naive's table of 4 TB fits no machine, the only row fails
    let o = run(&[
        "--methods",
        "naive",
        "--lengths",
        "1048576",
        "--heads",
        "1",
        "--head-dim",
        "1",
        "--runs",
        "1",
        "--out",
        out.to_str().unwrap(),
    ]);
    let (stdout, stderr) = text(&o);
    assert_eq!(o.status.code(), Some(3), "{stdout}\n{stderr}");
    assert!(stdout.contains("out of memory"), "{stdout}");
    assert!(
        stdout.contains("no row was measured") && stdout.contains("left as it was"),
        "{stdout}"
    );
    assert_eq!(snapshot(&dir), before, "the folder changed");
    fs::remove_dir_all(dir).unwrap();
}

#[test]
#[cfg_attr(not(unix), ignore = "needs a POSIX shell's ulimit")]
fn a_file_size_limit_leaves_the_old_out_whole() {
    let dir = temp_dir("fsize");
    let out = earlier_rows(&dir);
    let before = snapshot(&dir);
    // no file may grow past 0 bytes; SIGXFSZ ignored, so a write fails with EFBIG instead
    // of killing the process
    let o = Command::new("sh")
        .arg("-c")
        .arg("ulimit -f 0; trap '' XFSZ; exec \"$0\" \"$@\"")
        .arg(binary())
        .args(["--methods", "naive", "--lengths", "16", "--heads", "1"])
        .args([
            "--head-dim",
            "4",
            "--runs",
            "1",
            "--out",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("rows.json") && stderr.contains("file-size limit"),
        "{stderr}"
    );
    // the row was measured, and the old file is whole: no half-written rows, no temporary
    assert!(stdout.lines().any(|l| l.starts_with("naive ")), "{stdout}");
    assert_eq!(snapshot(&dir), before, "the folder changed");
    fs::remove_dir_all(dir).unwrap();
}

#[test]
#[cfg_attr(not(unix), ignore = "sends SIGINT with kill(1)")]
fn ctrl_c_stops_after_a_row_and_keeps_the_rows_so_far_beside_the_old_out() {
    let dir = temp_dir("ctrl-c");
    let out = earlier_rows(&dir);
    let old = fs::read(&out).unwrap();
    let lengths = vec!["64"; 40].join(",");
    let child = Command::new(binary())
        .args(["--methods", "naive", "--lengths", &lengths, "--heads", "1"])
        .args([
            "--head-dim",
            "8",
            "--runs",
            "1",
            "--out",
            out.to_str().unwrap(),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // the first row kept is the moment to press Ctrl-C
    let partial = dir.join("rows.partial.json");
    let started = std::time::Instant::now();
    while !partial.exists() {
        assert!(started.elapsed().as_secs() < 60, "no row within a minute");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let o = child.wait_with_output().unwrap();
    let (stdout, stderr) = text(&o);
    assert_eq!(o.status.code(), Some(130), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("Ctrl-C: stopping after the row in progress"),
        "{stderr}"
    );
    assert!(
        stdout.contains("stopped by Ctrl-C") && stdout.contains("rows.partial.json"),
        "{stdout}"
    );
    // the earlier file is whole; the rows so far parse, fewer than the sweep's 40
    assert_eq!(fs::read(&out).unwrap(), old);
    let kept = row::from_json(&fs::read_to_string(&partial).unwrap(), "partial").unwrap();
    assert!(!kept.is_empty() && kept.len() < 40, "{} rows", kept.len());
    assert!(
        kept.iter().all(|r| r.ms.is_some()),
        "a broken-off row was kept"
    );
    // a new sweep refuses to start over them
    let o = run(&[
        "--methods",
        "naive",
        "--lengths",
        "16",
        "--out",
        out.to_str().unwrap(),
    ]);
    let (_, stderr) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("rows of an earlier sweep that was stopped"),
        "{stderr}"
    );
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
        // --out-dir naming a file is refused before any input is read
        BadInput {
            args: {
                let mut args = attend("missing.npy");
                *args.last_mut().unwrap() = p("k.npy");
                args
            },
            status: 1,
            says: "--out-dir names a file, not a folder",
        },
    ];
    check_bad_inputs(cases, &[&out_dir.join("out.npy"), &out_dir]);
    fs::remove_dir_all(dir).unwrap();
}

#[test]
#[cfg_attr(not(unix), ignore = "needs a POSIX shell's ulimit")]
fn attend_that_cannot_write_leaves_the_last_run_s_outputs_as_they_were() {
    let dir = temp_dir("attend-write");
    let shape = Shape::new(1, 2, 64, 8);
    write_qkv(&dir, shape, 31);
    let out_dir = dir.join("out");
    let mut args: Vec<String> = ["attend", "--method", "naive"].map(String::from).to_vec();
    for (flag, file) in [
        ("--q", "q.npy"),
        ("--k", "k.npy"),
        ("--v", "v.npy"),
        ("--out-dir", "out"),
    ] {
        args.extend([
            flag.to_string(),
            dir.join(file).to_str().unwrap().to_string(),
        ]);
    }
    assert!(
        run(&args.iter().map(String::as_str).collect::<Vec<_>>())
            .status
            .success()
    );
    let before = snapshot(&out_dir);
    // new inputs, and no file may grow past a kilobyte: out.npy (4,224 bytes) cannot be
    // written, so neither is lse.npy, and the last run's two stay
    write_qkv(&dir, shape, 32);
    let o = Command::new("sh")
        .arg("-c")
        .arg("ulimit -f 1; trap '' XFSZ; exec \"$0\" \"$@\"")
        .arg(binary())
        .args(&args)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("file-size limit")
            && stderr.contains("no file of this run was written"),
        "{stderr}"
    );
    assert_eq!(snapshot(&out_dir), before, "the outputs changed");
    // a folder where lse.npy goes is refused before any work, out.npy left as it was
    fs::remove_file(out_dir.join("lse.npy")).unwrap();
    fs::create_dir(out_dir.join("lse.npy")).unwrap();
    let before = snapshot(&out_dir);
    let o = run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let (_, stderr) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("holds a folder named lse.npy"), "{stderr}");
    assert_eq!(snapshot(&out_dir), before, "the outputs changed");
    fs::remove_dir_all(dir).unwrap();
}

// [step 04]
#[test]
fn attend_with_a_nan_in_dout_leaves_the_last_run_s_outputs_as_they_were() {
    let dir = temp_dir("attend-dout-nan");
    let shape = Shape::new(1, 2, 9, 4);
    let [_, _, mut dout] = random_qkv(shape, 22);
    npy::write_f32(&dir.join("dout.npy"), dout.view()).unwrap();
    dout[[0, 1, 4, 2]] = f32::NAN;
    npy::write_f32(&dir.join("dout_nan.npy"), dout.view()).unwrap();
    let p = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let out_dir = dir.join("out");
    let attend = |dout: Option<&str>| {
        let mut args: Vec<String> =
            ["attend", "--method", "naive"].map(String::from).to_vec();
        for (flag, file) in [("--q", "q.npy"), ("--k", "k.npy"), ("--v", "v.npy")] {
            args.extend([flag.to_string(), p(file)]);
        }
        if let Some(d) = dout {
            args.extend(["--dout".to_string(), p(d)]);
        }
        args.extend(["--out-dir".to_string(), p("out")]);
        Command::new(binary()).args(&args).output().unwrap()
    };
    let refused = |o: &Output| {
        let (stdout, stderr) = text(o);
        assert_eq!(o.status.code(), Some(1), "{stdout}\n{stderr}");
        assert!(
            stderr.contains("non-finite input")
                && stderr.contains("dout[0, 1, 4, 2] is NaN"),
            "{stderr}"
        );
    };
    // a run without --dout leaves out.npy and lse.npy; a failed run with new inputs and a
    // NaN in dout changes neither and adds no dq, dk, dv
    write_qkv(&dir, shape, 21);
    assert!(attend(None).status.success());
    let before = snapshot(&out_dir);
    assert_eq!(before.len(), 2);
    write_qkv(&dir, shape, 23);
    refused(&attend(Some("dout_nan.npy")));
    assert_eq!(snapshot(&out_dir), before, "the outputs changed");
    // after a run with its gradients, the five files stay as they were
    assert!(attend(Some("dout.npy")).status.success());
    let before = snapshot(&out_dir);
    assert_eq!(before.len(), 5);
    write_qkv(&dir, shape, 24);
    refused(&attend(Some("dout_nan.npy")));
    assert_eq!(snapshot(&out_dir), before, "the outputs changed");
    fs::remove_dir_all(dir).unwrap();
}
// [/step 04]

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

// [step 09]
/// The largest difference between `a` and the `f64` reference, and the reference's largest
/// size (for the rule's margin).
fn max_error<'a>(
    a: impl IntoIterator<Item = &'a f32>,
    want: impl IntoIterator<Item = &'a f64>,
) -> (f64, f64) {
    a.into_iter()
        .zip(want)
        .fold((0.0f64, 1.0f64), |(err, size), (&a, &w)| {
            (err.max((a as f64 - w).abs()), size.max(w.abs()))
        })
}

/// Seeded q and dout of shape `qs`, k and v of shape `ks`, written to `dir`; then `attend
/// --method METHOD --mask SPEC --dout`: the four inputs, and what it wrote (out, lse, dq, dk,
/// dv).
fn attend_masked(
    dir: &Path,
    method: &str,
    spec: &str,
    (qs, ks): (Shape, Shape),
    seed: u64,
) -> ([ndarray::Array4<f32>; 4], [ndarray::ArrayD<f32>; 5]) {
    let q = random_qkv(qs, seed)[0].clone();
    let [k, v, _] = random_qkv(ks, seed + 1);
    let dout = random_qkv(qs, seed + 2)[0].clone();
    for (name, x) in [("q", &q), ("k", &k), ("v", &v), ("dout", &dout)] {
        npy::write_f32(&dir.join(format!("{name}.npy")), x.view()).unwrap();
    }
    let p = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let o = run(&[
        "attend",
        "--method",
        method,
        "--mask",
        spec,
        "--q",
        &p("q.npy"),
        "--k",
        &p("k.npy"),
        "--v",
        &p("v.npy"),
        "--dout",
        &p("dout.npy"),
        "--out-dir",
        &p("out"),
    ]);
    let (stdout, stderr) = text(&o);
    assert!(o.status.success(), "{stdout}\n{stderr}");
    let read = |n: &str| npy::read_f32(&dir.join("out").join(format!("{n}.npy"))).unwrap();
    let written = ["out", "lse", "dq", "dk", "dv"].map(read);
    let shapes = written.each_ref().map(|x| x.shape().to_vec());
    let (q_dims, k_dims) = (qs.dims().to_vec(), ks.dims().to_vec());
    assert_eq!(
        shapes,
        [
            q_dims.clone(),
            q_dims[..3].to_vec(),
            q_dims,
            k_dims.clone(),
            k_dims
        ]
    );
    ([q, k, v, dout], written)
}

/// `attend --mask` on the CPU: 5 query rows (the last of 9 positions) on 4 heads against
/// keys on 2 kv heads, a sliding window of 3, forward and backward; each array within twice
/// the error of attention by hand in `f32` against the `f64` reference (FlashAttention's
/// rule).
#[test]
fn attend_with_a_mask_is_within_the_2x_rule_of_the_f64_reference() {
    use step09_masks::MaskSpec;
    use step09_masks::reference::{
        attention_by_hand, attention_f64, backward_by_hand, backward_f64,
    };
    let dir = temp_dir("attend-mask");
    let shapes = (Shape::new(2, 4, 5, 16), Shape::new(2, 2, 9, 16));
    let ([q, k, v, dout], [out, lse, dq, dk, dv]) =
        attend_masked(&dir, "naive", "sliding:3", shapes, 21);
    let (mask, score) = MaskSpec::parse("sliding:3")
        .unwrap()
        .resolve(2, 4, 9)
        .unwrap();
    let (q, k, v, dout) = (q.view(), k.view(), v.view(), dout.view());
    let want = attention_f64(q, k, v, &mask, &score).unwrap();
    let hand = attention_by_hand(q, k, v, &mask, &score).unwrap();
    let want_g = backward_f64(q, k, v, dout, &mask, &score).unwrap();
    let hand_g = backward_by_hand(q, k, v, dout, &mask, &score).unwrap();
    for (name, (ours, size), (by_hand, _)) in [
        (
            "out",
            max_error(&out, &want.out),
            max_error(&hand.out, &want.out),
        ),
        (
            "lse",
            max_error(&lse, &want.lse),
            max_error(&hand.lse, &want.lse),
        ),
        (
            "dq",
            max_error(&dq, &want_g.dq),
            max_error(&hand_g.dq, &want_g.dq),
        ),
        (
            "dk",
            max_error(&dk, &want_g.dk),
            max_error(&hand_g.dk, &want_g.dk),
        ),
        (
            "dv",
            max_error(&dv, &want_g.dv),
            max_error(&hand_g.dv, &want_g.dv),
        ),
    ] {
        assert!(
            ours <= 2.0 * by_hand + 1e-5 * size,
            "{name}: max abs error {ours:.3e} against f64, over twice by hand's {by_hand:.3e}"
        );
    }
    // the window mattered: causal attention over the same keys is far from it
    let causal = attention_f64(q, k, v, &step09_masks::Mask::Causal, &score).unwrap();
    assert!(max_error(&out, &causal.out).0 > 1e-2);
    fs::remove_dir_all(dir).unwrap();
}

/// `attend --mask` with a GPU method runs step 09's Hopper kernels: 77 query rows against
/// 333 keys on 2 kv heads, a sliding window with soft-capping, forward and backward in bf16;
/// each array within twice the error of attention by hand in bf16 against the `f64`
/// reference on the inputs rounded to bf16.
#[test]
#[ignore = "needs a Hopper GPU (sm_90)"]
fn attend_with_a_mask_on_the_gpu_is_within_the_2x_rule() {
    use step03_cuda_forward::host::round_array;
    use step09_masks::MaskSpec;
    use step09_masks::reference::{attention_f64, backward_f64};
    use step09_masks::rule::{backward_by_hand_low_precision, by_hand_low_precision};
    let dir = temp_dir("attend-mask-gpu");
    let spec = "sliding:64,softcap:30";
    let shapes = (Shape::new(1, 4, 77, 64), Shape::new(1, 2, 333, 64));
    let ([q, k, v, dout], [out, lse, dq, dk, dv]) =
        attend_masked(&dir, "cuda_hopper", spec, shapes, 41);
    let (mask, score) = MaskSpec::parse(spec).unwrap().resolve(1, 4, 333).unwrap();
    let bf16 = Dtype::Bf16;
    let [qr, kr, vr, dr] = [&q, &k, &v, &dout].map(|x| round_array(x.view(), bf16));
    let want = attention_f64(qr.view(), kr.view(), vr.view(), &mask, &score).unwrap();
    let want_g =
        backward_f64(qr.view(), kr.view(), vr.view(), dr.view(), &mask, &score).unwrap();
    let (q, k, v, dout) = (q.view(), k.view(), v.view(), dout.view());
    let hand = by_hand_low_precision(q, k, v, &mask, &score, bf16).unwrap();
    let hand_g =
        backward_by_hand_low_precision(q, k, v, dout, &mask, &score, bf16).unwrap();
    for (name, (ours, size), (by_hand, _)) in [
        (
            "out",
            max_error(&out, &want.out),
            max_error(&hand.out, &want.out),
        ),
        (
            "dq",
            max_error(&dq, &want_g.dq),
            max_error(&hand_g.dq, &want_g.dq),
        ),
        (
            "dk",
            max_error(&dk, &want_g.dk),
            max_error(&hand_g.dk, &want_g.dk),
        ),
        (
            "dv",
            max_error(&dv, &want_g.dv),
            max_error(&hand_g.dv, &want_g.dv),
        ),
    ] {
        assert!(
            ours <= 2.0 * by_hand + 1e-5 * size,
            "{name}: max abs error {ours:.3e} against f64, over twice by hand's {by_hand:.3e}"
        );
    }
    // the log-sum-exps are kept in f32: close to the reference's
    for (&o, &w) in lse.iter().zip(&want.lse) {
        assert!(
            (o as f64 - w).abs() <= 2e-2 * (1.0 + w.abs()),
            "lse {o}, f64 {w}"
        );
    }
    fs::remove_dir_all(dir).unwrap();
}

/// A mask the parser refuses is an argument error (status 2) that says what is accepted; one
/// that does not fit the inputs, or comes with a decoder, is refused too; nothing is written.
#[test]
fn attend_refuses_a_bad_mask_with_what_is_accepted_and_writes_nothing() {
    let dir = temp_dir("attend-bad-mask");
    let q = random_qkv(Shape::new(1, 2, 4, 8), 31)[0].clone();
    let [k, v, _] = random_qkv(Shape::new(1, 2, 6, 8), 32);
    let k3 = random_qkv(Shape::new(1, 3, 6, 8), 33)[0].clone();
    for (name, x) in [("q", &q), ("k", &k), ("v", &v), ("k3", &k3), ("v3", &k3)] {
        npy::write_f32(&dir.join(format!("{name}.npy")), x.view()).unwrap();
    }
    // two documents of 2 and 3 tokens, where k and v hold 6
    fs::write(dir.join("lengths.txt"), "2 3\n").unwrap();
    let p = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let documents = format!("documents:{}", p("lengths.txt"));
    let attend = |method: &str, mask: &str, kv: [&str; 2]| -> Vec<String> {
        [
            "attend",
            "--method",
            method,
            "--mask",
            mask,
            "--q",
            &p("q.npy"),
            "--k",
            &p(kv[0]),
            "--v",
            &p(kv[1]),
            "--out-dir",
            &p("out"),
        ]
        .map(String::from)
        .to_vec()
    };
    let kv = ["k.npy", "v.npy"];
    let mut cases = Vec::new();
    for (mask, says) in [
        ("sliding:0", "a window of 0 keys"),
        (
            "sliding:x",
            "is not a whole number; accepted: comma-separated terms",
        ),
        ("causal,full", "gives two masks"),
        (
            "bogus",
            "unknown term \"bogus\"; accepted: comma-separated terms",
        ),
        ("softcap:-1", "accepted:"),
    ] {
        let args = attend("naive", mask, kv);
        cases.push(BadInput {
            args,
            status: 2,
            says,
        });
    }
    cases.push(BadInput {
        args: attend("naive", &documents, kv),
        status: 1,
        says: "the documents add up to 5 tokens, but k and v hold 6",
    });
    cases.push(BadInput {
        args: attend("naive", "causal", ["k3.npy", "v3.npy"]),
        status: 1,
        says: "the kv heads do not divide the query heads",
    });
    cases.push(BadInput {
        args: attend("decode", "causal", kv),
        status: 2,
        says: "\"decode\" is a decoder",
    });
    check_bad_inputs(cases, &[&dir.join("out")]);
    fs::remove_dir_all(dir).unwrap();
}

/// The benchmark with `--mask SPEC` on the CPU, and what a row says: the rows are step 09's
/// masked attention (`masked`), checked and timed, each with the mask and its density, the
/// fraction of the scores the mask keeps, counted here pair by pair; the rate counts the
/// kept scores only (4·head_dim FLOPs each, 3.5 times that forward and backward).
#[test]
fn benchmark_with_a_mask_times_it_and_writes_the_mask_and_its_density() {
    let dir = temp_dir("bench-mask");
    // documents of 40, 24 and 36 tokens: 100, the second length
    fs::write(dir.join("lengths.txt"), "40 24 36\n").unwrap();
    let documents = format!("documents:{}", dir.join("lengths.txt").display());
    let (heads, head_dim) = (2, 16);
    for (spec, lengths, backward) in [
        ("sliding:16,softcap:30", "64,100", false),
        (documents.as_str(), "100", true),
    ] {
        let (mask, _) = step09_masks::MaskSpec::parse(spec)
            .unwrap()
            .resolve(1, heads, 100)
            .unwrap();
        let out = dir.join("rows.json");
        let mut args = vec![
            "--mask",
            spec,
            "--lengths",
            lengths,
            "--heads",
            "2",
            "--head-dim",
            "16",
            "--runs",
            "1",
            "--out",
            out.to_str().unwrap(),
        ];
        if backward {
            args.push("--backward");
        }
        let o = run(&args);
        let (stdout, stderr) = text(&o);
        assert!(o.status.success(), "{spec}\n{stdout}\n{stderr}");
        assert!(stdout.contains(&format!("mask {spec}")), "{stdout}");
        let rows = row::from_json(&fs::read_to_string(&out).unwrap(), "rows.json").unwrap();
        let lengths: Vec<usize> = lengths.split(',').map(|t| t.parse().unwrap()).collect();
        assert_eq!(rows.iter().map(|r| r.tokens).collect::<Vec<_>>(), lengths);
        for r in &rows {
            let t = r.tokens;
            let kept = (0..t)
                .flat_map(|q| (0..t).map(move |k| (q, k)))
                .filter(|&(q, k)| mask.allows(0, 0, q, k))
                .count();
            let density = kept as f64 / (t * t) as f64;
            assert_eq!(r.method, "masked", "{spec}");
            assert_eq!(r.mask.as_deref(), Some(spec));
            assert_eq!(r.error, None, "{spec}");
            assert!(
                r.density.is_some_and(|d| (d - density).abs() < 1e-12),
                "{spec} at {t}: {:?}, counted {density}",
                r.density
            );
            let pass = if backward {
                Pass::ForwardBackward
            } else {
                Pass::Forward
            };
            assert_eq!(r.pass, pass);
            let per_score = 4.0 * head_dim as f64 * if backward { 3.5 } else { 1.0 };
            let flops = per_score * (heads * kept) as f64;
            let want = flops / (r.ms.unwrap() * 1e-3) / 1e12;
            let tflops = r.tflops.unwrap();
            assert!((tflops / want - 1.0).abs() < 1e-9, "{tflops} vs {want}");
            // the table's line gives the density too
            assert!(
                stdout.lines().any(|l| l.starts_with("masked")
                    && l.contains(&format!(" {t} "))
                    && l.contains(&format!("density {density:.3}"))),
                "{stdout}"
            );
        }
    }
    fs::remove_dir_all(dir).unwrap();
}

/// `--mask` refused before any work, with status 2 and nothing written: a spec the parser
/// refuses (its own message), a documents file that is missing or does not add up to a
/// length, a GPU method, a GPU device, a decoder.
#[test]
fn benchmark_refuses_a_bad_mask_with_status_2_and_writes_nothing() {
    let dir = temp_dir("bench-bad-mask");
    let out = dir.join("rows.json");
    fs::write(dir.join("lengths.txt"), "40 20\n").unwrap();
    let documents = format!("documents:{}", dir.join("lengths.txt").display());
    let missing = format!("documents:{}", dir.join("missing.txt").display());
    let bench = |mask: &str, more: &[&str]| -> Vec<String> {
        let mut args = vec!["--mask", mask, "--lengths", "64", "--runs", "1"];
        args.extend(more);
        args.extend(["--out", out.to_str().unwrap()]);
        args.into_iter().map(String::from).collect()
    };
    let mut cases = Vec::new();
    for (args, says) in [
        (
            bench("bogus", &[]),
            "unknown term \"bogus\"; accepted: comma-separated terms",
        ),
        (bench("sliding:0", &[]), "a window of 0 keys"),
        (bench(&missing, &[]), "missing.txt: cannot read it"),
        (
            bench(&documents, &[]),
            "the documents add up to 60 tokens, but k and v hold 64",
        ),
        (
            bench("causal", &["--device", "cuda"]),
            "--mask with --device cuda",
        ),
        (
            bench("causal", &["--methods", "cuda_flash"]),
            "method \"cuda_flash\" runs on cuda",
        ),
        (
            bench("causal", &["--methods", "decode"]),
            "\"decode\" is a decoder",
        ),
    ] {
        cases.push(BadInput {
            args,
            status: 2,
            says,
        });
    }
    check_bad_inputs(cases, &[&out]);
    fs::remove_dir_all(dir).unwrap();
}

/// A masked row's peak memory is measured as every CPU row's, in a fresh process, which is
/// given the mask: a `documents:FILE` named relative to the working folder reaches it too.
/// The figure is in the JSON row and in the table's peak MB column, and covers at least the
/// result the call returns (out and lse, and dq, dk, dv with `--backward`), alive when the
/// peak is read.
#[test]
fn benchmark_with_a_mask_measures_its_peak_in_a_fresh_process() {
    let dir = temp_dir("bench-mask-peak");
    fs::write(dir.join("lengths.txt"), "300 724\n").unwrap();
    let (heads, tokens, head_dim) = (2, 1024, 32);
    for (spec, backward) in [("sliding:64", false), ("documents:lengths.txt", true)] {
        let mut args = vec![
            "--mask",
            spec,
            "--lengths",
            "1024",
            "--heads",
            "2",
            "--head-dim",
            "32",
            "--runs",
            "1",
            "--out",
            "rows.json",
        ];
        if backward {
            args.push("--backward");
        }
        let o = Command::new(binary())
            .args(&args)
            .current_dir(&dir)
            .output()
            .expect("the benchmark binary runs");
        let (stdout, stderr) = text(&o);
        assert!(o.status.success(), "{spec}\n{stdout}\n{stderr}");
        let json = fs::read_to_string(dir.join("rows.json")).unwrap();
        let rows = row::from_json(&json, "rows.json").unwrap();
        let [r] = &rows[..] else {
            panic!("{spec}: one row, got {rows:?}")
        };
        assert_eq!((r.method.as_str(), r.error.as_deref()), ("masked", None));
        let column = stdout
            .lines()
            .find(|l| l.starts_with("masked"))
            .and_then(|l| l.split_whitespace().nth(5))
            .unwrap_or_else(|| panic!("{spec}: no masked line\n{stdout}"));
        if !Path::new("/proc/self/clear_refs").exists() {
            assert_eq!((r.peak_bytes, column), (None, "-"), "{spec}");
            continue;
        }
        let peak = r
            .peak_bytes
            .unwrap_or_else(|| panic!("{spec}: no peak\n{json}"));
        let out = heads * tokens * head_dim * 4;
        let result = heads * tokens * 4 + if backward { 4 * out } else { out };
        assert!(
            peak >= result as u64,
            "{spec}: peak {peak}, result {result}"
        );
        assert!(json.contains(&format!("\"peak_bytes\": {peak}")), "{json}");
        assert_eq!(
            column,
            format!("{:.1}", peak as f64 / 1e6),
            "{spec}\n{stdout}"
        );
    }
    fs::remove_dir_all(dir).unwrap();
}
// [/step 09]
