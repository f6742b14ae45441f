//! `kiln-run`: runs compiled kiln artifacts.

use clap::Parser;

fn main() {
    let cli = kiln_runtime::cli::Cli::parse();
    if let Err(e) = kiln_runtime::cli::run(cli, &mut std::io::stdout().lock()) {
        // One line: the error and its causes, joined.
        eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
        std::process::exit(2);
    }
}
