//! Where a bucket runs: the CUDA executor (graphs captured at load) or, on a machine without a
//! GPU, the reference interpreter. Both take the same inputs by name and give the same outputs;
//! the CUDA executor keeps the KV cache on the device between steps.

use std::collections::BTreeMap;

use kiln_ir::artifact::BucketEntry;
use kiln_ir::Tensor;

use crate::cuda::CudaExecutor;
use crate::{Artifact, RuntimeError};

/// Which executor to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// CUDA when a GPU is present, the CPU otherwise.
    Auto,
    /// The CPU (the reference interpreter until the CPU backend lands).
    Cpu,
    /// The GPU.
    Cuda,
}

/// A loaded executor.
pub enum Executor {
    /// The reference interpreter.
    Interpreter,
    /// The CUDA executor.
    Cuda(Box<CudaExecutor>),
}

impl Executor {
    /// Loads `art` on `device` (`Auto`: CUDA when [`crate::cuda::probe`] finds a GPU).
    pub fn open(art: &Artifact, device: Device) -> Result<Executor, RuntimeError> {
        let cuda = match device {
            Device::Cpu => false,
            Device::Cuda => true,
            Device::Auto => crate::cuda::probe().is_ok(),
        };
        if cuda {
            Ok(Executor::Cuda(Box::new(CudaExecutor::load(art)?)))
        } else {
            Ok(Executor::Interpreter)
        }
    }

    /// What runs requests, in words.
    pub fn describe(&self) -> String {
        match self {
            Executor::Interpreter => "cpu (reference interpreter)".into(),
            Executor::Cuda(c) => format!("cuda: {}", c.device),
        }
    }

    /// Whether the KV cache lives in the executor (so callers neither pass nor receive it).
    pub fn keeps_cache(&self) -> bool {
        matches!(self, Executor::Cuda(_))
    }

    /// Runs `entry`'s graph on `inputs` (by input name).
    pub fn run(
        &mut self,
        art: &Artifact,
        entry: &BucketEntry,
        inputs: &BTreeMap<String, Tensor>,
    ) -> Result<BTreeMap<String, Tensor>, RuntimeError> {
        match self {
            Executor::Interpreter => {
                let weights = art.weights.as_ref().ok_or_else(|| {
                    RuntimeError::Request("the artifact was compiled with --no-weights".into())
                })?;
                kiln_ir::evaluate(&art.graphs[&entry.graph], inputs, weights)
                    .map_err(|e| RuntimeError::Request(format!("evaluation failed: {e}")))
            }
            Executor::Cuda(c) => {
                if !c.has(&entry.graph) {
                    return Err(RuntimeError::Device(format!(
                        "bucket {} has ops without a GPU kernel ({}); use --device cpu",
                        entry.graph,
                        entry.no_gpu.join(", ")
                    )));
                }
                c.run(&entry.graph, inputs)
            }
        }
    }

    /// Empties the KV cache the executor keeps (a new generation).
    pub fn reset_cache(&mut self) -> Result<(), RuntimeError> {
        match self {
            Executor::Interpreter => Ok(()),
            Executor::Cuda(c) => c.reset_cache(),
        }
    }
}
