//! Writes the PTX of every kernel of the catalog (`kiln_kernels::catalog`) into a directory, one
//! file per kernel named by its place in the catalog, kind and name: run it before and after a
//! change to a generator and `diff -r` the two directories to see which kernels it changed (a
//! refactoring should change none).
//!
//! `cargo run --release -p kiln-kernels --example dump_catalog -- DIR`

fn main() {
    let Some(dir) = std::env::args().nth(1) else {
        eprintln!("usage: dump_catalog DIR");
        std::process::exit(2);
    };
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("cannot create {dir}: {e}");
        std::process::exit(1);
    }
    for (i, (kind, k)) in kiln_kernels::catalog::catalog().into_iter().enumerate() {
        let path = format!("{dir}/{i:03}_{kind}_{}.ptx", k.name);
        if let Err(e) = std::fs::write(&path, k.module()) {
            eprintln!("cannot write {path}: {e}");
            std::process::exit(1);
        }
    }
}
