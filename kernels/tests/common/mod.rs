//! What the kernel test suites share: the reference interpreter run on one op, and the
//! fixtures' tolerance check.

use std::collections::BTreeMap;
use std::sync::Arc;

use kiln_ir::{DType, Dim, Graph, Op, Tensor};
use kiln_kernels::Elem;

/// Runs `op` on `inputs` with the reference interpreter (f32 graph); inputs listed in
/// `int_inputs` are i64.
pub fn reference(op: Op, inputs: Vec<(Vec<usize>, Vec<f32>)>, int_inputs: &[usize]) -> Tensor {
    evaluate_one(op, inputs, int_inputs, None)
}

/// Like `reference`, but an integer input given as `vec![]` shape is the i64 seed (exact).
#[allow(dead_code)] // only the GPU suite draws dropout masks
pub fn reference_with_seed(
    op: Op,
    inputs: Vec<(Vec<usize>, Vec<f32>)>,
    ints: &[usize],
    seed: Option<i64>,
) -> Vec<f32> {
    evaluate_one(op, inputs, ints, seed)
        .as_f32()
        .unwrap()
        .to_vec()
}

fn evaluate_one(
    op: Op,
    inputs: Vec<(Vec<usize>, Vec<f32>)>,
    ints: &[usize],
    seed: Option<i64>,
) -> Tensor {
    let mut g = Graph::new();
    let mut ids = Vec::new();
    let mut values = BTreeMap::new();
    for (i, (shape, data)) in inputs.into_iter().enumerate() {
        let name = format!("a{i}");
        let dims = shape.iter().map(|&d| Dim::from(d)).collect();
        let t = if ints.contains(&i) {
            ids.push(g.input(&name, DType::I64, dims).unwrap());
            if shape.is_empty() {
                Tensor::i64(shape, vec![seed.expect("a seed")])
            } else {
                Tensor::i64(shape, data.iter().map(|v| *v as i64).collect())
            }
        } else {
            ids.push(g.input(&name, DType::F32, dims).unwrap());
            Tensor::f32(shape, data)
        };
        values.insert(name, t);
    }
    let out = g.add(op, &ids).unwrap();
    g.set_output("out", out).unwrap();
    let weights = BTreeMap::<String, Arc<Tensor>>::new();
    kiln_ir::evaluate(&g, &values, &weights)
        .unwrap()
        .remove("out")
        .unwrap()
}

/// Asserts the fixtures' tolerance for `elem` (relative to the largest reference value) and that
/// every element was written (no NaN left from a poisoned output).
/// Elements of `a` and `b` whose bits differ (over the shorter of the two).
#[allow(dead_code)] // each suite uses what it covers
pub fn bits_differ(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

pub fn check(what: &str, elem: Elem, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let tol = if elem == Elem::F32 { 1e-4 } else { 2e-2 };
    let mut diff = 0f64;
    let mut scale = 0f64;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(!g.is_nan(), "{what}: element {i} was not written (NaN)");
        diff = diff.max((f64::from(*g) - f64::from(*w)).abs());
        scale = scale.max(f64::from(*w).abs());
    }
    let err = diff / scale.max(1e-30);
    assert!(
        err < tol,
        "{what}: relative error {err:e} (tolerance {tol:e})"
    );
    println!("ok  {what:<60} rel err {err:.2e}");
}

/// RoPE cos/sin tables `[positions, D/2]` in f64 rounded to f32, as the artifact will carry them.
#[allow(dead_code)] // each suite uses what it covers
pub fn rope_tables(theta: f64, head_dim: usize, positions: usize) -> (Vec<f32>, Vec<f32>) {
    scaled_rope_tables(&kiln_ir::RopeScaling::Default, theta, head_dim, positions)
}

/// [`rope_tables`] with a frequency scaling (linear, llama3).
#[allow(dead_code)] // each suite uses what it covers
pub fn scaled_rope_tables(
    scaling: &kiln_ir::RopeScaling,
    theta: f64,
    head_dim: usize,
    positions: usize,
) -> (Vec<f32>, Vec<f32>) {
    let inv = scaling.inv_freq(theta, head_dim);
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for p in 0..positions {
        for f in &inv {
            let (s, c) = scaling.sin_cos(p as f64, *f);
            cos.push(c as f32);
            sin.push(s as f32);
        }
    }
    (cos, sin)
}

/// `CacheWrite(cache, [Rope](new, positions), positions, mask)` by the interpreter, for a cache
/// `[b, kvh, t, d]` and new values `[b, kvh, s, d]` (`dims = [b, kvh, s, t, d]`).
#[allow(dead_code)] // each suite uses what it covers
pub fn cache_write_reference(
    cache: &[f32],
    new: &[f32],
    positions: &[i64],
    mask: &[i64],
    dims: [usize; 5],
    rope: bool,
) -> Vec<f32> {
    let [b, kvh, s, t, d] = dims;
    let shape = |v: &[usize]| v.iter().map(|&x| Dim::from(x)).collect::<Vec<Dim>>();
    let mut g = Graph::new();
    let ci = g
        .input("cache", DType::F32, shape(&[b, kvh, t, d]))
        .unwrap();
    let ni = g.input("new", DType::F32, shape(&[b, kvh, s, d])).unwrap();
    let pi = g.input("pos", DType::I64, shape(&[b, s])).unwrap();
    let mi = g.input("mask", DType::I64, shape(&[b, s])).unwrap();
    let values = if rope {
        let op = Op::Rope {
            theta: 10000.0,
            scaling: kiln_ir::RopeScaling::Default,
        };
        g.add(op, &[ni, pi]).unwrap()
    } else {
        ni
    };
    let w = g.add(Op::CacheWrite, &[ci, values, pi, mi]).unwrap();
    g.set_output("out", w).unwrap();
    let inputs = BTreeMap::from([
        (
            "cache".to_string(),
            Tensor::f32(vec![b, kvh, t, d], cache.to_vec()),
        ),
        (
            "new".to_string(),
            Tensor::f32(vec![b, kvh, s, d], new.to_vec()),
        ),
        (
            "pos".to_string(),
            Tensor::i64(vec![b, s], positions.to_vec()),
        ),
        ("mask".to_string(), Tensor::i64(vec![b, s], mask.to_vec())),
    ]);
    let weights = BTreeMap::<String, Arc<Tensor>>::new();
    kiln_ir::evaluate(&g, &inputs, &weights).unwrap()["out"]
        .as_f32()
        .unwrap()
        .to_vec()
}

/// The IR's dropout mask (true: kept) of a `[b, h, s, t]` tensor: the interpreter's own `Dropout`
/// op at the op's f64 drop probability `p`, stream `stream` and seed `seed`, applied to ones.
#[allow(dead_code)] // each suite uses what it covers
pub fn dropout_mask_reference(p: f64, stream: u32, seed: i64, shape: [usize; 4]) -> Vec<bool> {
    let n = shape.iter().product();
    let ones = (shape.to_vec(), vec![1.0; n]);
    let out = reference_with_seed(
        Op::Dropout { p, stream },
        vec![ones, (vec![], vec![])],
        &[1],
        Some(seed),
    );
    out.iter().map(|v| *v != 0.0).collect()
}

/// Attention inputs `(q, k, v)` that turn the probabilities into the dropout mask: q = k = 0
/// (every visible key weighs the same) and v the identity (`t` keys, head dimension `t`), so that
/// output `[b, h, i, j]` is nonzero exactly where dropout keeps `(i, j)` of plane `b h`.
#[allow(dead_code)] // each suite uses what it covers
pub fn dropout_probe(b: usize, h: usize, s: usize, t: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let v = (0..b * h)
        .flat_map(|_| (0..t * t).map(move |x| f32::from(u8::from(x / t == x % t))))
        .collect();
    (vec![0.0; b * h * s * t], vec![0.0; b * h * t * t], v)
}

/// How many positions of `got` (nonzero = kept) differ from the reference mask.
#[allow(dead_code)] // each suite uses what it covers
pub fn mask_mismatches(got: &[f32], want: &[bool]) -> usize {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .filter(|(g, w)| (**g != 0.0) != **w)
        .count()
}

/// A paged copy of the caches of `rows` sequences (`[rows, kv_heads, capacity, head_dim]`): every
/// sequence's blocks in a shuffled order across the pool (block 0, the null block, left out),
/// as the runtime's block table would hand them out over time.
pub struct PagedCache {
    /// The block table, `[rows, entries]`.
    pub table: Vec<u32>,
    /// The layout, the pool's block count included.
    pub paging: kiln_kernels::paging::Paging,
    shape: [usize; 4],
}

impl PagedCache {
    pub fn new(
        rng: &mut rand::rngs::StdRng,
        [rows, kv_heads, capacity, head_dim]: [usize; 4],
        block: u32,
    ) -> PagedCache {
        use kiln_kernels::paging::{whole_rows_pool, Paging};
        use rand::seq::SliceRandom;
        let entries = capacity.div_ceil(block as usize);
        let blocks = whole_rows_pool(rows, entries);
        let paging = Paging::new(block, capacity as u32, blocks as u32).unwrap();
        // Every block but block 0, shuffled.
        let mut order: Vec<u32> = (1..blocks as u32).collect();
        order.shuffle(rng);
        PagedCache {
            table: order,
            paging,
            shape: [rows, kv_heads, capacity, head_dim],
        }
    }

    /// Index in the pool of element `(b, h, j, c)` of the dense cache.
    fn at(&self, b: usize, h: usize, j: usize, c: usize) -> usize {
        let [_, kvh, _, d] = self.shape;
        let bs = self.paging.block as usize;
        let block = self.table[b * self.paging.entries as usize + j / bs] as usize;
        ((block * kvh + h) * bs + j % bs) * d + c
    }

    /// The pool holding `dense` (`fill` where no key is).
    pub fn scatter<T: Copy>(&self, dense: &[T], fill: T) -> Vec<T> {
        let [rows, kvh, t, d] = self.shape;
        let blocks = self.paging.blocks as usize;
        let mut pool = vec![fill; blocks * kvh * self.paging.block as usize * d];
        for (i, x) in dense.iter().enumerate() {
            let (b, h, j, c) = (i / (kvh * t * d), i / (t * d) % kvh, i / d % t, i % d);
            debug_assert!(b < rows);
            pool[self.at(b, h, j, c)] = *x;
        }
        pool
    }

    /// The dense caches `pool` holds.
    pub fn gather<T: Copy>(&self, pool: &[T]) -> Vec<T> {
        let [rows, kvh, t, d] = self.shape;
        (0..rows * kvh * t * d)
            .map(|i| pool[self.at(i / (kvh * t * d), i / (t * d) % kvh, i / d % t, i % d)])
            .collect()
    }
}
