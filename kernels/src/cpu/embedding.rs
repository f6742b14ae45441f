//! Summed embedding lookups, the CPU side of [`crate::embedding`]: for each token of
//! `begin..end`, the rows its ids select (clamped into each table, for memory safety only: the
//! runtime validates ids) are added four columns at a time. Parameters: `table_0, ids_0, ...,
//! out`; the parallel axis is tokens.

use cranelift_codegen::ir::types::I64;
use cranelift_codegen::ir::{InstBuilder, MemFlagsData, Type, Value};
use cranelift_frontend::FunctionBuilder;

use super::module::{arg, f32_addr, for_range, load, store, CpuError, CpuModule, SCALAR, VECTOR};
use crate::embedding::EmbeddingConfig;

/// The function's name for `cfg` (everything its code depends on).
pub fn name(cfg: &EmbeddingConfig) -> String {
    let rows: Vec<String> = cfg.table_rows.iter().map(u32::to_string).collect();
    format!("cpu_embedding_f32_h{}_rows{}", cfg.hidden, rows.join("x"))
}

/// Generates the lookup of `cfg` (f32) into `module`; returns its name.
pub fn embedding(module: &mut CpuModule, cfg: &EmbeddingConfig) -> Result<String, CpuError> {
    let name = name(cfg);
    let cfg = cfg.clone();
    module.define(&name, |b, p| {
        let tables: Vec<(Value, Value, u32)> = cfg
            .table_rows
            .iter()
            .enumerate()
            .map(|(i, &rows)| {
                let t = arg(b, p, 2 * i as u32);
                let ids = arg(b, p, 2 * i as u32 + 1);
                (t, ids, rows)
            })
            .collect();
        let out = arg(b, p, 2 * cfg.table_rows.len() as u32);
        let hidden = i64::from(cfg.hidden);
        for_range(b, p.begin, p.end, 1, |b, token| {
            // Each table's row start for this token, the id clamped to the table.
            let starts: Vec<(Value, Value)> = tables
                .iter()
                .map(|&(t, ids, rows)| {
                    let at = b.ins().imul_imm_s(token, 8);
                    let at = b.ins().iadd(ids, at);
                    let id = b.ins().load(I64, MemFlagsData::trusted(), at, 0);
                    let zero = b.ins().iconst(I64, 0);
                    let last = b.ins().iconst(I64, i64::from(rows) - 1);
                    let lo = b.ins().smax(id, zero);
                    let id = b.ins().smin(lo, last);
                    (t, b.ins().imul_imm_s(id, hidden))
                })
                .collect();
            let out_start = b.ins().imul_imm_s(token, hidden);
            let column = |b: &mut FunctionBuilder, c: Value, ty: Type| {
                let mut sum = None;
                for &(t, start) in &starts {
                    let i = b.ins().iadd(start, c);
                    let a = f32_addr(b, t, i);
                    let v = load(b, ty, a);
                    sum = Some(match sum {
                        Some(s) => b.ins().fadd(s, v),
                        None => v,
                    });
                }
                let i = b.ins().iadd(out_start, c);
                let a = f32_addr(b, out, i);
                store(b, sum.expect("at least one table"), a);
            };
            let zero = b.ins().iconst(I64, 0);
            let split = b.ins().iconst(I64, hidden / 4 * 4);
            let end = b.ins().iconst(I64, hidden);
            for_range(b, zero, split, 4, |b, c| column(b, c, VECTOR));
            for_range(b, split, end, 1, |b, c| column(b, c, SCALAR));
        });
    })?;
    Ok(name)
}
