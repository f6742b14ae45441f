//! Paged KV caches: a cache slot is a pool of blocks `[blocks, KVH, block, D]`, and sequence `b`'s
//! key `j` is row `j % block` of block `table[b * entries + j / block]` (the block table, u32, one
//! row of `entries` per sequence, written by the runtime between steps and never by a kernel). A
//! kernel over a paged cache takes the table as its `table` parameter and the pool's strides as
//! the cache's `[batch, head, row]` strides, the batch stride being the block's.
//!
//! `KeyRows` finds rows in PTX, `cpu::paging` on the CPU; both read one table entry per key.

use crate::ptx::{Kernel, Reg, RegClass};

/// How a paged cache is laid out (what a kernel's code depends on).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Paging {
    /// Keys per block (a power of two).
    pub block: u32,
    /// Table entries per sequence (the cache capacity in blocks, rounded up).
    pub entries: u32,
    /// Blocks in the pool, block 0 included: the extent a TMA tensor map over it declares.
    pub blocks: u32,
}

/// Blocks in the default pool of `rows` sequences of `entries` table entries: each a whole
/// context of blocks of its own, plus block 0.
pub fn whole_rows_pool(rows: usize, entries: usize) -> usize {
    rows * entries + 1
}

impl Paging {
    /// Paging of `block` keys per block over a cache of `capacity` keys, in pools of `blocks`
    /// blocks; `None` unless `block` is a power of two.
    pub fn new(block: u32, capacity: u32, blocks: u32) -> Option<Paging> {
        block.is_power_of_two().then(|| Paging {
            block,
            entries: capacity.div_ceil(block),
            blocks,
        })
    }

    /// `log2(block)`.
    pub fn shift(&self) -> u32 {
        self.block.trailing_zeros()
    }

    /// The pool strides `[block, head, row]` of a cache with `kv_heads` heads of `head_dim`.
    pub fn strides(&self, kv_heads: u32, head_dim: u32) -> [u32; 3] {
        [
            kv_heads * self.block * head_dim,
            self.block * head_dim,
            head_dim,
        ]
    }

    /// The name suffix of kernels over a paged cache.
    pub fn suffix(paging: Option<Paging>) -> String {
        paging.map_or(String::new(), |p| format!("_pg{}x{}", p.block, p.entries))
    }

    /// The further suffix of kernels whose tensor maps declare the pool's blocks.
    pub fn pool_suffix(paging: Option<Paging>) -> String {
        paging.map_or(String::new(), |p| format!("_pool{}", p.blocks))
    }
}

/// The element offsets of one (sequence, K/V head)'s rows in a cache operand of strides
/// `[batch, head, row]`: dense, or paged through the block table.
pub(crate) struct KeyRows {
    /// The rows' head start (dense: `b * batch + kvh * head`; paged: `kvh * head`).
    head: Reg,
    row_stride: u32,
    paged: Option<Paged>,
}

struct Paged {
    table: Reg,
    /// The sequence's first table entry.
    first: Reg,
    block_stride: u32,
    paging: Paging,
}

impl KeyRows {
    /// The rows of sequence `b`, head `kvh` of an operand of `strides`; `paged` gives the table
    /// parameter and the layout when the operand is a paged cache.
    pub(crate) fn new(
        k: &mut Kernel,
        strides: [u32; 3],
        [b, kvh]: [Reg; 2],
        paged: Option<(Reg, Paging)>,
    ) -> KeyRows {
        match paged {
            None => {
                let c0 = k.mul_u32(&b, &strides[0]);
                KeyRows {
                    head: k.mad_u32(&kvh, &strides[1], &c0),
                    row_stride: strides[2],
                    paged: None,
                }
            }
            Some((table, paging)) => KeyRows {
                head: k.mul_u32(&kvh, &strides[1]),
                row_stride: strides[2],
                paged: Some(Paged {
                    table,
                    first: k.mul_u32(&b, &paging.entries),
                    block_stride: strides[0],
                    paging,
                }),
            },
        }
    }

    /// The element offset of row `j`. Paged, a row past the table's last block reads that
    /// block's entry (so a key past the range, loaded and then ignored, stays in the table).
    pub(crate) fn row(&self, k: &mut Kernel, j: &Reg) -> Reg {
        let Some(p) = &self.paged else {
            return k.mad_u32(j, &self.row_stride, &self.head);
        };
        let block = self.block(k, j).expect("a paged cache");
        let within = k.op2("and.b32", RegClass::B32, j, &(p.paging.block - 1));
        let r = k.mad_u32(&within, &self.row_stride, &self.head);
        k.mad_u32(&block, &p.block_stride, &r)
    }

    /// The pool block holding row `j` (its table entry, the last one past the table); `None`
    /// for a dense cache.
    pub(crate) fn block(&self, k: &mut Kernel, j: &Reg) -> Option<Reg> {
        let p = self.paged.as_ref()?;
        let shifted = k.op2("shr.u32", RegClass::B32, j, &p.paging.shift());
        let entry = k.op2("min.u32", RegClass::B32, &shifted, &(p.paging.entries - 1));
        let at = k.add_u32(&p.first, &entry);
        let a = k.address(p.table, &at, 4);
        Some(k.op1("ld.global.nc.u32", RegClass::B32, &crate::ptx::Bracket(a)))
    }
}
