//! Opening an artifact: every file's checksum and the format version are verified before anything
//! else is read, and every error names the file. The checksum list is checked against its own
//! last line first, so that a damaged list is reported as itself.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_ir::artifact::{self, BucketEntry, CachePaging, Manifest, FORMAT_VERSION};
use kiln_ir::checksum;
use kiln_ir::Graph;
use memmap2::Mmap;
use rayon::prelude::*;

use crate::tokenizer::TextTokenizer;
use crate::weights::WeightStore;
use crate::RuntimeError;

/// A verified artifact: its manifest, its bucket graphs and its weights.
pub struct Artifact {
    /// The folder.
    pub dir: PathBuf,
    /// The manifest.
    pub manifest: Manifest,
    /// Static graphs by file name (relative to the artifact).
    pub graphs: BTreeMap<String, Graph>,
    /// The weights, when the artifact has them.
    pub weights: Option<WeightStore>,
}

/// An artifact folder and its checksums file: what [`Artifact::open`] reads through, each
/// error naming the file it is about.
struct Folder<'a> {
    dir: &'a Path,
    /// `(digest, file)` as listed.
    sums: Vec<(String, String)>,
}

impl<'a> Folder<'a> {
    /// `dir` with its checksums file read.
    fn read(dir: &'a Path) -> Result<Folder<'a>, RuntimeError> {
        let bad = |message| file_error(dir, artifact::CHECKSUMS, message);
        let sums_bytes = read_bytes(dir, artifact::CHECKSUMS)?;
        let sums_text = String::from_utf8(sums_bytes)
            .map_err(|_| bad("is not text: the checksums file itself is corrupt".into()))?;
        let sums = checksum::parse_checksums(&sums_text).map_err(|e| bad(e.to_string()))?;
        Ok(Folder { dir, sums })
    }

    /// The error about `file` of the folder.
    fn bad(&self, file: &str, message: String) -> RuntimeError {
        file_error(self.dir, file, message)
    }

    /// Whether the checksums list `file`.
    fn listed(&self, file: &str) -> bool {
        self.sums.iter().any(|(_, p)| p == file)
    }

    /// `file`'s text, once it is listed.
    fn read_listed(&self, file: &str) -> Result<String, RuntimeError> {
        let text = read_text(self.dir, file)?;
        if !self.listed(file) {
            return Err(self.bad(file, "has no checksum".into()));
        }
        Ok(text)
    }

    /// Checks every listed file against its digest: every file at once, each streamed through
    /// the hash (constant memory); the first failure in list order is the one reported.
    fn verify(&self) -> Result<(), RuntimeError> {
        let start = std::time::Instant::now();
        let found: Vec<Result<String, std::io::Error>> = self
            .sums
            .par_iter()
            .map(|(_, file)| checksum::digest_file(&self.dir.join(file)))
            .collect();
        for ((want, file), got) in self.sums.iter().zip(found) {
            match got {
                Ok(got) if got == *want => {}
                Ok(_) => {
                    return Err(self.bad(
                        file,
                        "does not match its checksum (corrupt or modified)".into(),
                    ))
                }
                Err(e) => return Err(self.bad(file, format!("cannot be read: {e}"))),
            }
        }
        tracing::info!(
            seconds = start.elapsed().as_secs_f64(),
            files = self.sums.len(),
            "checksums verified"
        );
        Ok(())
    }

    /// The manifest, its format version read first, so that another format is named as such
    /// rather than as malformed.
    fn manifest(&self) -> Result<Manifest, RuntimeError> {
        let text = self.read_listed(artifact::MANIFEST)?;
        let bad = |message| self.bad(artifact::MANIFEST, message);
        #[derive(serde::Deserialize)]
        struct Version {
            format_version: u32,
        }
        match ron::from_str::<Version>(&text) {
            Ok(v) if v.format_version == FORMAT_VERSION => {}
            Ok(v) => {
                return Err(bad(format!(
                    "has format version {}; this runtime reads version {FORMAT_VERSION}",
                    v.format_version
                )))
            }
            Err(e) => return Err(bad(format!("is malformed: {e}"))),
        }
        ron::from_str(&text).map_err(|e| bad(format!("is malformed: {e}")))
    }

    /// Every bucket's graph, by file.
    fn graphs(&self, manifest: &Manifest) -> Result<BTreeMap<String, Graph>, RuntimeError> {
        let mut graphs = BTreeMap::new();
        for entry in manifest.buckets() {
            let text = self.read_listed(&entry.graph)?;
            let graph =
                Graph::from_ron(&text).map_err(|e| self.bad(&entry.graph, e.to_string()))?;
            graphs.insert(entry.graph.clone(), graph);
        }
        Ok(graphs)
    }

    /// The weights file mapped, when the manifest names one: listed, with the digest the
    /// manifest's plans were made for.
    fn weights(&self, manifest: &Manifest) -> Result<Option<WeightStore>, RuntimeError> {
        if let (Some(file), Some(want)) = (&manifest.weights, &manifest.weights_digest) {
            if self.sums.iter().any(|(hash, p)| p == file && hash != want) {
                return Err(self.bad(
                    file,
                    "is not the weights the manifest's plans were made for (its digest differs from the manifest's)".into(),
                ));
            }
        }
        match &manifest.weights {
            Some(file) if self.listed(file) => {
                let map = map_file(&self.dir.join(file))
                    .map_err(|e| self.bad(file, e))?
                    .ok_or_else(|| self.bad(file, "is empty".into()))?;
                Ok(Some(
                    WeightStore::from_map(map).map_err(|e| self.bad(file, e))?,
                ))
            }
            Some(file) => Err(self.bad(file, "has no checksum".into())),
            None => Ok(None),
        }
    }
}

/// The error about `file` of the artifact folder `dir`.
fn file_error(dir: &Path, file: &str, message: String) -> RuntimeError {
    RuntimeError::Artifact {
        file: dir.join(file).display().to_string(),
        message,
    }
}

/// The bytes of `file` of the artifact folder `dir`.
fn read_bytes(dir: &Path, file: &str) -> Result<Vec<u8>, RuntimeError> {
    std::fs::read(dir.join(file)).map_err(|e| file_error(dir, file, format!("cannot be read: {e}")))
}

/// The text of `file` of the artifact folder `dir`.
fn read_text(dir: &Path, file: &str) -> Result<String, RuntimeError> {
    std::fs::read_to_string(dir.join(file))
        .map_err(|e| file_error(dir, file, format!("cannot be read: {e}")))
}

impl Artifact {
    /// An error about the artifact's file `file`, naming it.
    pub fn file_error(&self, file: &str, message: String) -> RuntimeError {
        file_error(&self.dir, file, message)
    }

    /// The bytes of the artifact's file `file`; the error names it.
    pub fn read_bytes(&self, file: &str) -> Result<Vec<u8>, RuntimeError> {
        read_bytes(&self.dir, file)
    }

    /// The text of the artifact's file `file`; the error names it.
    pub fn read_text(&self, file: &str) -> Result<String, RuntimeError> {
        read_text(&self.dir, file)
    }

    /// An error about the weights file, naming it.
    pub fn weights_error(&self, message: String) -> RuntimeError {
        let file = self.manifest.weights.as_deref();
        self.file_error(file.unwrap_or(artifact::WEIGHTS), message)
    }

    /// An error in bucket `entry`'s plan, naming the manifest.
    pub fn plan_error(&self, entry: &BucketEntry, message: String) -> RuntimeError {
        let message = format!("bucket {}: {message}", entry.graph);
        self.file_error(kiln_ir::artifact::MANIFEST, message)
    }

    /// Opens and verifies `dir`.
    pub fn open(dir: &Path) -> Result<Artifact, RuntimeError> {
        if !dir.is_dir() {
            return Err(RuntimeError::Artifact {
                file: dir.display().to_string(),
                message: "is not an artifact folder".into(),
            });
        }
        let folder = Folder::read(dir)?;
        folder.verify()?;
        let manifest = folder.manifest()?;
        let bad_manifest = |e| folder.bad(artifact::MANIFEST, e);
        check_paging(&manifest).map_err(bad_manifest)?;
        let graphs = folder.graphs(&manifest)?;
        check_logits_chunks(&manifest, &graphs).map_err(bad_manifest)?;
        let extras = [
            &manifest.tokenizer,
            &manifest.tokenizer_config,
            &manifest.generation_config,
        ];
        if let Some(file) = extras.into_iter().flatten().find(|f| !folder.listed(f)) {
            return Err(folder.bad(file, "has no checksum".into()));
        }
        let weights = folder.weights(&manifest)?;
        Ok(Artifact {
            dir: dir.to_path_buf(),
            manifest,
            graphs,
            weights,
        })
    }

    /// Lets the system drop the mapped pages of bytes `at..at + len` of the weights region (read
    /// again from the file if touched later): an executor that has copied them elsewhere keeps
    /// the host's memory from growing with the model.
    pub fn release_weights(&self, at: usize, len: usize) {
        if let Some(w) = &self.weights {
            w.release(at, len);
        }
    }

    /// The weights region a native executor uses as it is: the weights file's data section,
    /// checked against the memory plan.
    pub fn weights_region(&self) -> Result<&[u8], RuntimeError> {
        let weights = self.weights.as_ref().ok_or_else(|| {
            RuntimeError::Request("the artifact was compiled with --no-weights".into())
        })?;
        weights
            .region(&self.manifest.memory)
            .map_err(|message| self.weights_error(message))
    }

    /// The sequence length of the largest prefill bucket (0 when there is none).
    pub fn longest_prefill(&self) -> usize {
        self.manifest
            .prefill
            .iter()
            .map(|e| e.seq)
            .max()
            .unwrap_or(0)
    }

    /// The artifact's tokenizer (`tokenizer.json`, verified with the other files at open).
    pub fn tokenizer(&self) -> Result<TextTokenizer, RuntimeError> {
        match &self.manifest.tokenizer {
            Some(file) => TextTokenizer::from_file(&self.dir.join(file)),
            None => Err(RuntimeError::Request(format!(
                "{} has no tokenizer.json; give token ids instead of text",
                self.dir.display()
            ))),
        }
    }
}

/// `Err` naming what is wrong with the manifest's paged KV cache: each memory plan's paging fits
/// its cache region and the context, the CPU plans' pages as the GPU plans' do (one block pool
/// hands out both), and the table has a row for every row of the largest decode batch.
fn check_paging(m: &Manifest) -> Result<(), String> {
    let context = m.decode.iter().filter_map(|e| e.context).max().unwrap_or(0);
    let rows = m.decode.iter().map(|e| e.batch).max().unwrap_or(0);
    let plans = std::iter::once(&m.memory).chain(&m.cpu_memory);
    for memory in plans.clone() {
        if let Some(p) = &memory.paging {
            p.check(memory, context)?;
            if p.rows < rows {
                return Err(format!(
                    "its block table has {} rows; the largest decode batch has {rows}",
                    p.rows
                ));
            }
        }
    }
    let layout = |p: &CachePaging| (p.block_tokens, p.blocks, p.rows, p.entries);
    let layouts: Vec<_> = plans.map(|m| m.paging.as_ref().map(layout)).collect();
    if layouts.windows(2).any(|w| w[0] != w[1]) {
        return Err("its GPU and CPU memory plans page the KV cache differently".into());
    }
    Ok(())
}

/// `Err` naming what is wrong with a logits chunk of the manifest: each takes one sequence of at
/// least two tokens over the whole KV cache, and its graph keeps its tokens' logits.
fn check_logits_chunks(m: &Manifest, graphs: &BTreeMap<String, Graph>) -> Result<(), String> {
    for e in &m.logits_chunks {
        let what = format!("logits chunk {}", e.graph);
        if e.batch != 1 || e.seq < 2 || e.context.is_none() || e.context != m.max_context {
            return Err(format!(
                "{what} takes {} sequences of {} tokens over {:?} cache entries; one of at least 2 over all {:?} is needed",
                e.batch, e.seq, e.context, m.max_context
            ));
        }
        let g = &graphs[&e.graph];
        let logits = g.outputs().iter().find(|o| o.name == artifact::LOGITS);
        let shape: Option<Vec<i64>> = logits
            .map(|o| g.ty(o.node).shape.iter().map(|d| d.as_const()).collect())
            .and_then(|s: Vec<Option<i64>>| s.into_iter().collect());
        let want = [1, e.seq as i64, m.model.vocab_size as i64];
        if shape.as_deref() != Some(&want[..]) {
            return Err(format!("{what} does not output logits {want:?}"));
        }
    }
    Ok(())
}

/// Maps `path` read-only (`None` for an empty file, which cannot be mapped).
fn map_file(path: &Path) -> Result<Option<Mmap>, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("cannot be read: {e}"))?;
    let len = file
        .metadata()
        .map_err(|e| format!("cannot be read: {e}"))?
        .len();
    if len == 0 {
        return Ok(None);
    }
    // SAFETY: a read-only mapping of an artifact file; kiln never writes to an artifact it runs,
    // and the bytes are verified against the checksums before anything reads them.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| format!("cannot be mapped: {e}"))?;
    Ok(Some(map))
}
