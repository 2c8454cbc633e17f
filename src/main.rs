//! `cargo run --release`: the attention benchmark; `cargo run --release -- attend ...`: one
//! method on `.npy` files. `--help` lists the flags, the methods and the exit statuses.

use std::process::ExitCode;

use flash_attention::cli::{self, Command};
use flash_attention::{attend, bench};

fn main() -> ExitCode {
    let command = match cli::parse(std::env::args()) {
        Ok(c) => c,
        Err(e) => {
            // clap's own output: the error with a hint (status 2), or --help (status 0)
            let _ = e.print();
            return ExitCode::from(e.exit_code() as u8);
        }
    };
    let result = match command {
        Command::Bench(args) => match bench::run(&args) {
            Ok(sweep) if sweep.stopped => return ExitCode::from(bench::EXIT_STOPPED),
            Ok(sweep) => return ExitCode::from(bench::exit_status(&sweep.rows)),
            Err(e) => Err(e),
        },
        Command::Attend(args) => attend::attend(&args).map(|written| {
            for path in written {
                println!("wrote {}", path.display());
            }
        }),
        Command::PeakChild(args) => return ExitCode::from(bench::peak_child(&args) as u8),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
