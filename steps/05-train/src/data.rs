//! The text the model learns from: bytes of real files, split into training and held-out
//! text by file, and batches drawn from a seed.
//!
//! The default corpus is the Rust source of the crates `Cargo.lock` pins, which cargo has
//! unpacked under `$CARGO_HOME/registry/src/*/<name>-<version>/` on every machine that
//! built this repository: tens of megabytes of real code, no download. Any text file or
//! folder will do instead, or a token file written by [`Corpus::save`].

use std::fs;
use std::path::{Path, PathBuf};

use flash_core::files;
use flash_core::inputs::SplitMix64;
use ndarray::Array2;
use step09_masks::Documents; // [step 09]

use crate::TrainError;

/// One in this many files is held out (chosen by a hash of its path, so the same files on
/// every machine and in every run).
pub const HELDOUT_ONE_IN: u64 = 10;

/// The first bytes of a token file.
const MAGIC: &[u8; 8] = b"GPTBYTES";

/// Training and held-out tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Corpus {
    /// Where it came from, for the run's record.
    pub source: String,
    pub train: Vec<u8>,
    pub heldout: Vec<u8>,
    pub train_files: usize,
    pub heldout_files: usize,
    // [step 09]
    /// Where each file begins in `train`, increasing from 0: the boundaries that
    /// `train --documents` keeps attention from crossing. Empty where they are not known
    /// (a token file keeps none).
    pub train_file_starts: Vec<usize>,
    /// The same for `heldout`.
    pub heldout_file_starts: Vec<usize>,
    // [/step 09]
}

/// FNV-1a of a path's bytes: a hash that never changes with the toolchain (std's `Hasher`
/// may).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Every file under `dir` whose name ends in one of `exts` (all files when `exts` is
/// empty), sorted, skipping hidden files and folders.
pub fn files_under(
    dir: &Path,
    exts: &[&str],
    out: &mut Vec<PathBuf>,
) -> Result<(), TrainError> {
    let entries = fs::read_dir(dir).map_err(|e| TrainError::io(dir, e))?;
    let mut paths: Vec<PathBuf> =
        entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for path in paths {
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if name.starts_with('.') {
            continue;
        }
        if path.is_dir() {
            files_under(&path, exts, out)?;
        } else if exts.is_empty() || exts.iter().any(|e| name.ends_with(e)) {
            out.push(path);
        }
    }
    Ok(())
}

impl Corpus {
    /// Files split by a hash of their key (a path relative to the corpus's root): one in
    /// [`HELDOUT_ONE_IN`] is held out.
    fn split_files(
        source: String,
        files: &[(String, PathBuf)],
    ) -> Result<Corpus, TrainError> {
        let mut corpus = Corpus {
            source,
            train: Vec::new(),
            heldout: Vec::new(),
            train_files: 0,
            heldout_files: 0,
            train_file_starts: Vec::new(),   // [step 09]
            heldout_file_starts: Vec::new(), // [step 09]
        };
        for (key, file) in files {
            let bytes = fs::read(file).map_err(|e| TrainError::io(file, e))?;
            // [step 09]
            // an empty file starts no document
            if !bytes.is_empty() {
                let held = fnv1a(key.as_bytes()).is_multiple_of(HELDOUT_ONE_IN);
                let (part, starts) = match held {
                    true => (&corpus.heldout, &mut corpus.heldout_file_starts),
                    false => (&corpus.train, &mut corpus.train_file_starts),
                };
                starts.push(part.len());
            }
            // [/step 09]
            if fnv1a(key.as_bytes()).is_multiple_of(HELDOUT_ONE_IN) {
                corpus.heldout.extend_from_slice(&bytes);
                corpus.heldout_files += 1;
            } else {
                corpus.train.extend_from_slice(&bytes);
                corpus.train_files += 1;
            }
        }
        if corpus.train.is_empty() || corpus.heldout.is_empty() {
            return Err(TrainError::Data(format!(
                "{}: {} training and {} held-out bytes from {} files; both must be non-empty \
                 (a folder needs non-empty files on both sides of the split, one file in \
                 {HELDOUT_ONE_IN} held out by its path)",
                corpus.source,
                corpus.train.len(),
                corpus.heldout.len(),
                files.len()
            )));
        }
        Ok(corpus)
    }

    /// `files` split by their paths below `root`: the same split wherever the folder is.
    pub fn from_files(
        source: String,
        root: &Path,
        files: &[PathBuf],
    ) -> Result<Corpus, TrainError> {
        let keyed: Vec<(String, PathBuf)> =
            files.iter().map(|f| (key(root, f), f.clone())).collect();
        Corpus::split_files(source, &keyed)
    }

    /// One file split at nine tenths of its bytes.
    fn split_file(source: String, bytes: Vec<u8>) -> Corpus {
        let cut = bytes.len() - bytes.len() / HELDOUT_ONE_IN as usize;
        Corpus {
            source,
            train: bytes[..cut].to_vec(),
            heldout: bytes[cut..].to_vec(),
            train_files: 1,
            heldout_files: 1,
            // [step 09]
            // one file: each part is one document
            train_file_starts: vec![0],
            heldout_file_starts: vec![0],
            // [/step 09]
        }
    }

    /// A text file, a folder (every file in it, sorted; hidden ones skipped), or a token
    /// file that [`Corpus::save`] wrote.
    pub fn load(path: &Path) -> Result<Corpus, TrainError> {
        if !path.exists() {
            return Err(TrainError::Data(format!(
                "{}: no such file or folder; --data takes a text file, a folder of text files, \
                 or a token file written by --save-tokens",
                path.display()
            )));
        }
        let source = path.display().to_string();
        if path.is_dir() {
            let mut files = Vec::new();
            files_under(path, &[], &mut files)?;
            return Corpus::from_files(source, path, &files);
        }
        let bytes = fs::read(path).map_err(|e| TrainError::io(path, e))?;
        if bytes.starts_with(MAGIC) {
            return Corpus::from_token_file(source, &bytes);
        }
        if bytes.len() < 2 {
            return Err(TrainError::Data(format!(
                "{source}: {} bytes; a text file to train on needs some text",
                bytes.len()
            )));
        }
        let corpus = Corpus::split_file(source, bytes);
        Ok(corpus)
    }

    /// The Rust sources of the crates `lock` pins from a registry, found under
    /// `cargo_home/registry/src/*/<name>-<version>/`.
    pub fn from_cargo_lock(lock: &Path, cargo_home: &Path) -> Result<Corpus, TrainError> {
        let text = fs::read_to_string(lock).map_err(|e| TrainError::io(lock, e))?;
        let registries = cargo_home.join("registry/src");
        let mut indexes: Vec<PathBuf> = fs::read_dir(&registries)
            .map_err(|e| TrainError::io(&registries, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        indexes.sort();
        let mut files = Vec::new();
        let mut crates = 0;
        for (name, version) in registry_packages(&text) {
            let found = indexes
                .iter()
                .map(|i| i.join(format!("{name}-{version}")))
                .find(|d| d.is_dir());
            if let Some(dir) = found {
                crates += 1;
                files_under(&dir, &[".rs"], &mut files)?;
            }
        }
        if files.is_empty() {
            return Err(TrainError::Data(format!(
                "no crate that {} pins is unpacked under {}: build the project once \
                 (`cargo build`), or give --data a text file or folder",
                lock.display(),
                registries.display()
            )));
        }
        // keyed by the path below the registry's index folder, `<name>-<version>/src/...`,
        // the same on every machine
        let keyed: Vec<(String, PathBuf)> = files
            .into_iter()
            .map(|f| {
                let index = indexes.iter().find(|i| f.starts_with(i));
                (key(index.map_or(Path::new(""), |i| i.as_path()), &f), f)
            })
            .collect();
        // the lock as the reader would name it: from the current folder where it lies below it
        let shown = std::env::current_dir()
            .ok()
            .and_then(|here| lock.strip_prefix(here).ok().map(Path::to_path_buf))
            .unwrap_or_else(|| lock.to_path_buf());
        let source = format!(
            "the .rs files of the {crates} crates {} pins",
            shown.display()
        );
        Corpus::split_files(source, &keyed)
    }

    /// The default corpus: the crates of the `Cargo.lock` found from the current folder up
    /// (or this repository's), in `$CARGO_HOME` (or `~/.cargo`).
    pub fn default_corpus() -> Result<Corpus, TrainError> {
        let lock = find_cargo_lock().ok_or_else(|| {
            TrainError::Data(
                "no Cargo.lock in this folder or above it; give --data a text file or folder"
                    .into(),
            )
        })?;
        let cargo_home = std::env::var_os("CARGO_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
            .ok_or_else(|| {
                TrainError::Data(
                    "neither CARGO_HOME nor HOME is set: give --data a path".into(),
                )
            })?;
        Corpus::from_cargo_lock(&lock, &cargo_home)
    }

    /// Writes the corpus, already split, as a token file: the magic bytes `GPTBYTES`, then
    /// four little-endian `u64`s (training bytes, held-out bytes, training files, held-out
    /// files), then the training bytes and the held-out bytes. Whole or not at all, streamed
    /// from the corpus without a copy of it ([`files::write_atomic_with`]).
    // [step 09]
    /// Where the corpus knows where its files begin, they follow, for `train --documents`:
    /// for each part, a `u64` count, then that many `u64` offsets.
    // [/step 09]
    pub fn save(&self, path: &Path) -> Result<(), TrainError> {
        files::write_atomic_with(path, |w| {
            w.write_all(MAGIC)?;
            for n in [
                self.train.len(),
                self.heldout.len(),
                self.train_files,
                self.heldout_files,
            ] {
                w.write_all(&(n as u64).to_le_bytes())?;
            }
            w.write_all(&self.train)?;
            w.write_all(&self.heldout)?;
            // [step 09]
            if !self.train_file_starts.is_empty() && !self.heldout_file_starts.is_empty() {
                for starts in [&self.train_file_starts, &self.heldout_file_starts] {
                    w.write_all(&(starts.len() as u64).to_le_bytes())?;
                    for &s in starts {
                        w.write_all(&(s as u64).to_le_bytes())?;
                    }
                }
            }
            // [/step 09]
            Ok(())
        })
        .map_err(TrainError::from)
    }

    fn from_token_file(source: String, bytes: &[u8]) -> Result<Corpus, TrainError> {
        let header = 8 + 4 * 8;
        let bad = |why: &str| {
            TrainError::Data(format!("{source}: not a valid token file: {why}"))
        };
        if bytes.len() < header {
            return Err(bad("shorter than its header"));
        }
        let n = |i: usize| {
            let at = 8 + 8 * i;
            u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize
        };
        let (train, heldout) = (n(0), n(1));
        // [step 09]
        // after the bytes, where each file begins, if the corpus that wrote it knew
        let end = header.saturating_add(train).saturating_add(heldout);
        let (bytes, file_starts) = match bytes.get(end..) {
            Some(trailer) if !trailer.is_empty() => (
                &bytes[..end],
                read_file_starts(trailer, train, heldout).map_err(|why| bad(&why))?,
            ),
            _ => (bytes, [Vec::new(), Vec::new()]),
        };
        let [train_file_starts, heldout_file_starts] = file_starts;
        // [/step 09]
        if bytes.len() != header + train + heldout {
            return Err(bad(&format!(
                "the header says {train} + {heldout} bytes but {} follow it",
                bytes.len() - header
            )));
        }
        if train == 0 || heldout == 0 {
            return Err(bad("no training or no held-out bytes"));
        }
        Ok(Corpus {
            source,
            train: bytes[header..header + train].to_vec(),
            heldout: bytes[header + train..].to_vec(),
            train_files: n(2),
            heldout_files: n(3),
            train_file_starts,   // [step 09]
            heldout_file_starts, // [step 09]
        })
    }

    /// The corpus in a line that changes with any of its bytes: the sizes of both parts and
    /// an FNV-1a hash of their bytes. A checkpoint keeps it, so that a run resumed on other
    /// text can say so.
    pub fn fingerprint(&self) -> String {
        let hash = fnv1a(&self.train) ^ fnv1a(&self.heldout).rotate_left(1);
        format!(
            "{} training and {} held-out bytes, FNV-1a {hash:016x}",
            self.train.len(),
            self.heldout.len()
        )
    }

    /// Checks that both parts hold at least one window of `tokens + 1` bytes (the inputs
    /// and, one further, the targets).
    pub fn check_window(&self, tokens: usize) -> Result<(), TrainError> {
        for (what, part) in [("training", &self.train), ("held-out", &self.heldout)] {
            if part.len() < tokens + 1 {
                return Err(TrainError::Data(format!(
                    "{}: {} {what} bytes, fewer than one sequence of {tokens} tokens and its next; \
                     use a larger corpus or a shorter --seq-len",
                    self.source,
                    part.len()
                )));
            }
        }
        Ok(())
    }
}
// [step 09]

/// The file starts that follow a token file's bytes ([`Corpus::save`]): for the training
/// and then the held-out part, a count and that many offsets, each list increasing from 0
/// and inside its part.
fn read_file_starts(
    trailer: &[u8],
    train: usize,
    heldout: usize,
) -> Result<[Vec<usize>; 2], String> {
    let mut words = trailer.chunks(8).map(|w| match <[u8; 8]>::try_from(w) {
        Ok(w) => Ok(u64::from_le_bytes(w)),
        Err(_) => Err("its file starts end inside a number".to_string()),
    });
    let mut part = |what: &str, len: usize| -> Result<Vec<usize>, String> {
        let short = || format!("its {what} file starts end early");
        let count = words.next().ok_or_else(short)??;
        // each offset takes 8 bytes: a count larger than the file is refused before any
        // allocation
        if count > trailer.len() as u64 / 8 {
            return Err(format!(
                "it counts {count} {what} file starts in {} bytes",
                trailer.len()
            ));
        }
        let starts = (0..count)
            .map(|_| Ok(words.next().ok_or_else(short)?? as usize))
            .collect::<Result<Vec<usize>, String>>()?;
        let ordered = starts.first() == Some(&0)
            && starts.windows(2).all(|w| w[0] < w[1])
            && starts.last().is_some_and(|&s| s < len);
        if !ordered {
            return Err(format!(
                "its {what} file starts {starts:?} are not increasing from 0 below {len}"
            ));
        }
        Ok(starts)
    };
    let starts = [part("training", train)?, part("held-out", heldout)?];
    if words.next().is_some() {
        return Err("bytes follow its file starts".into());
    }
    Ok(starts)
}
// [/step 09]

/// `(name, version)` of every `[[package]]` of a `Cargo.lock` that comes from a registry.
fn registry_packages(lock: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for package in lock.split("[[package]]").skip(1) {
        let field = |key: &str| {
            package.lines().find_map(|l| {
                let rest = l.strip_prefix(key)?.trim_start().strip_prefix('=')?;
                Some(rest.trim().trim_matches('"').to_string())
            })
        };
        if let (Some(name), Some(version), Some(source)) =
            (field("name"), field("version"), field("source"))
            && source.starts_with("registry+")
        {
            out.push((name, version));
        }
    }
    out
}

/// A file's path below `root`, with `/` between folders on every system.
fn key(root: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(root).unwrap_or(file);
    rel.to_string_lossy().replace('\\', "/")
}

fn find_cargo_lock() -> Option<PathBuf> {
    let here = std::env::current_dir().ok()?;
    let from_here = here
        .ancestors()
        .map(|d| d.join("Cargo.lock"))
        .find(|p| p.is_file());
    from_here.or_else(|| {
        let built_from = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.lock");
        built_from.is_file().then_some(built_from)
    })
}

/// A batch: `inputs[b]` is a window of `tokens` bytes and `targets[b]` the same window one
/// byte later, the next token at every position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub inputs: Array2<u8>,
    pub targets: Array2<u8>,
    // [step 09]
    /// The file each input token came from (`train --documents`), `[batch, tokens]`; `None`:
    /// the windows are attended causally across files.
    pub documents: Option<Documents>,
    // [/step 09]
}

impl Batch {
    fn from_starts(data: &[u8], starts: &[usize], tokens: usize) -> Batch {
        let mut inputs = Array2::zeros((starts.len(), tokens));
        let mut targets = Array2::zeros((starts.len(), tokens));
        for (b, &start) in starts.iter().enumerate() {
            for t in 0..tokens {
                inputs[[b, t]] = data[start + t];
                targets[[b, t]] = data[start + t + 1];
            }
        }
        Batch {
            inputs,
            targets,
            documents: None, // [step 09]
        }
    }
}

// ANCHOR: batches
/// The training batch of step `step`: `batch` windows at offsets drawn from a stream of
/// `seed` and `step` alone, so a run resumed at any step sees the batches it would have
/// seen.
pub fn train_batch(
    data: &[u8],
    batch: usize,
    tokens: usize,
    seed: u64,
    step: usize,
) -> Batch {
    Batch::from_starts(
        data,
        &train_starts(data.len(), batch, tokens, seed, step),
        tokens,
    )
}

/// Where the windows of step `step` start: `batch` draws from a SplitMix64 stream seeded
/// with `seed ^ (step · 0xD1342543DE82EF95)` (wrapping), each `next_u64() % (len −
/// tokens)`.
pub fn train_starts(
    len: usize,
    batch: usize,
    tokens: usize,
    seed: u64,
    step: usize,
) -> Vec<usize> {
    let mut rng = SplitMix64::new(seed ^ (step as u64).wrapping_mul(0xD134_2543_DE82_EF95));
    let span = (len - tokens) as u64; // starts 0..span leave room for the targets
    (0..batch)
        .map(|_| (rng.next_u64() % span) as usize)
        .collect()
}

/// `count` held-out batches at offsets spread evenly over the held-out bytes: the same
/// every time, so one run's held-out losses can be compared with each other and with
/// another run's.
pub fn heldout_batches(
    data: &[u8],
    batch: usize,
    tokens: usize,
    count: usize,
) -> Vec<Batch> {
    heldout_starts(data.len(), batch, tokens, count)
        .iter()
        .map(|starts| Batch::from_starts(data, starts, tokens))
        .collect()
}

/// Where the windows of each held-out batch start: window `i` of all `batch · count` at
/// `i · (len − tokens) / (batch · count)`.
pub fn heldout_starts(
    len: usize,
    batch: usize,
    tokens: usize,
    count: usize,
) -> Vec<Vec<usize>> {
    let span = len - tokens;
    let windows = batch * count;
    (0..count)
        .map(|c| {
            (0..batch)
                .map(|b| (c * batch + b) * span / windows)
                .collect()
        })
        .collect()
}
// ANCHOR_END: batches

/// The windows of `starts`, `tokens + 1` bytes each (the inputs and, one further, the last
/// target), one after another: what `--dump-batches` writes for a peer trainer to read.
pub fn windows(data: &[u8], starts: &[usize], tokens: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(starts.len() * (tokens + 1));
    for &s in starts {
        out.extend_from_slice(&data[s..s + tokens + 1]);
    }
    out
}
// [step 09]

// ANCHOR: window_documents
/// The document of every token of windows of `tokens` bytes at `starts`, in a part of the
/// corpus whose files begin at `file_starts` (increasing, from 0): `[windows, tokens]` ids
/// for step 09's document mask, counted from 0 in each window. A token sees the earlier
/// tokens of its own window that come from the same file, and no other.
pub fn window_documents(
    file_starts: &[usize],
    starts: &[usize],
    tokens: usize,
) -> Documents {
    // the files that have begun at or before byte `at`
    let begun = |at: usize| file_starts.partition_point(|&f| f <= at);
    let mut ids = Vec::with_capacity(starts.len() * tokens);
    for &s in starts {
        let first = begun(s);
        ids.extend((0..tokens).map(|t| (begun(s + t) - first) as i32));
    }
    Documents::from_ids(starts.len(), tokens, ids)
        .expect("a window's files are counted in order, so its ids never go down")
}
// ANCHOR_END: window_documents

impl Corpus {
    /// Checks that the corpus knows where its files begin, as `--documents` needs.
    pub fn check_documents(&self) -> Result<(), TrainError> {
        if self.train_file_starts.is_empty() || self.heldout_file_starts.is_empty() {
            return Err(TrainError::Data(format!(
                "--documents: {} does not say where its files begin (a token file written \
                 before step 09 keeps the bytes only); accepted: --data with a text file, a \
                 folder of files, a token file written by --save-tokens from one of them, or \
                 the default corpus",
                self.source
            )));
        }
        Ok(())
    }

    /// The file of every token of [`train_batch`]'s windows, for `train --documents`.
    pub fn train_documents(
        &self,
        batch: usize,
        tokens: usize,
        seed: u64,
        step: usize,
    ) -> Documents {
        let starts = train_starts(self.train.len(), batch, tokens, seed, step);
        window_documents(&self.train_file_starts, &starts, tokens)
    }

    /// [`heldout_batches`] with the file of every token, for `train --documents`.
    pub fn heldout_batches_documents(
        &self,
        batch: usize,
        tokens: usize,
        count: usize,
    ) -> Vec<Batch> {
        heldout_starts(self.heldout.len(), batch, tokens, count)
            .iter()
            .map(|starts| Batch {
                documents: Some(window_documents(
                    &self.heldout_file_starts,
                    starts,
                    tokens,
                )),
                ..Batch::from_starts(&self.heldout, starts, tokens)
            })
            .collect()
    }
}
// [/step 09]
