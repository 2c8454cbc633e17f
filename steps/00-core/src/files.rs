//! Files a user makes, written whole or not at all.
//!
//! A checkpoint, a run's JSON, the benchmark's rows, `attend`'s `.npy` results: each is
//! written to a temporary file in the target's own folder, flushed to the disk, then renamed
//! over the target. A rename within one folder is atomic on every file system a reader is
//! likely to use, so the target is at every moment either the old file, whole, or the new
//! one, whole: a full disk, a file-size limit or a Ctrl-C half-way through the write leaves
//! the old file as it was (PyTorch's `torch.save` to a path and safetensors' writers do the
//! same). Several files that belong together ([`Staged`]) are all written first and renamed
//! only once every one of them is whole.
//!
//! Every output path is also checked before the work starts ([`check_output`]), so a run
//! that cannot save does not find out at its end.

use std::fmt;
use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Why a file could not be checked or written: the path, and what went wrong in words that
/// say what to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileError {
    pub path: PathBuf,
    pub what: String,
}

impl fmt::Display for FileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.what)
    }
}

impl std::error::Error for FileError {}

impl FileError {
    fn io(path: &Path, e: io::Error) -> Self {
        let what = match e.raw_os_error() {
            // EFBIG, ENOSPC, EDQUOT: say it in words, the OS's text is terse
            Some(27) => format!(
                "{e} (a file-size limit was reached; the old file, if any, is unchanged)"
            ),
            Some(28) | Some(122) => {
                format!("{e} (the disk is full; the old file, if any, is unchanged)")
            }
            _ => format!("{e} (the old file, if any, is unchanged)"),
        };
        FileError {
            path: path.to_path_buf(),
            what,
        }
    }
}

// ANCHOR: check_output
/// Checks, before any work, that `path` can be written as the output of the flag `flag`
/// (`--out`, say): its folder exists and takes new files, and `path` is not itself a folder.
/// Nothing is created or changed; the message names the flag and says what to do.
pub fn check_output(flag: &str, path: &Path) -> Result<(), FileError> {
    let err = |what: String| FileError {
        path: path.to_path_buf(),
        what,
    };
    if path.as_os_str().is_empty() {
        return Err(err(format!(
            "{flag} is empty: give the path of a file to write"
        )));
    }
    if path.is_dir() {
        return Err(err(format!(
            "{flag} names a folder; give the path of a file inside it"
        )));
    }
    let dir = parent(path);
    if !dir.is_dir() {
        return Err(err(format!(
            "{flag}: the folder {} does not exist; create it first (mkdir -p) or choose another path",
            dir.display()
        )));
    }
    // the one sure test of "can I write here" is to try: a temporary file, removed at once
    let probe = temporary(path);
    match File::create_new(&probe) {
        Ok(_) => {
            let _ = fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(err(format!(
            "{flag}: cannot write in the folder {}: {e}",
            dir.display()
        ))),
    }
}
// ANCHOR_END: check_output

/// Checks, before any work, that `dir` can hold the outputs of the flag `flag`: it is a
/// folder that takes new files, or it does not exist yet and its parent is such a folder
/// (it will be made). Nothing is created or changed.
pub fn check_output_dir(flag: &str, dir: &Path) -> Result<(), FileError> {
    let err = |what: String| FileError {
        path: dir.to_path_buf(),
        what,
    };
    if dir.exists() && !dir.is_dir() {
        return Err(err(format!(
            "{flag} names a file, not a folder; give a folder (it is made if it does not exist)"
        )));
    }
    let mut existing = dir;
    while !existing.as_os_str().is_empty() && !existing.exists() {
        existing = parent(existing);
    }
    if !existing.is_dir() {
        return Err(err(format!(
            "{flag}: {} is not a folder, so no folder can be made inside it",
            existing.display()
        )));
    }
    check_output(flag, &existing.join("probe")).map_err(|e| err(e.what))
}

// ANCHOR: write_atomic
/// Writes `path` whole or not at all: `write` fills a temporary file in the same folder,
/// which is flushed to the disk and then renamed over `path`. If `write` fails, or the disk
/// fills, or the process is stopped half-way, `path` is as it was and the temporary file is
/// removed (or, after a kill, left under a name that starts with `.` and ends in `.tmp`).
pub fn write_atomic_with<F>(path: &Path, write: F) -> Result<(), FileError>
where
    F: FnOnce(&mut dyn Write) -> io::Result<()>,
{
    let tmp = temporary(path);
    let result = (|| {
        let file = File::create_new(&tmp)?;
        let mut w = BufWriter::new(file);
        write(&mut w)?;
        let file = w.into_inner().map_err(|e| e.into_error())?;
        // the bytes reach the disk before the name points at them
        file.sync_all()?;
        fs::rename(&tmp, path)
    })();
    match result {
        Ok(()) => {
            sync_dir(path);
            Ok(())
        }
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(FileError::io(path, e))
        }
    }
}
// ANCHOR_END: write_atomic

/// [`write_atomic_with`] for bytes already in memory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), FileError> {
    write_atomic_with(path, |w| w.write_all(bytes))
}

/// Several files that belong together (`attend`'s outputs, say), written all or none: each
/// is written whole to its temporary file by [`Staged::add`], and only [`Staged::commit`]
/// renames them over their targets, once every one was written. Dropped without a commit
/// (an error on the way), it removes what it wrote and leaves every target as it was.
#[derive(Debug, Default)]
pub struct Staged {
    /// (temporary file, target), in the order they were added
    files: Vec<(PathBuf, PathBuf)>,
}

impl Staged {
    pub fn new() -> Self {
        Staged::default()
    }

    /// Writes `path`'s new contents to its temporary file.
    pub fn add<F>(&mut self, path: &Path, write: F) -> Result<(), FileError>
    where
        F: FnOnce(&mut dyn Write) -> io::Result<()>,
    {
        let tmp = temporary(path);
        // recorded first, so that a failure below still removes what was begun
        self.files.push((tmp.clone(), path.to_path_buf()));
        let result = (|| {
            let mut w = BufWriter::new(File::create_new(&tmp)?);
            write(&mut w)?;
            w.into_inner().map_err(|e| e.into_error())?.sync_all()
        })();
        result.map_err(|e| FileError::io(path, e))
    }

    /// Renames every file over its target. The renames are each atomic; between them a
    /// crash can leave some targets new and some old, never one half-written.
    pub fn commit(mut self) -> Result<(), FileError> {
        let mut files = std::mem::take(&mut self.files).into_iter();
        while let Some((tmp, path)) = files.next() {
            if let Err(e) = fs::rename(&tmp, &path) {
                // this one and the ones not renamed yet leave no temporary file behind
                let _ = fs::remove_file(&tmp);
                for (rest, _) in files {
                    let _ = fs::remove_file(rest);
                }
                return Err(FileError::io(&path, e));
            }
            sync_dir(&path);
        }
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        for (tmp, _) in &self.files {
            let _ = fs::remove_file(tmp);
        }
    }
}

/// The folder `path` is in (`.` for a bare file name).
fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// A fresh name beside `path`: hidden, with this process's id and a counter, so two writers
/// never share one.
fn temporary(path: &Path) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    parent(path).join(format!(".{name}.{}-{n}.tmp", std::process::id()))
}

/// Makes the rename itself durable where the platform allows it (a folder is synced on Unix
/// by opening it); elsewhere, and on any failure, this is a no-op: the rename was done.
fn sync_dir(path: &Path) {
    #[cfg(unix)]
    if let Ok(dir) = File::open(parent(path)) {
        let _ = dir.sync_all();
    }
    #[cfg(not(unix))]
    let _ = path;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("flash-files-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn leftovers(dir: &Path) -> Vec<String> {
        fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect()
    }

    #[test]
    fn a_write_that_fails_half_way_leaves_the_old_file_whole() {
        let dir = folder("half");
        let path = dir.join("ckpt.bin");
        write_atomic(&path, b"the good old checkpoint").unwrap();
        let err = write_atomic_with(&path, |w| {
            w.write_all(b"half of a new")?;
            Err(io::Error::other("the disk is gone"))
        })
        .unwrap_err();
        assert!(err.to_string().contains("the disk is gone"), "{err}");
        assert_eq!(fs::read(&path).unwrap(), b"the good old checkpoint");
        assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
        write_atomic(&path, b"new").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"new");
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn staged_files_are_all_written_or_none() {
        let dir = folder("staged");
        let (a, b) = (dir.join("out.npy"), dir.join("lse.npy"));
        write_atomic(&a, b"old a").unwrap();
        write_atomic(&b, b"old b").unwrap();
        {
            let mut staged = Staged::new();
            staged.add(&a, |w| w.write_all(b"new a")).unwrap();
            assert!(
                staged
                    .add(&b, |_| Err(io::Error::other("NaN in dout")))
                    .is_err()
            );
            // dropped without a commit
        }
        assert_eq!(fs::read(&a).unwrap(), b"old a");
        assert_eq!(fs::read(&b).unwrap(), b"old b");
        assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
        let mut staged = Staged::new();
        staged.add(&a, |w| w.write_all(b"new a")).unwrap();
        staged.add(&b, |w| w.write_all(b"new b")).unwrap();
        staged.commit().unwrap();
        assert_eq!(fs::read(&a).unwrap(), b"new a");
        assert_eq!(fs::read(&b).unwrap(), b"new b");
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn output_paths_are_checked_with_the_flag_named() {
        let dir = folder("check");
        check_output("--out", &dir.join("rows.json")).unwrap();
        assert!(leftovers(&dir).is_empty());
        let missing = check_output("--out", &dir.join("no/such/rows.json")).unwrap_err();
        assert!(
            missing.what.contains("--out") && missing.what.contains("does not exist"),
            "{missing}"
        );
        let folder_given = check_output("--save", &dir).unwrap_err();
        assert!(
            folder_given.what.contains("--save names a folder"),
            "{folder_given}"
        );
        assert!(check_output("--out", Path::new("")).is_err());
        check_output_dir("--out-dir", &dir.join("new/deeper")).unwrap();
        let file = dir.join("a-file");
        fs::write(&file, b"x").unwrap();
        let e = check_output_dir("--out-dir", &file).unwrap_err();
        assert!(e.what.contains("names a file"), "{e}");
        let e = check_output_dir("--out-dir", &file.join("below")).unwrap_err();
        assert!(e.what.contains("is not a folder"), "{e}");
        fs::remove_dir_all(dir).unwrap();
    }
}
