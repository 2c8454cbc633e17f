//! `decode-cpu` given what a careless user types: an `--out` it cannot write, a cache larger
//! than the machine, sizes near `u64::MAX`, a count past the machine's word. Each is refused
//! before any work, with a message that names the flag and a non-zero status, never a panic
//! (status 101) or an abort.

use std::process::{Command, Output};

mod common;

fn decode_cpu(args: &[&str]) -> Output {
    Command::new(common::binary(
        env!("CARGO_BIN_EXE_decode-cpu"),
        "decode-cpu",
    ))
    .args(args)
    .output()
    .expect("decode-cpu runs")
}

/// Runs `args` and checks the refusal: `status`, a message with each of `says`, and nothing
/// measured (no table on stdout).
fn refused(args: &[&str], status: i32, says: &[&str]) -> String {
    let started = std::time::Instant::now();
    let run = decode_cpu(args);
    let err = String::from_utf8_lossy(&run.stderr).into_owned();
    assert_eq!(run.status.code(), Some(status), "{args:?}: {err}");
    for s in says {
        assert!(err.contains(s), "{args:?}: expected {s:?} in\n{err}");
    }
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    assert!(
        run.stdout.is_empty(),
        "{args:?}: measured before the refusal"
    );
    assert!(
        started.elapsed().as_secs() < 10,
        "{args:?}: it tried the work"
    );
    err
}

#[test]
fn an_out_that_cannot_be_written_is_refused_before_any_work() {
    let dir = std::env::temp_dir().join(format!("decode-cpu-out-{}", std::process::id()));
    let missing = dir.join("no/such/rows.json");
    let err = refused(
        &["--contexts", "64", "--out", missing.to_str().unwrap()],
        1,
        &["--out: the folder", "does not exist"],
    );
    // a file error is not an input the method refused
    assert!(!err.contains("unsupported input"), "{err}");
    assert!(!dir.exists(), "made {}", dir.display());
    refused(
        &["--contexts", "64", "--out", "/"],
        1,
        &["--out names a folder"],
    );
}

#[test]
fn sizes_larger_than_the_machine_are_refused_with_the_bytes() {
    // 10^11 tokens of 8 kv heads of 128 values: 819 TB of k and v
    refused(
        &[
            "--contexts",
            "100000000000",
            "--q-heads",
            "8",
            "--kv-heads",
            "8",
            "--head-dims",
            "128",
        ],
        1,
        &["--contexts 100000000000", "bytes", "of memory and swap"],
    );
    // sizes near u64::MAX overflow any count of bytes
    let max = u64::MAX.to_string();
    for flag in ["--contexts", "--batch", "--head-dims"] {
        refused(
            &[flag, &max, "--q-heads", "8", "--kv-heads", "8"],
            1,
            &[
                &format!("{flag} {max}"),
                "more bytes than this machine can address",
            ],
        );
    }
    refused(
        &["--q-heads", &max, "--kv-heads", "1", "--contexts", "64"],
        1,
        &["more bytes than this machine can address"],
    );
}

#[test]
fn a_count_past_the_machine_s_word_says_the_range() {
    let err = refused(
        &["--runs", "99999999999999999999"],
        2,
        &["--runs", "too large", "from 1 to"],
    );
    assert!(err.contains(&usize::MAX.to_string()), "{err}");
}
