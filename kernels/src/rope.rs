//! RoPE ahead of attention: `out[b, h, s, :] = rope(x[b, h, s, :], positions[b, s])` with the
//! rotate-half pairing of `Op::Rope`, from a strided `[B, H, S, D]` view into a contiguous buffer.
//! The Hopper attention kernel moves its tiles with TMA straight into swizzled shared memory,
//! where nothing rotates them, so lowering rotates q (and k) with this kernel first. The rotated
//! values are rounded to the element type once, as the tensor-core kernel's rotation in shared
//! memory rounds them.

use crate::ptx::{Elem, Kernel, Reg, RegClass};
use crate::{GeneratedKernel, Launch};

/// A rotation kernel's static configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct RotateConfig {
    /// Batch size.
    pub batch: u32,
    /// Heads.
    pub heads: u32,
    /// Rows per sequence (S).
    pub len: u32,
    /// Head dimension (even).
    pub head_dim: u32,
    /// `[batch, head, row]` strides of the input, in elements (the head dim is contiguous).
    pub strides: [u32; 3],
    /// Element type of input and output.
    pub elem: Elem,
}

impl RotateConfig {
    /// The strides of the output: `[B, H, S, D]`, contiguous.
    pub fn out_strides(&self) -> [u32; 3] {
        let d = self.head_dim;
        [self.heads * self.len * d, self.len * d, d]
    }
}

/// Threads per block.
const THREADS: u32 = 256;

/// Generates the kernel. Parameters: `x, out, positions, cos, sin` (tables `[P, D/2]`, f32).
/// Each thread rotates `w` adjacent column pairs, 16 bytes of each half where the layout allows
/// (`w` = 16 bytes of elements), one pair otherwise; threads run over (row, chunk) in order, so a
/// warp reads whole rows.
pub fn rotate(cfg: &RotateConfig) -> GeneratedKernel {
    assert!(
        cfg.head_dim.is_multiple_of(2),
        "RoPE needs an even head dim"
    );
    let [sb, sh, ss] = cfg.strides;
    let half = cfg.head_dim / 2;
    let w = vector_width(cfg);
    let name = format!(
        "rope_{}_h{}_d{}_s{}_st{sb}x{sh}x{ss}{}",
        cfg.elem.name(),
        cfg.heads,
        cfg.head_dim,
        cfg.len,
        if w > 1 { "_v" } else { "" }
    );
    let mut k = Kernel::new(&name);
    let x = k.param_ptr("x");
    let out = k.param_ptr("out");
    let positions = k.param_ptr("positions");
    let cos = k.param_ptr("cos");
    let sin = k.param_ptr("sin");
    let e = cfg.elem;
    let chunks = half / w;
    let items = cfg.batch * cfg.heads * cfg.len * chunks;
    let tid = k.special("tid.x");
    let block = k.special("ctaid.x");
    let item = k.mad_u32(&block, &THREADS, &tid);
    let exit = k.label("exit");
    if !items.is_multiple_of(THREADS) {
        let past = k.setp("ge.u32", &item, &items);
        k.bra(Some((past, true)), &exit);
    }
    let chunk = k.op2("rem.u32", RegClass::B32, &item, &chunks);
    let row = k.op2("div.u32", RegClass::B32, &item, &chunks);
    let s = k.op2("rem.u32", RegClass::B32, &row, &cfg.len);
    let bh = k.op2("div.u32", RegClass::B32, &row, &cfg.len);
    let h = k.op2("rem.u32", RegClass::B32, &bh, &cfg.heads);
    let b = k.op2("div.u32", RegClass::B32, &bh, &cfg.heads);
    let token = k.mad_u32(&b, &cfg.len, &s);
    let pa = k.address(positions, &token, 8);
    let pos64 = k.ld_global_i64(pa);
    let pos = k.op1("cvt.u32.u64", RegClass::B32, &pos64);
    let col = k.mul_u32(&chunk, &w);
    let n0 = k.mul_u32(&b, &sb);
    let n1 = k.mad_u32(&h, &sh, &n0);
    let n2 = k.mad_u32(&s, &ss, &n1);
    let src = k.add_u32(&n2, &col);
    let dst0 = k.mul_u32(&row, &cfg.head_dim);
    let dst = k.add_u32(&dst0, &col);
    let t = k.mad_u32(&pos, &half, &col);
    let lo_a = k.address(x, &src, e.bytes());
    let lo = load(&mut k, e, lo_a, w);
    let hi_a = k.address(x, &src, e.bytes());
    let hi_a = k.op2(
        "add.u64",
        RegClass::B64,
        &hi_a,
        &u64::from(half * e.bytes()),
    );
    let hi = load(&mut k, e, hi_a, w);
    let ca = k.address(cos, &t, 4);
    let c = load(&mut k, Elem::F32, ca, w);
    let sa = k.address(sin, &t, 4);
    let sn = load(&mut k, Elem::F32, sa, w);
    let (mut rlo, mut rhi) = (Vec::new(), Vec::new());
    for i in 0..w as usize {
        let (l, r) = rotated(&mut k, lo[i], hi[i], c[i], sn[i]);
        rlo.push(l);
        rhi.push(r);
    }
    let da = k.address(out, &dst, e.bytes());
    store(&mut k, e, da, &rlo);
    let dh = k.op2("add.u64", RegClass::B64, &da, &u64::from(half * e.bytes()));
    store(&mut k, e, dh, &rhi);
    k.place(&exit);
    GeneratedKernel::new(
        k,
        Launch {
            grid: [items.div_ceil(THREADS), 1, 1],
            block: [THREADS, 1, 1],
            shared_bytes: 0,
        },
    )
}

/// Column pairs per thread: 16 bytes of elements when both halves' rows, the strides and the
/// tables' rows keep every such access 16-byte aligned (the caller keeps the input's pointer so
/// aligned), else 1.
fn vector_width(cfg: &RotateConfig) -> u32 {
    let w = 16 / cfg.elem.bytes();
    let half = cfg.head_dim / 2;
    let aligned = half.is_multiple_of(w) && cfg.strides.iter().all(|s| s.is_multiple_of(w));
    if aligned {
        w
    } else {
        1
    }
}

/// `w` values of `elem` at `addr` as f32: one scalar load, or 16-byte loads.
pub(crate) fn load(k: &mut Kernel, elem: Elem, addr: Reg, w: u32) -> Vec<Reg> {
    if w == 1 {
        return vec![k.ld_global(elem, addr)];
    }
    let per = 16 / elem.bytes();
    (0..w / per)
        .flat_map(|i| {
            let a = k.op2("add.u64", RegClass::B64, &addr, &u64::from(16 * i));
            k.ld_global_vec16(elem, a)
        })
        .collect()
}

/// Stores f32 `values` at `addr` as `elem`: one scalar store, or one 16-byte store.
pub(crate) fn store(k: &mut Kernel, elem: Elem, addr: Reg, values: &[Reg]) {
    if values.len() == 1 {
        k.st_global(elem, addr, values[0]);
    } else {
        k.st_global_vec16(elem, addr, values);
    }
}

/// The rotation of column pair `(i, i + D/2)` with values `(lo, hi)` by the angle whose cosine
/// and sine are `(c, s)` (f32): `(lo c - hi s, hi c + lo s)`, each as one multiply and one fused
/// multiply-add.
pub(crate) fn rotated(k: &mut Kernel, lo: Reg, hi: Reg, c: Reg, s: Reg) -> (Reg, Reg) {
    let lo_c = k.mul_f32(&lo, &c);
    let neg_hi = k.op1("neg.f32", RegClass::F32, &hi);
    let rlo = k.fma_f32(&neg_hi, &s, &lo_c);
    let hi_c = k.mul_f32(&hi, &c);
    let rhi = k.fma_f32(&lo, &s, &hi_c);
    (rlo, rhi)
}
