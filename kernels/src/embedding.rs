//! Summed embedding lookups: one block per token, threads over the hidden size. Token ids are
//! read from device memory (i64); an id outside its table is clamped to the table (the runtime
//! validates ids before a request reaches the GPU, so clamping only keeps a bad id memory-safe).

use crate::ptx::{Elem, Kernel, Reg, RegClass, F32};
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
    let lanes = 16 / cfg.elem.bytes();
    if cfg.hidden.is_multiple_of(lanes) {
        vector_rows(&mut k, cfg, &tables, &rows, [tid, out_base, out]);
    } else {
        element_rows(&mut k, cfg, &tables, &rows, [tid, out_base, out]);
    }
    GeneratedKernel::new(
        k,
        Launch {
            grid: [cfg.tokens, 1, 1],
            block: [ROW_THREADS, 1, 1],
            shared_bytes: 0,
        },
    )
}

/// The tables' rows summed a column per thread at a time (rows that are not a whole number of
/// 16-byte chunks).
fn element_rows(
    k: &mut Kernel,
    cfg: &EmbeddingConfig,
    tables: &[(Reg, Reg)],
    rows: &[Reg],
    [tid, out_base, out]: [Reg; 3],
) {
    let col = k.mov(RegClass::B32, &tid);
    let top = k.label("loop");
    let done = k.label("done");
    k.place(&top);
    let past = k.setp("ge.u32", &col, &cfg.hidden);
    k.bra(Some((past, true)), &done);
    let sum = k.mov(RegClass::F32, &F32(0.0));
    for ((table, _), row) in tables.iter().zip(rows) {
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
}

/// The tables' rows summed 16 bytes per thread at a time, every chunk of the thread loaded
/// before any is added (a decode step's one token: a Llama-1B row of 2048 bf16 is one load per
/// thread, where a column per thread was eight loads one after another).
fn vector_rows(
    k: &mut Kernel,
    cfg: &EmbeddingConfig,
    tables: &[(Reg, Reg)],
    rows: &[Reg],
    [tid, out_base, out]: [Reg; 3],
) {
    let e = cfg.elem;
    let lanes = 16 / e.bytes();
    let chunks = cfg.hidden / lanes;
    k.comment("every chunk of the thread loaded, then summed and stored");
    let loaded: Vec<(Reg, Reg, Vec<Vec<Reg>>)> = (0..chunks.div_ceil(ROW_THREADS))
        .map(|i| {
            let chunk = k.add_u32(&tid, &(i * ROW_THREADS));
            let inside = k.setp("lt.u32", &chunk, &chunks);
            let first = k.mul_u32(&chunk, &lanes);
            let skip = k.label("skip_load");
            let values: Vec<Vec<Reg>> = tables
                .iter()
                .map(|_| {
                    (0..lanes)
                        .map(|_| k.mov(RegClass::F32, &F32(0.0)))
                        .collect()
                })
                .collect();
            k.bra(Some((inside, false)), &skip);
            for ((table, _), (row, dst)) in tables.iter().zip(rows.iter().zip(&values)) {
                let idx = k.add_u32(row, &first);
                let a = k.address(*table, &idx, e.bytes());
                for (d, v) in dst.iter().zip(k.ld_global_vec16(e, a)) {
                    k.emit(format!("mov.f32 {d}, {v}"));
                }
            }
            k.place(&skip);
            (first, inside, values)
        })
        .collect();
    for (first, inside, values) in loaded {
        let skip = k.label("skip_store");
        k.bra(Some((inside, false)), &skip);
        let sums: Vec<Reg> = (0..lanes as usize)
            .map(|j| {
                let sum = k.mov(RegClass::F32, &F32(0.0));
                for table in &values {
                    k.emit(format!("add.f32 {sum}, {sum}, {}", table[j]));
                }
                sum
            })
            .collect();
        let oi = k.add_u32(&out_base, &first);
        let oa = k.address(out, &oi, e.bytes());
        k.st_global_vec16(e, oa, &sums);
        k.place(&skip);
    }
}
