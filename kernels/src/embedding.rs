//! Summed embedding lookups: one block per token, threads over the hidden size. Token ids are
//! read from device memory (i64); an id outside its table is clamped to the table (the runtime
//! validates ids before a request reaches the GPU, so clamping only keeps a bad id memory-safe).

use crate::ptx::{Elem, Kernel, RegClass, F32};
use crate::{GeneratedKernel, Launch, ROW_THREADS};

/// An embedding kernel's static configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct EmbeddingConfig {
    /// Rows of each table (`table_i` is `[rows_i, hidden]`).
    pub table_rows: Vec<u32>,
    /// Hidden size.
    pub hidden: u32,
    /// Tokens (batch x sequence of the bucket).
    pub tokens: u32,
    /// Element type of tables and output.
    pub elem: Elem,
}

/// Generates the kernel. Parameters: `table_0, ids_0, table_1, ids_1, ..., out`.
pub fn embedding(cfg: &EmbeddingConfig) -> GeneratedKernel {
    let name = format!(
        "embedding{}_{}_h{}",
        cfg.table_rows.len(),
        cfg.elem.name(),
        cfg.hidden
    );
    let mut k = Kernel::new(&name);
    let mut tables = Vec::new();
    for i in 0..cfg.table_rows.len() {
        let t = k.param_ptr(&format!("table_{i}"));
        let ids = k.param_ptr(&format!("ids_{i}"));
        tables.push((t, ids));
    }
    let out = k.param_ptr("out");
    let tid = k.special("tid.x");
    let token = k.special("ctaid.x");
    // Each table's row offset for this token, clamped into the table.
    let mut rows = Vec::new();
    for ((_, ids), &n) in tables.iter().zip(&cfg.table_rows) {
        let ia = k.address(*ids, &token, 8);
        let id = k.ld_global_i64(ia);
        let lo = k.op2("max.s64", RegClass::B64, &id, &0u64);
        let hi = k.op2("min.s64", RegClass::B64, &lo, &u64::from(n - 1));
        let row = k.op1("cvt.u32.u64", RegClass::B32, &hi);
        rows.push(k.mul_u32(&row, &cfg.hidden));
    }
    let out_base = k.mul_u32(&token, &cfg.hidden);
    let col = k.mov(RegClass::B32, &tid);
    let top = k.label("loop");
    let done = k.label("done");
    k.place(&top);
    let past = k.setp("ge.u32", &col, &cfg.hidden);
    k.bra(Some((past, true)), &done);
    let sum = k.mov(RegClass::F32, &F32(0.0));
    for ((table, _), row) in tables.iter().zip(&rows) {
        let idx = k.add_u32(row, &col);
        let a = k.address(*table, &idx, cfg.elem.bytes());
        let v = k.ld_global(cfg.elem, a);
        k.emit(format!("add.f32 {sum}, {sum}, {v}"));
    }
    let oi = k.add_u32(&out_base, &col);
    let oa = k.address(out, &oi, cfg.elem.bytes());
    k.st_global(cfg.elem, oa, sum);
    k.emit(format!("add.u32 {col}, {col}, {ROW_THREADS}"));
    k.bra(None, &top);
    k.place(&done);
    GeneratedKernel::new(
        k,
        Launch {
            grid: [cfg.tokens, 1, 1],
            block: [ROW_THREADS, 1, 1],
            shared_bytes: 0,
        },
    )
}
