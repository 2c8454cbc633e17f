//! The book includes code by anchor, and mdBook renders a missing, empty or unbalanced
//! anchor as an empty block without a word: these tests make each of those a failure.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

fn repo_root() -> PathBuf {
    // this crate lives in tests/ at the root of the repository
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    if here.join("../book/src").is_dir() {
        here.join("..")
    } else {
        PathBuf::from("..")
    }
}

fn files_under(dir: &Path, ext: &[&str], out: &mut Vec<PathBuf>) {
    for entry in
        fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
    {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if name != "target" && !name.starts_with('.') && name != "book" {
                files_under(&path, ext, out);
            }
        } else if ext.iter().any(|e| name.ends_with(e)) {
            out.push(path);
        }
    }
}

/// `{{#include path:anchor}}` (and `rustdoc_include`) occurrences in one chapter.
fn includes(markdown: &str) -> Vec<(String, Option<String>)> {
    let mut found = Vec::new();
    let mut rest = markdown;
    while let Some(start) = rest.find("{{#") {
        let after = &rest[start + 3..];
        let end = after.find("}}").expect("an unclosed {{# in the book");
        let body = after[..end].trim();
        if let Some(spec) = body
            .strip_prefix("include ")
            .or_else(|| body.strip_prefix("rustdoc_include "))
        {
            let spec = spec.trim();
            match spec.split_once(':') {
                Some((path, anchor))
                    if !anchor.chars().next().unwrap().is_ascii_digit() =>
                {
                    found.push((path.to_string(), Some(anchor.to_string())))
                }
                Some((path, _lines)) => {
                    panic!(
                        "{path}: the book includes code by anchor, never by line numbers"
                    )
                }
                None => found.push((spec.to_string(), None)),
            }
        }
        rest = &after[end..];
    }
    found
}

/// The lines between `ANCHOR: name` and `ANCHOR_END: name` in a source file, for each name; an
/// error for an anchor opened twice, closed without opening, or never closed.
fn anchors(path: &Path) -> Result<BTreeMap<String, usize>, String> {
    let text = fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut open: BTreeMap<String, usize> = BTreeMap::new();
    let mut done: BTreeMap<String, usize> = BTreeMap::new();
    for line in text.lines() {
        let t = line.trim();
        for (_, lines) in open.iter_mut() {
            if !t.contains("ANCHOR") && !t.is_empty() {
                *lines += 1;
            }
        }
        if let Some(i) = t.find("ANCHOR_END:") {
            let name = t[i + 11..].trim().to_string();
            let lines = open.remove(&name).ok_or_else(|| {
                format!("{}: ANCHOR_END: {name} without ANCHOR", path.display())
            })?;
            if done.insert(name.clone(), lines).is_some() {
                return Err(format!("{}: anchor {name} appears twice", path.display()));
            }
        } else if let Some(i) = t.find("ANCHOR:") {
            let name = t[i + 7..].trim().to_string();
            if open.insert(name.clone(), 0).is_some() || done.contains_key(&name) {
                return Err(format!("{}: anchor {name} opened twice", path.display()));
            }
        }
    }
    if let Some(name) = open.keys().next() {
        return Err(format!(
            "{}: ANCHOR: {name} is never closed",
            path.display()
        ));
    }
    Ok(done)
}

#[test]
fn every_book_include_names_a_file_and_a_non_empty_anchor() {
    let root = repo_root();
    let mut chapters = Vec::new();
    files_under(&root.join("book/src"), &[".md"], &mut chapters);
    assert!(!chapters.is_empty(), "no chapters under book/src");
    let mut checked = 0;
    for chapter in chapters {
        let text = fs::read_to_string(&chapter).unwrap();
        for (path, anchor) in includes(&text) {
            let file = chapter.parent().unwrap().join(&path);
            assert!(
                file.is_file(),
                "{} includes {path}, which does not exist",
                chapter.display()
            );
            if let Some(anchor) = anchor {
                let found = anchors(&file).unwrap();
                let lines = found.get(&anchor).unwrap_or_else(|| {
                    panic!(
                        "{} includes {path}:{anchor}, but {path} has no anchor {anchor}",
                        chapter.display()
                    )
                });
                assert!(
                    *lines > 0,
                    "{} includes {path}:{anchor}, which is empty",
                    chapter.display()
                );
            }
            checked += 1;
        }
    }
    assert!(checked > 0, "the book includes no code at all");
}

#[test]
fn every_anchor_in_the_code_is_balanced() {
    let root = repo_root();
    let mut sources = Vec::new();
    for dir in ["steps", "src", "charts"] {
        if root.join(dir).is_dir() {
            files_under(
                &root.join(dir),
                &[".rs", ".cu", ".cuh", ".py"],
                &mut sources,
            );
        }
    }
    assert!(!sources.is_empty());
    let errors: Vec<String> = sources.iter().filter_map(|f| anchors(f).err()).collect();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

#[test]
fn the_anchor_checker_catches_what_mdbook_would_render_empty() {
    let dir = std::env::temp_dir().join(format!("anchor-check-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let case = |name: &str, text: &str| {
        let p = dir.join(name);
        fs::write(&p, text).unwrap();
        anchors(&p)
    };
    assert!(case("unclosed.rs", "// ANCHOR: a\nfn f() {}\n").is_err());
    assert!(case("unopened.rs", "fn f() {}\n// ANCHOR_END: a\n").is_err());
    assert_eq!(
        case("empty.rs", "// ANCHOR: a\n// ANCHOR_END: a\n").unwrap()["a"],
        0
    );
    assert_eq!(
        case("good.rs", "// ANCHOR: a\nfn f() {}\n// ANCHOR_END: a\n").unwrap()["a"],
        1
    );
    assert_eq!(
        includes("x {{#include ../../a.rs:by_hand}} y {{#include b.md}}").len(),
        2
    );
    fs::remove_dir_all(&dir).ok();
}
