//! Rows of a KV cache on the CPU, dense or paged, the CPU side of [`crate::paging`]: a paged
//! cache's key `j` of sequence `b` is row `j % block` of block `table[b * entries + j / block]`.

use cranelift_codegen::ir::{InstBuilder, MemFlagsData, Value};
use cranelift_frontend::FunctionBuilder;

use crate::paging::Paging;

/// Where one (sequence, K/V head)'s rows are in a cache operand of `[batch, head, row]` strides
/// (the pool's, batch stride the block's, when paged).
pub(crate) struct CacheRows {
    /// Dense: `b * batch + kvh * head`; paged: `kvh * head`.
    head: Value,
    row_stride: i64,
    paged: Option<Paged>,
}

struct Paged {
    table: Value,
    /// The sequence's first table entry.
    first: Value,
    block_stride: i64,
    paging: Paging,
}

impl CacheRows {
    /// The rows of sequence `batch`, head `kvh`; `paged` gives the table argument and layout.
    pub(crate) fn new(
        b: &mut FunctionBuilder,
        strides: [i64; 3],
        [batch, kvh]: [Value; 2],
        paged: Option<(Value, Paging)>,
    ) -> CacheRows {
        let h = b.ins().imul_imm_s(kvh, strides[1]);
        let (head, paged) = match paged {
            None => {
                let t = b.ins().imul_imm_s(batch, strides[0]);
                (b.ins().iadd(t, h), None)
            }
            Some((table, paging)) => {
                let first = b.ins().imul_imm_s(batch, i64::from(paging.entries));
                let p = Paged {
                    table,
                    first,
                    block_stride: strides[0],
                    paging,
                };
                (h, Some(p))
            }
        };
        CacheRows {
            head,
            row_stride: strides[2],
            paged,
        }
    }

    /// The element offset of row `j` (an `i64` below the cache capacity).
    pub(crate) fn row(&self, b: &mut FunctionBuilder, j: Value) -> Value {
        let Some(p) = &self.paged else {
            let r = b.ins().imul_imm_s(j, self.row_stride);
            return b.ins().iadd(self.head, r);
        };
        let entry = b.ins().ushr_imm_s(j, i64::from(p.paging.shift()));
        let at = b.ins().iadd(p.first, entry);
        let offset = b.ins().imul_imm_s(at, 4);
        let addr = b.ins().iadd(p.table, offset);
        let block = b.ins().uload32(MemFlagsData::trusted(), addr, 0);
        let within = b.ins().band_imm_s(j, i64::from(p.paging.block - 1));
        let r = b.ins().imul_imm_s(within, self.row_stride);
        let r = b.ins().iadd(self.head, r);
        let start = b.ins().imul_imm_s(block, p.block_stride);
        b.ins().iadd(start, r)
    }
}
