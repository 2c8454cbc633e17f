//! What the command-line tools share: parsers for their flags' values (the flags themselves
//! are each tool's clap `Parser`).

/// A count of at least 1 (`--runs`, and each of `--lengths`): clap's `value_parser`, the
/// benchmark's own.
pub use flash_core::check::at_least_one;
