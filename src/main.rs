//! `cargo run --release`: the attention benchmark; `cargo run --release -- attend ...`: one
//! method on `.npy` files. `--help` lists the flags.

use std::process::ExitCode;

use flash_attention::cli::{self, Command};
use flash_attention::{attend, bench};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let command = match cli::parse(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}\n(--help lists the flags, with examples)");
            return ExitCode::from(2);
        }
    };
    let result = match command {
        Command::Help => {
            print!("{}", cli::HELP);
            Ok(())
        }
        Command::Bench(args) => bench::run(&args).map(|_| ()),
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
