//! `generate` as a careless user runs it: numbers it cannot use and an `--out` it cannot
//! write are refused before the model loads, naming the flag; a temperature near 0 writes
//! the bytes of temperature 0.

use std::process::{Command, Output};

const GENERATE: &str = env!("CARGO_BIN_EXE_generate");

fn run(args: &[&str]) -> Output {
    Command::new(GENERATE)
        .args(args)
        .output()
        .expect("generate runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn bad_numbers_and_outputs_are_refused_naming_the_flag() {
    let cases: &[(&[&str], &str)] = &[
        (&["--temperature", "NaN"], "--temperature"),
        (&["--temperature", "inf"], "--temperature"),
        (&["--temperature", "-1"], "--temperature"),
        (&["--runs", "0"], "--runs"),
        (&["--out", "/no/such/folder/rows.json"], "--out"),
    ];
    for (args, flag) in cases {
        let o = run(args);
        let (out, err) = (text(&o.stdout), text(&o.stderr));
        assert!(!o.status.success(), "{args:?} ran: {out}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?}: {err:?} does not name {flag}");
        assert!(
            !out.contains("model:"),
            "{args:?} loaded the model first: {out}"
        );
    }
}

#[test]
fn an_out_that_is_not_a_list_of_rows_is_refused_before_the_model_loads() {
    let path =
        std::env::temp_dir().join(format!("generate-cli-{}.json", std::process::id()));
    std::fs::write(&path, b"{\"not\": \"rows\"}").unwrap();
    let o = run(&["--out", path.to_str().unwrap()]);
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(std::fs::read(&path).unwrap(), b"{\"not\": \"rows\"}");
    std::fs::remove_file(&path).unwrap();
    assert!(!o.status.success(), "{out}");
    assert!(err.contains("not a list of generate's rows"), "{err}");
    assert!(!out.contains("model:"), "the model loaded first: {out}");
}

#[test]
fn a_temperature_near_zero_writes_the_likeliest_bytes() {
    // the text is the line after the model's two; a run's speed follows it
    let text_of = |t: &str| {
        let o = run(&[
            "--model",
            "small",
            "--prompt",
            "fn ",
            "--count",
            "24",
            "--runs",
            "1",
            "--temperature",
            t,
        ]);
        assert!(o.status.success(), "{}", text(&o.stderr));
        let out = text(&o.stdout);
        let line = out.lines().nth(2).expect("the text").to_string();
        assert!(!line.contains('\0'), "τ = {t}: NUL bytes in {line:?}");
        line
    };
    assert_eq!(text_of("1e-6"), text_of("0"));
}
