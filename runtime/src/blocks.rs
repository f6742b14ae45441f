//! The blocks of a paged KV cache ([`CachePaging`]): which blocks each row of the decode batch
//! holds, which are free, and the block table the kernels read.
//!
//! A sequence is promised, when it joins, every block it can come to need (its prompt and new
//! tokens but the last, whose keys are never written), and is handed them only as its keys reach
//! them; a sequence that has joined therefore never runs out, and one that cannot be promised its
//! blocks waits. Block 0 is never handed out: every entry of the table that no block fills
//! points at it, so that a kernel reading past a sequence's keys reads memory of the pool (its
//! keys are masked by position either way). Moving a sequence to another row moves its table
//! row, never its keys.

use kiln_ir::artifact::CachePaging;

use crate::RuntimeError;

/// The blocks of one paged cache (see the module docs).
pub struct BlockPool {
    paging: CachePaging,
    /// Blocks nobody holds, handed out from the end.
    free: Vec<u32>,
    /// `[rows, entries]`: row `r`'s blocks in key order, then zeros.
    table: Vec<u32>,
    /// Blocks each row holds (its table row's leading entries).
    held: Vec<usize>,
    /// Blocks each row was promised (at least those it holds).
    promised: Vec<usize>,
    /// Whether the table changed since [`BlockPool::take_table`] last gave it.
    dirty: bool,
}

impl BlockPool {
    /// An empty pool: every block but block 0 free, every table entry 0.
    pub fn new(paging: CachePaging) -> BlockPool {
        BlockPool {
            free: (1..paging.blocks as u32).rev().collect(),
            table: vec![0; paging.rows * paging.entries],
            held: vec![0; paging.rows],
            promised: vec![0; paging.rows],
            dirty: false,
            paging,
        }
    }

    /// Blocks sequences can hold (block 0 aside).
    pub fn capacity(&self) -> usize {
        self.paging.blocks - 1
    }

    /// Blocks the rows hold now.
    pub fn used(&self) -> usize {
        self.held.iter().sum()
    }

    /// Blocks a sequence that writes `tokens` keys needs.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        self.paging.blocks_for(tokens)
    }

    /// Blocks no row was promised.
    pub fn unpromised(&self) -> usize {
        self.capacity() - self.promised.iter().sum::<usize>()
    }

    /// Promises the empty row `row` `blocks` blocks; `false` (nothing promised) when fewer are
    /// unpromised or the row's table cannot hold them.
    pub fn promise(&mut self, row: usize, blocks: usize) -> bool {
        let fits = blocks <= self.unpromised() && blocks <= self.paging.entries;
        if fits {
            debug_assert_eq!(self.promised[row], 0, "row {row} is not empty");
            self.promised[row] = blocks;
        }
        fits
    }

    /// Hands row `row` the blocks its first `tokens` keys lie in, out of what it was promised.
    pub fn ensure(&mut self, row: usize, tokens: usize) -> Result<(), RuntimeError> {
        let need = self.blocks_for(tokens);
        if need > self.promised[row] {
            return Err(RuntimeError::Request(format!(
                "row {row} writes {tokens} keys: {need} blocks of the KV cache, {} promised",
                self.promised[row]
            )));
        }
        let first = row * self.paging.entries;
        while self.held[row] < need {
            let block = self
                .free
                .pop()
                .expect("a promised block is free: promises never exceed the pool");
            self.table[first + self.held[row]] = block;
            self.held[row] += 1;
            self.dirty = true;
        }
        Ok(())
    }

    /// Frees row `row`'s blocks and its promise.
    pub fn release(&mut self, row: usize) {
        let first = row * self.paging.entries;
        let held = std::mem::take(&mut self.held[row]);
        self.free
            .extend(self.table[first..first + held].iter().rev());
        self.table[first..first + held].fill(0);
        self.promised[row] = 0;
        self.dirty |= held > 0;
    }

    /// Moves row `from`'s blocks and promise to the empty row `to`.
    pub fn move_row(&mut self, from: usize, to: usize) {
        debug_assert_eq!(self.promised[to], 0, "row {to} is not empty");
        let e = self.paging.entries;
        let (a, b) = (from * e, to * e);
        self.table.copy_within(a..a + e, b);
        self.table[a..a + e].fill(0);
        self.held[to] = std::mem::take(&mut self.held[from]);
        self.promised[to] = std::mem::take(&mut self.promised[from]);
        self.dirty = true;
    }

    /// The table, when it changed since it was last taken (the caller writes it to the
    /// executor before the next step).
    pub fn take_table(&mut self) -> Option<&[u32]> {
        std::mem::take(&mut self.dirty).then_some(&self.table[..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(blocks: usize) -> BlockPool {
        BlockPool::new(CachePaging {
            block_tokens: 4,
            blocks,
            rows: 3,
            entries: 5,
            table: 0,
        })
    }

    #[test]
    fn blocks_are_handed_out_as_keys_reach_them_and_come_back() {
        let mut p = pool(8);
        assert_eq!(p.capacity(), 7);
        assert!(p.promise(1, 3));
        assert_eq!(p.unpromised(), 4);
        p.ensure(1, 1).unwrap();
        assert_eq!(p.used(), 1);
        p.ensure(1, 4).unwrap();
        assert_eq!(p.used(), 1, "4 keys fit one block of 4");
        p.ensure(1, 9).unwrap();
        assert_eq!(p.used(), 3);
        let table = p.take_table().unwrap().to_vec();
        assert_eq!(&table[5..8], &[1, 2, 3]);
        assert!(table[..5].iter().chain(&table[8..]).all(|&b| b == 0));
        assert!(p.take_table().is_none(), "unchanged since taken");
        assert!(p.ensure(1, 13).is_err(), "a fourth block was not promised");
        p.release(1);
        assert_eq!((p.used(), p.unpromised()), (0, 7));
        assert!(p.take_table().unwrap().iter().all(|&b| b == 0));
    }

    #[test]
    fn promises_never_exceed_the_pool_or_a_row() {
        let mut p = pool(8);
        assert!(p.promise(0, 5));
        assert!(!p.promise(1, 3), "2 blocks are left");
        assert!(p.promise(1, 2));
        assert!(!p.promise(2, 1));
        let mut q = pool(10);
        assert!(!q.promise(0, 6), "a row's table holds 5 entries");
    }

    #[test]
    fn moving_a_row_moves_its_table_row_not_its_blocks() {
        let mut p = pool(8);
        assert!(p.promise(2, 2));
        p.ensure(2, 8).unwrap();
        let before = p.take_table().unwrap()[10..12].to_vec();
        p.move_row(2, 0);
        let table = p.take_table().unwrap().to_vec();
        assert_eq!(&table[..2], &before[..]);
        assert!(table[10..].iter().all(|&b| b == 0));
        assert_eq!(p.used(), 2);
        p.release(0);
        assert_eq!(p.unpromised(), 7);
        // Freed blocks are handed out again.
        assert!(p.promise(1, 5));
        p.ensure(1, 20).unwrap();
        assert_eq!(p.used(), 5);
    }
}
