//! `cargo run -p charts`: draws every chart in `charts/` from the rows in `charts/data/*.json`.

use std::fs;
use std::path::Path;
use std::process::ExitCode;

fn main() -> ExitCode {
    // the package's own folder, wherever cargo is run from
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let result = charts::read_dir(&dir.join("data")).and_then(|rows| {
        if rows.is_empty() {
            return Err(format!(
                "no rows in {}: write some with `cargo run --release -- --out charts/data/cpu.json`",
                dir.join("data").display()
            ));
        }
        let mut charts = charts::render_all(&rows)?;
        // [step 05]
        // the training runs, ours and PyTorch's
        charts.extend(charts::train::render_all(&charts::train::read_runs(
            &dir.join("data"),
        )?)?);
        // [/step 05]
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
