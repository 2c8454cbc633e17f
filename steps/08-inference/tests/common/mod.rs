//! What the tests that run step 08's binaries share.

use std::path::PathBuf;

/// The binary `name`: `built` where cargo built it (`env!("CARGO_BIN_EXE_<name>")`), or,
/// for a test binary copied to another machine with the binaries (`.gpu/tests/` beside
/// `.gpu/bin/`), `bin/<name>` there.
pub fn binary(built: &str, name: &str) -> PathBuf {
    let built = PathBuf::from(built);
    if built.exists() {
        return built;
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("bin").join(name)))
        .filter(|p| p.exists())
        .unwrap_or(built)
}
