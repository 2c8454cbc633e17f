//! What the tests share: text to train on.
// [step 07]
//! And the trainer's binary, run with arguments it must refuse.
// [/step 07]

// [step 07]
// a test file takes what it needs of these
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

// [/step 07]
use step05_train::Corpus;

/// Text to draw batches from: this crate's own sources, embedded so the test binary carries
/// them to the GPU machine.
pub fn corpus() -> Corpus {
    let train = [
        include_str!("../../src/model.rs"),
        include_str!("../../src/layers.rs"),
        include_str!("../../src/train.rs"),
        include_str!("../../src/data.rs"),
    ];
    let heldout = [
        include_str!("../../src/optim.rs"),
        include_str!("../../src/checkpoint.rs"),
    ];
    // [step 09]
    // where each file begins in its part: the sums of the lengths before it
    let starts = |files: &[&str]| {
        let mut at = 0;
        let mut starts = Vec::new();
        for f in files {
            starts.push(at);
            at += f.len();
        }
        starts
    };
    // [/step 09]
    Corpus {
        source: "step05-train's sources".into(),
        train: train.concat().into_bytes(),
        heldout: heldout.concat().into_bytes(),
        train_files: 4,
        heldout_files: 2,
        train_file_starts: starts(&train),     // [step 09]
        heldout_file_starts: starts(&heldout), // [step 09]
    }
}
// [step 07]

/// The trainer's binary as cargo built it, or beside this test binary on the GPU machine
/// (`.gpu/bin/` next to `.gpu/tests/`).
pub fn binary() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_BIN_EXE_step05-train"));
    if built.exists() {
        return built;
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("bin/step05-train")))
        .filter(|p| p.exists())
        .unwrap_or(built)
}

pub fn run(args: &[&str]) -> Output {
    Command::new(binary())
        .args(args)
        .output()
        .expect("the trainer's binary runs")
}

/// Runs `train` with `args`, which must fail with a message containing each of `want`,
/// before the corpus loads.
pub fn refused(args: &[&str], want: &[&str]) {
    let mut all = vec!["train"];
    all.extend_from_slice(args);
    let o = run(&all);
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(!o.status.success(), "{args:?} ran: {out}");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert!(err.starts_with("error: "), "{args:?}: {err}");
    for w in want {
        assert!(err.contains(w), "{args:?}: {err:?} lacks {w:?}");
    }
    assert!(
        !out.contains("corpus:"),
        "{args:?} loaded the corpus first: {out}"
    );
}
// [/step 07]
