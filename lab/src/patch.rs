//! The steps' kernels fix their sizes as `#define` lines of the head dim; the lab builds
//! them with other sizes by setting those lines in the step's source before NVRTC compiles
//! it. A patch that no longer applies (the step's source changed) is an error that names the
//! file and the line it looked for.

use std::fmt::Display;

use flash_core::AttnError;

/// `source` (the step's `file`) with its line `#define NAME ...` made `#define NAME value`;
/// an error where there is not exactly one such line.
pub fn set_define(
    source: &str,
    file: &str,
    name: &str,
    value: impl Display,
) -> Result<String, AttnError> {
    let start = format!("#define {name} ");
    let lines: Vec<&str> = source.lines().filter(|l| l.starts_with(&start)).collect();
    let [line] = lines[..] else {
        return Err(patch_error(
            file,
            &format!(
                "{} lines start with {start:?}; the lab sets the one line of each size",
                lines.len()
            ),
        ));
    };
    replace_once(
        source,
        file,
        &format!("\n{line}\n"),
        &format!("\n{start}{value}\n"),
    )
}

/// `source` (the step's `file`) with `from`, found exactly once, replaced by `to`.
pub fn replace_once(
    source: &str,
    file: &str,
    from: &str,
    to: &str,
) -> Result<String, AttnError> {
    match source.matches(from).count() {
        1 => Ok(source.replacen(from, to, 1)),
        n => Err(patch_error(
            file,
            &format!("{from:?} is there {n} times, not once"),
        )),
    }
}

fn patch_error(file: &str, what: &str) -> AttnError {
    AttnError::Unsupported {
        what: format!("the lab patches {file}, which has changed: {what}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line is set whole, a name that only starts another's is not it, and a missing or
    /// doubled line is an error naming the file and the line.
    #[test]
    fn a_define_is_set_whole_and_a_missing_one_named() {
        let source = "#define WARP_ROWS (WARPS * 16)\n#define WARPS 4  // warps\nint x;\n";
        let set = set_define(source, "k.cu", "WARPS", 8).unwrap();
        assert_eq!(
            set,
            "#define WARP_ROWS (WARPS * 16)\n#define WARPS 8\nint x;\n"
        );
        let e = set_define(source, "k.cu", "STAGES", 3)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("k.cu") && e.contains("0 lines start with \"#define STAGES \""),
            "{e}"
        );
        let twice = format!("{source}#define WARPS 2\n");
        let e = set_define(&twice, "k.cu", "WARPS", 8)
            .unwrap_err()
            .to_string();
        assert!(e.contains("2 lines"), "{e}");
    }
}
