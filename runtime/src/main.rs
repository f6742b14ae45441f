//! `kiln-run`: runs compiled kiln artifacts.

use clap::Parser;

fn main() {
    // `KILN_LOG=info` (or `debug`) prints where load time goes, among others.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("KILN_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let cli = kiln_runtime::cli::Cli::parse();
    if let Err(e) = kiln_runtime::cli::run(cli, &mut std::io::stdout().lock()) {
        // One line: the error and its causes, joined.
        eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
        std::process::exit(2);
    }
}
