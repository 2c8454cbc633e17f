//! Bakes into the crate the commit its binaries are built from, as `FLASH_COMMIT` (read by
//! [`row::COMMIT`](src/row.rs)): a JSON row names the commit of the code that measured it,
//! even where the binary runs on a machine without the source or git.
//!
//! The commit is `git rev-parse --short HEAD`, with `-dirty` when tracked files differ from
//! it, and only when the git repository around this crate is this one (its top level holds
//! this crate at `steps/00-core`): a copy of the tree placed inside another repository is
//! not that repository's commit, it is `unknown`, as is a tree outside git. Cargo runs this
//! again when HEAD, the branch it names or the index change (git's own files, found through
//! `git rev-parse --git-path`, which also finds them for a worktree, whose `.git` is a
//! file): a commit, a checkout or a `git add`, not every edit, so the dirty mark is the
//! tree's state at the last of those.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let here =
        PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let commit = commit(&here).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=FLASH_COMMIT={commit}");
}

/// `git args…` run in `dir`, its output trimmed; `None` if git is missing or fails.
fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        // status must not refresh the index: that would change a file watched below
        .args(["--no-optional-locks"])
        .args(args)
        .current_dir(dir)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn commit(here: &Path) -> Option<String> {
    let top = PathBuf::from(git(here, &["rev-parse", "--show-toplevel"])?);
    let ours =
        top.join("steps/00-core").canonicalize().ok()? == here.canonicalize().ok()?;
    if !ours {
        return None;
    }
    // what cargo watches: HEAD, the branch HEAD names (loose, or packed with the others),
    // the index; absolute paths, as a worktree keeps some of them outside the tree
    let mut watched = vec!["HEAD".to_string(), "index".into(), "packed-refs".into()];
    watched.extend(git(here, &["symbolic-ref", "-q", "HEAD"]));
    for name in &watched {
        let path = git(
            here,
            &["rev-parse", "--path-format=absolute", "--git-path", name],
        )?;
        // a file that does not exist would make cargo run this on every build
        if Path::new(&path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    let hash = git(here, &["rev-parse", "--short", "HEAD"])?;
    let dirty = git(here, &["status", "--porcelain", "--untracked-files=no"])?;
    Some(if dirty.is_empty() {
        hash
    } else {
        format!("{hash}-dirty")
    })
}
