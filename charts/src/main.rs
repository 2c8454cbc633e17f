//! `cargo run -p charts`: draws every chart in `charts/` from the rows in
//! `charts/data/*.json` (the main set, and each of `charts::SETS` with its own charts).

use std::path::Path;
use std::process::ExitCode;

use flash_core::files;

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
        // every chart or none: a failed write leaves the set drawn from one data set
        let mut staged = files::Staged::new();
        let mut written = Vec::new();
        for (name, svg) in charts {
            let path = dir.join(&name);
            staged
                .add(&path, |w| w.write_all(svg.as_bytes()))
                .map_err(|e| format!("{e}; no chart was changed"))?;
            written.push(path);
        }
        staged.commit().map_err(|e| e.to_string())?;
        for path in written {
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
