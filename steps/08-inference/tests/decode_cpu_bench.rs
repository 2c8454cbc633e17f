//! `decode-cpu`, the CPU's decoding benchmark, run as a reader runs it: its rows, one per
//! rung and the read loop's, and its refusals of kv heads that do not divide the query heads
//! and of a rung it does not know.

use std::process::Command;

mod common;

fn binary() -> std::path::PathBuf {
    common::binary(env!("CARGO_BIN_EXE_decode-cpu"), "decode-cpu")
}

fn decode_cpu(args: &[&str]) -> std::process::Output {
    Command::new(binary())
        .args(args)
        .output()
        .expect("decode-cpu runs")
}

#[test]
fn every_shape_gives_a_checked_row_and_the_read_loop_s() {
    let dir = std::env::temp_dir().join(format!("decode-cpu-{}", std::process::id()));
    let out = dir.join("rows.json");
    std::fs::create_dir_all(&dir).unwrap();
    let run = decode_cpu(&[
        "--contexts",
        "100,300",
        "--head-dims",
        "32",
        "--q-heads",
        "8",
        "--kv-heads",
        "8,2",
        "--runs",
        "1",
        "--warmup",
        "0",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    // 2 kv head counts × 2 contexts, each the four rungs and the read loop
    assert_eq!(rows.len(), 20);
    for row in &rows {
        assert!(row["error"].is_null(), "{row}");
        assert!(row["us"].as_f64().unwrap() > 0.0, "{row}");
        let kv = row["kv_heads"].as_u64().unwrap();
        let context = row["context"].as_u64().unwrap();
        assert_eq!(row["bytes"].as_u64().unwrap(), 2 * kv * context * 32 * 4);
        assert!(row["fraction_of_read"].as_f64().unwrap() > 0.0, "{row}");
    }
    let methods: Vec<&str> = rows.iter().map(|r| r["method"].as_str().unwrap()).collect();
    for method in [
        "decode",
        "decode_grouped",
        "decode_simd",
        "decode_threads",
        "read_cpu",
    ] {
        assert_eq!(
            methods.iter().filter(|&&m| m == method).count(),
            4,
            "{method}"
        );
    }
}

#[test]
fn a_rung_it_does_not_know_is_refused_with_the_ones_it_does() {
    let run = decode_cpu(&["--methods", "decode,decode_fast", "--contexts", "64"]);
    assert!(!run.status.success());
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(
        err.contains("decode_fast")
            && err.contains("decode_grouped, decode_simd, decode_threads"),
        "{err}"
    );
    assert!(run.stdout.is_empty(), "nothing measured before the refusal");
}

#[test]
fn kv_heads_that_do_not_divide_the_query_heads_are_refused() {
    let run = decode_cpu(&["--q-heads", "8", "--kv-heads", "3", "--contexts", "64"]);
    assert_eq!(run.status.code(), Some(1));
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(
        err.contains("--kv-heads 3 does not divide --q-heads 8"),
        "{err}"
    );
    assert!(run.stdout.is_empty(), "nothing measured before the refusal");
}
