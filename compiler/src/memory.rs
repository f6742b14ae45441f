//! The static memory plan's placement: buffers with known sizes and lifetimes get offsets in one
//! arena such that two buffers alive at the same time never overlap. Greedy by size (largest
//! first, each at the lowest offset that fits between the buffers it coexists with), which is
//! the heuristic TFLite and XLA use for the same problem; exact placement is NP-hard.

use kiln_ir::artifact::align;

/// A buffer to place: its size and the steps it is alive at, `first..=last`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetime {
    /// Bytes.
    pub bytes: u64,
    /// The step that writes it first.
    pub first: usize,
    /// The step that reads it last.
    pub last: usize,
}

impl Lifetime {
    fn overlaps(&self, other: &Lifetime) -> bool {
        self.first <= other.last && other.first <= self.last
    }
}

/// The offsets (multiples of `kiln_ir::artifact::ALIGN`) of `buffers`, and the arena size.
pub fn place(buffers: &[Lifetime]) -> (Vec<u64>, u64) {
    let mut order: Vec<usize> = (0..buffers.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(buffers[i].bytes), buffers[i].first, i));
    let mut offsets = vec![0u64; buffers.len()];
    let mut placed: Vec<usize> = Vec::new();
    let mut total = 0u64;
    for i in order {
        let size = align(buffers[i].bytes.max(1));
        let mut busy: Vec<(u64, u64)> = placed
            .iter()
            .filter(|&&j| buffers[j].overlaps(&buffers[i]))
            .map(|&j| (offsets[j], offsets[j] + align(buffers[j].bytes.max(1))))
            .collect();
        busy.sort_unstable();
        let mut at = 0u64;
        for (start, end) in busy {
            if start >= at + size {
                break;
            }
            at = at.max(end);
        }
        offsets[i] = at;
        total = total.max(at + size);
        placed.push(i);
    }
    (offsets, total)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plan's invariant: buffers alive at once never share a byte.
    fn assert_disjoint(buffers: &[Lifetime], offsets: &[u64], total: u64) {
        for i in 0..buffers.len() {
            assert_eq!(offsets[i] % kiln_ir::artifact::ALIGN, 0);
            assert!(offsets[i] + buffers[i].bytes <= total);
            for j in 0..i {
                if buffers[i].overlaps(&buffers[j]) && buffers[i].bytes > 0 && buffers[j].bytes > 0
                {
                    let (a, b) = (offsets[i], offsets[j]);
                    assert!(
                        a + buffers[i].bytes <= b || b + buffers[j].bytes <= a,
                        "buffers {i} and {j} overlap"
                    );
                }
            }
        }
    }

    #[test]
    fn a_chain_reuses_memory() {
        // x0 -> x1 -> x2 -> x3: each buffer lives from its step to the next, so two slots do.
        let buffers: Vec<Lifetime> = (0..4)
            .map(|t| Lifetime {
                bytes: 1024,
                first: t,
                last: t + 1,
            })
            .collect();
        let (offsets, total) = place(&buffers);
        assert_disjoint(&buffers, &offsets, total);
        assert_eq!(total, 2048);
    }

    #[test]
    fn random_lifetimes_never_overlap() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..50 {
            let buffers: Vec<Lifetime> = (0..40)
                .map(|_| {
                    let first = rng.random_range(0..30);
                    Lifetime {
                        bytes: rng.random_range(1..5000),
                        first,
                        last: first + rng.random_range(0..8),
                    }
                })
                .collect();
            let (offsets, total) = place(&buffers);
            assert_disjoint(&buffers, &offsets, total);
            let sum: u64 = buffers.iter().map(|b| align(b.bytes)).sum();
            assert!(total <= sum);
        }
    }
}
