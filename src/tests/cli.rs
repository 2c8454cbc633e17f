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
    // 2^20 tokens of one head: inputs of 4 MB, a table of 4 TB that no allocator grants
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
    // a sweep goes on past a length that does not fit, and its exit status says some rows failed
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
    assert!(o.status.success() && stdout.contains("EXAMPLES") && stdout.contains("--lengths"));
}

#[test]
fn attend_round_trip_matches_the_in_process_result_exactly() {
    let dir = temp_dir("attend");
    let shape = Shape::new(1, 3, 130, 32);
    let [q, k, v] = random_qkv(shape, 11);
    for (name, x) in [("q", &q), ("k", &k), ("v", &v)] {
        npy::write_f32(&dir.join(format!("{name}.npy")), x.view()).unwrap();
    }
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
