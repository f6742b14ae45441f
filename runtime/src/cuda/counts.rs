//! What the CUDA executor asked of the driver, counted where it asks: kernel modules loaded (a
//! PTX image is JIT-compiled by the driver as it loads), CUDA graphs captured, and allocations
//! (device memory and page-locked host memory). Every such call in the executor goes through
//! [`DriverCounts`], so "nothing after load" is a measurement, not a promise.

use serde::Serialize;

use super::KernelImage;

/// Driver work done so far (or between two moments, see [`DriverCounts::since`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DriverCounts {
    /// Kernel modules loaded (`cuModuleLoadData`), cubin or PTX.
    pub module_loads: u64,
    /// Of those, PTX images: each one is compiled by the driver's JIT.
    pub ptx_jits: u64,
    /// CUDA graphs captured (and instantiated).
    pub captures: u64,
    /// Device and page-locked host allocations.
    pub allocations: u64,
}

impl DriverCounts {
    /// Counts a module load of `image` (and its JIT compilation when it is PTX).
    pub fn module_loaded(&mut self, image: &KernelImage) {
        self.module_loads += 1;
        if matches!(image, KernelImage::Ptx(_)) {
            self.ptx_jits += 1;
        }
    }

    /// Counts a graph capture.
    pub fn captured(&mut self) {
        self.captures += 1;
    }

    /// Counts an allocation.
    pub fn allocated(&mut self) {
        self.allocations += 1;
    }

    /// What was done after `earlier` (a snapshot of the same counts).
    pub fn since(&self, earlier: &DriverCounts) -> DriverCounts {
        DriverCounts {
            module_loads: self.module_loads - earlier.module_loads,
            ptx_jits: self.ptx_jits - earlier.ptx_jits,
            captures: self.captures - earlier.captures,
            allocations: self.allocations - earlier.allocations,
        }
    }

    /// Whether nothing was counted.
    pub fn is_zero(&self) -> bool {
        *self == DriverCounts::default()
    }
}

impl std::fmt::Display for DriverCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} module loads ({} PTX JIT-compiled), {} graph captures, {} allocations",
            self.module_loads, self.ptx_jits, self.captures, self.allocations
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_loads_count_as_compilations_and_cubins_do_not() {
        let mut c = DriverCounts::default();
        c.module_loaded(&KernelImage::Cubin(vec![0x7f]));
        assert_eq!((c.module_loads, c.ptx_jits), (1, 0));
        c.module_loaded(&KernelImage::Ptx(".version 8.0".into()));
        assert_eq!((c.module_loads, c.ptx_jits), (2, 1));
    }

    #[test]
    fn counts_after_a_snapshot_are_the_difference() {
        let mut c = DriverCounts::default();
        c.module_loaded(&KernelImage::Ptx(String::new()));
        c.captured();
        c.captured();
        c.allocated();
        let at_load = c;
        assert!(c.since(&at_load).is_zero());
        c.captured();
        let after = c.since(&at_load);
        assert_eq!(
            after,
            DriverCounts {
                captures: 1,
                ..DriverCounts::default()
            }
        );
        assert!(!after.is_zero());
        assert_eq!(
            at_load.to_string(),
            "1 module loads (1 PTX JIT-compiled), 2 graph captures, 1 allocations"
        );
    }
}
