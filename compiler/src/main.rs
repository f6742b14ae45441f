//! `kiln`: the ahead-of-time compiler's command line.

use clap::Parser;

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("KILN_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let cli = kiln_compiler::cli::Cli::parse();
    if let Err(e) = kiln_compiler::cli::run(&cli, &mut std::io::stdout().lock()) {
        // One line: the error and its causes, joined.
        eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
        std::process::exit(2);
    }
}
