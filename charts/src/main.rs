//! `cargo run -p charts`: draws every chart in `charts/` from the rows in
//! `charts/data/*.json` (the main set, and each of `charts::SETS` with its own charts).

use std::fs;
use std::path::Path;
use std::process::ExitCode;

fn main() -> ExitCode {
    // the package's own folder, wherever cargo is run from
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let result = charts::render_dir(dir).and_then(|charts| {
        if charts.is_empty() {
            return Err(format!(
                "no rows in {}: write some with `cargo run --release -- --out charts/data/cpu.json`",
                dir.join("data").display()
            ));
        }
        for (name, svg) in charts {
            let path = dir.join(&name);
            fs::write(&path, svg).map_err(|e| format!("{}: {e}", path.display()))?;
            println!("wrote {}", path.display());
        }
        Ok(())
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
