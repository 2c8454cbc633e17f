//! What a careless user, a full disk or a Ctrl-C does to a run, injected on purpose: a
//! checkpoint save cut off half-way leaves the old checkpoint whole; a run stopped by SIGINT
//! saves, says how to go on, and the resumed run takes, bit for bit, the steps of a run that
//! never stopped; bad numbers are refused naming their flag; an output that cannot be
//! written is refused before any training. The trainer's own binary runs each case, on a
//! tiny model and a corpus of this crate's sources, in a fresh folder.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use step05_train::model::{Config, Params};
use step05_train::train::{RunRecord, Utf8Stream, pick};
use step05_train::{Checkpoint, sample};

/// The trainer's binary, as cargo built it for these tests.
const TRAIN: &str = env!("CARGO_BIN_EXE_step05-train");

/// A model small enough that a step takes milliseconds: its checkpoint with the optimizer's
/// moments is 268 KB.
const TINY: &[&str] = &[
    "--layers",
    "1",
    "--d-model",
    "32",
    "--heads",
    "2",
    "--context",
    "32",
    "--batch",
    "4",
    "--warmup",
    "5",
    "--eval-every",
    "10",
    "--eval-batches",
    "2",
];

/// A fresh folder for one test, holding the corpus as a token file (`corpus.tokens`).
fn folder(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("step05-faults-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    common::corpus().save(&dir.join("corpus.tokens")).unwrap();
    dir
}

/// `train` in `dir` on its corpus, with the tiny model and `args`.
fn train(dir: &Path, args: &[&str]) -> Output {
    Command::new(TRAIN)
        .current_dir(dir)
        .args(["train", "--data", "corpus.tokens"])
        .args(TINY)
        .args(args)
        .output()
        .expect("the trainer runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn losses(run: &RunRecord) -> Vec<(usize, u32)> {
    run.steps
        .iter()
        .map(|s| (s.step, s.loss.to_bits()))
        .collect()
}

fn record(path: &Path) -> RunRecord {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
#[cfg(unix)] // sh, ulimit and signals
fn a_save_cut_off_half_way_leaves_the_old_checkpoint_whole() {
    let dir = folder("save");
    let done = train(&dir, &["--steps", "3", "--save", "ckpt.safetensors"]);
    assert!(done.status.success(), "{}", text(&done.stderr));
    let good = std::fs::read(dir.join("ckpt.safetensors")).unwrap();
    // 200 blocks (of 512 bytes in a POSIX sh, 1024 in bash): well below the 268 KB a save
    // writes, and far above anything else the run writes
    assert!(good.len() > 200 * 1024, "{} bytes", good.len());
    for (how, trap) in [
        ("SIGXFSZ ignored", "trap '' XFSZ; "),
        ("killed by SIGXFSZ", ""),
    ] {
        let script = format!(
            "{trap}ulimit -f 200; exec \"$0\" train --data corpus.tokens {} --steps 6 \
             --resume ckpt.safetensors --save ckpt.safetensors",
            TINY.join(" ")
        );
        let o = Command::new("sh")
            .current_dir(&dir)
            .args(["-c", &script, TRAIN])
            .output()
            .unwrap();
        assert!(
            !o.status.success(),
            "{how}: the save went through: {}",
            text(&o.stdout)
        );
        if trap.is_empty() {
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(
                o.status.signal(),
                Some(libc::SIGXFSZ),
                "{how}: {:?}",
                o.status
            );
        } else {
            let err = text(&o.stderr);
            assert!(err.contains("file-size limit"), "{how}: {err}");
            assert!(!err.contains("panicked"), "{how}: {err}");
        }
        let after = std::fs::read(dir.join("ckpt.safetensors")).unwrap();
        assert!(
            after == good,
            "{how}: the old checkpoint changed ({} bytes now)",
            after.len()
        );
        let ckpt = Checkpoint::load(&dir.join("ckpt.safetensors")).unwrap();
        assert_eq!(ckpt.step, 3, "{how}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
#[cfg(unix)] // sh, ulimit and signals
fn a_run_stopped_by_sigint_and_resumed_takes_the_steps_of_one_that_never_stopped() {
    let dir = folder("interrupt");
    // long enough that SIGINT, sent once step 3 is printed, lands well before the end (a
    // step takes about 2 ms here)
    let steps = "150";
    let straight = train(
        &dir,
        &[
            "--steps",
            steps,
            "--out",
            "straight.json",
            "--save",
            "straight.safetensors",
        ],
    );
    assert!(straight.status.success(), "{}", text(&straight.stderr));

    // no --save: the checkpoint goes to a new file that the run names
    let mut child = Command::new(TRAIN)
        .current_dir(&dir)
        .args(["train", "--data", "corpus.tokens"])
        .args(TINY)
        .args(["--steps", steps, "--out", "stopped.json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut printed = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        let at_step_3 = line.starts_with("step     3/");
        printed.push(line);
        if at_step_3 {
            // SAFETY: a plain kill(2) of our own child, which has not been waited for
            assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
            break;
        }
    }
    printed.extend(lines.map(|l| l.unwrap()));
    let status = child.wait().unwrap();
    let stdout = printed.join("\n");
    assert_eq!(status.code(), Some(130), "{stdout}");
    let stopped_at: usize = stdout
        .split("interrupted after step ")
        .nth(1)
        .and_then(|rest| rest.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no interruption reported: {stdout}"));
    assert!((3..150).contains(&stopped_at), "{stdout}");
    let checkpoint = format!("train-interrupted-{stopped_at}.safetensors");
    assert!(dir.join(&checkpoint).is_file(), "{stdout}");
    assert_eq!(record(&dir.join("stopped.json")).steps.len(), stopped_at);

    // the command it printed, as a user would paste it
    let resume = printed
        .iter()
        .skip_while(|l| !l.starts_with("to go on from step"))
        .nth(1)
        .unwrap_or_else(|| panic!("no command to resume: {stdout}"));
    assert!(
        resume.contains(&format!("--resume {checkpoint}")),
        "{resume}"
    );
    let resumed = Command::new("sh")
        .current_dir(&dir)
        .args(["-c", resume])
        .output()
        .unwrap();
    assert!(
        resumed.status.success(),
        "{resume}: {}",
        text(&resumed.stderr)
    );

    // the stopped run's record, continued, holds every step: the same losses, bit for bit
    let (all, parts) = (
        record(&dir.join("straight.json")),
        record(&dir.join("stopped.json")),
    );
    assert_eq!(parts.steps.len(), 150);
    assert_eq!(losses(&parts), losses(&all));
    let a = Checkpoint::load(&dir.join("straight.safetensors")).unwrap();
    let b = Checkpoint::load(&dir.join(&checkpoint)).unwrap();
    assert!(
        a == b,
        "the weights or the optimizer differ after the resumed run"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn save_every_writes_a_checkpoint_along_the_way() {
    let dir = folder("every");
    let o = train(
        &dir,
        &[
            "--steps",
            "12",
            "--save-every",
            "5",
            "--save",
            "c.safetensors",
        ],
    );
    let out = text(&o.stdout);
    assert!(o.status.success(), "{}", text(&o.stderr));
    for step in [5, 10] {
        assert!(
            out.contains(&format!(
                "step {step:>5} | checkpoint saved to c.safetensors"
            )),
            "{out}"
        );
    }
    assert_eq!(
        Checkpoint::load(&dir.join("c.safetensors")).unwrap().step,
        12
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_resumed_run_with_other_settings_or_text_says_where_it_differs() {
    let dir = folder("differs");
    let first = train(&dir, &["--steps", "4", "--save", "c.safetensors"]);
    assert!(first.status.success(), "{}", text(&first.stderr));
    let same = train(&dir, &["--steps", "4", "--resume", "c.safetensors"]);
    assert!(
        !text(&same.stdout).contains("note:"),
        "{}",
        text(&same.stdout)
    );
    let other = train(
        &dir,
        &["--steps", "4", "--resume", "c.safetensors", "--seed", "7"],
    );
    let out = text(&other.stdout);
    assert!(
        out.contains("note: this run is not the one that saved"),
        "{out}"
    );
    assert!(out.contains("seed: 1337 then, 7 now"), "{out}");
    // other text: the same corpus less its last byte
    let mut corpus = common::corpus();
    corpus.train.pop();
    corpus.save(&dir.join("corpus.tokens")).unwrap();
    let out = text(&train(&dir, &["--steps", "4", "--resume", "c.safetensors"]).stdout);
    assert!(out.contains("corpus: "), "{out}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn text_printed_as_it_comes_is_the_text_printed_at_the_end() {
    let cases: [&[u8]; 5] = [
        "plain ascii".as_bytes(),
        "é, ∑ and 🦀 split over bytes".as_bytes(),
        &[b'a', 0xff, b'b', 0xc3],
        &[0xe2, 0x88, b'x', 0xf0, 0x9f, 0xa6],
        &[0xed, 0xa0, 0x80, 0xc0, 0xaf],
    ];
    for bytes in cases {
        let mut stream = Utf8Stream::default();
        let mut shown: String = bytes.iter().map(|&b| stream.push(b)).collect();
        shown.push_str(&stream.finish());
        assert_eq!(shown, String::from_utf8_lossy(bytes), "{bytes:?}");
    }
}

/// `args` must fail before the corpus loads, with a message that names `flag`.
fn refused(bin: &str, args: &[&str], flag: &str) {
    let o = Command::new(bin).args(args).output().unwrap();
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert!(!o.status.success(), "{args:?} ran: {out}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    assert!(err.contains(flag), "{args:?}: {err:?} does not name {flag}");
    assert!(
        !out.contains("corpus:"),
        "{args:?} loaded the corpus first: {out}"
    );
}

#[test]
fn every_float_flag_refuses_nan_infinities_and_negatives_naming_the_flag() {
    for flag in [
        "--lr",
        "--min-lr-frac",
        "--weight-decay",
        "--clip",
        "--max-seconds",
    ] {
        for bad in ["NaN", "inf", "-inf", "-1"] {
            refused(
                TRAIN,
                &["train", "--data", "/no/such/corpus", flag, bad],
                flag,
            );
        }
    }
    // and the values that make no sense
    refused(TRAIN, &["train", "--lr", "1e30"], "--lr");
    refused(TRAIN, &["train", "--lr", "0"], "--lr");
    refused(TRAIN, &["train", "--min-lr-frac", "2"], "--min-lr-frac");
    refused(TRAIN, &["train", "--clip", "0"], "--clip");
    for bad in ["NaN", "inf", "-1"] {
        let args = [
            "sample",
            "--checkpoint",
            "/no/such/ckpt",
            "--temperature",
            bad,
        ];
        refused(TRAIN, &args, "--temperature");
    }
}

#[test]
fn an_output_that_cannot_be_written_is_refused_before_training() {
    let dir = folder("outputs");
    let file = dir.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let in_a_file = file.join("out.json");
    let no_folder = dir.join("no/such/folder/out.json");
    for flag in [
        "--out",
        "--save",
        "--save-tokens",
        "--save-init",
        "--dump-batches",
    ] {
        for path in [&no_folder, &in_a_file, &dir] {
            let o = train(&dir, &["--steps", "1000", flag, path.to_str().unwrap()]);
            let (out, err) = (text(&o.stdout), text(&o.stderr));
            assert!(!o.status.success(), "{flag} {path:?} ran: {out}");
            assert!(err.contains(flag), "{flag} {path:?}: {err}");
            assert!(
                !out.contains("corpus:"),
                "{flag} {path:?} loaded the corpus: {out}"
            );
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn dumping_the_batches_of_a_huge_run_is_refused_with_the_bytes_it_needs() {
    let dir = folder("dump");
    let o = train(
        &dir,
        &["--steps", "1000000000000000000", "--dump-batches", "b.bin"],
    );
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    // 10¹⁸ steps × 4 sequences × 33 bytes, and 2 held-out batches
    assert!(err.contains("need 132000000000000000264 bytes"), "{err}");
    assert!(!dir.join("b.bin").exists());
    std::fs::remove_dir_all(dir).unwrap();
}

const SMALL: Config = Config {
    layers: 1,
    d_model: 32,
    heads: 2,
    kv_heads: 2, // [step 08]
    context: 32,
    vocab: 256,
};

#[test]
fn a_temperature_near_zero_takes_the_likeliest_byte() {
    // 0.5^(1/10⁻⁶) underflows to 0 for every byte; in log space the likeliest weighs 1
    let mut rng = flash_core::inputs::SplitMix64::new(1);
    let mut probs = [0.0f32; 256];
    probs[7] = 0.3;
    probs[b'a' as usize] = 0.5;
    probs[200] = 0.2;
    for t in [1e-6, 1e-30, f32::MIN_POSITIVE] {
        assert_eq!(pick(&probs, t, &mut rng), b'a', "τ = {t}");
    }
    let params = Params::init(SMALL, 3).unwrap();
    let greedy = sample(&params, b"fn ", 40, 0.0, 9).unwrap();
    assert_eq!(sample(&params, b"fn ", 40, 1e-6, 9).unwrap(), greedy);
    let err = sample(&params, b"fn ", 4, f32::NAN, 9)
        .unwrap_err()
        .to_string();
    assert!(err.contains("temperature"), "{err}");
}

#[test]
fn a_checkpoint_with_a_nan_weight_is_refused_naming_the_file_and_the_tensor() {
    let mut params = Params::init(SMALL, 3).unwrap();
    params.blocks[0].fc_w[[1, 2]] = f32::NAN;
    let path = std::env::temp_dir().join(format!(
        "step05-faults-nan-{}.safetensors",
        std::process::id()
    ));
    let ckpt = Checkpoint {
        params,
        opt: None,
        step: 0,
    };
    ckpt.save(&path).unwrap();
    let err = Checkpoint::load(&path).unwrap_err().to_string();
    std::fs::remove_file(&path).unwrap();
    assert!(err.contains(&path.display().to_string()), "{err}");
    assert!(
        err.contains("h.0.mlp.c_fc.weight") && err.contains("NaN"),
        "{err}"
    );
}
