//! What the command-line tools share: parsers for their flags' values (the flags themselves
//! are each tool's clap `Parser`).

/// A count of at least 1 (`--runs`, and each of `--lengths`): clap's `value_parser`.
pub fn at_least_one(s: &str) -> Result<usize, String> {
    s.trim()
        .parse::<usize>()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("{s:?} is not a whole number of at least 1"))
}
