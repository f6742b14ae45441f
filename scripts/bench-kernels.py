"""kiln's kernels against their PyTorch peers, in one process on the GPU machine.

usage (on the GPU machine; the cases come from the kernels crate's example, built anywhere):
  bench_kernels --emit CASES_DIR            # cargo run --release -p kiln-kernels --example bench_kernels -- --emit DIR
  python3 scripts/bench-kernels.py CASES_DIR [--json OUT.json]
  python3 scripts/bench-kernels.py old=DIR_A new=DIR_B [--only RE]   # A/B: two builds' cases

With several labelled case directories (the emitted cases of different builds), each case of the
first runs once per build, in turn, the order reversed from one case to the next (so that no
build always runs first), named `case [label]`: builds compared in one pass on the same card.

Each case is a generated kernel (PTX, parameter list with tensor-map layouts, launch) and the
tensors it reads and writes. This script allocates those tensors with torch, loads the kernel
through the CUDA driver (ctypes, in torch's context), encodes its tensor maps as kiln's runtime
does, and times it with CUDA events on torch's stream exactly as it times the peer on the same
tensors: torch.matmul (cuBLAS) for products, scaled_dot_product_attention with the flash and cuDNN
backends for attention. Both sides are timed as CUDA graphs of ten launches back to back
(`cuda_timing.bench_kernel`), so that host launch overheads count on neither (`--eager-timing`:
one launch between CUDA events, host overheads included); a side whose capture fails is timed
eagerly and its ratio left out. Back-to-back launches on the same tensors keep what fits in the
L2 there, on both sides (a norm's "TB/s" is then not HBM bandwidth). It prints a table of times and ratios
(peer time / kiln time: above 1 is kiln faster) and checks that kiln's output matches the peer's where both are deterministic.
"""
import argparse, ctypes, json, math, os, re, sys
import torch
import torch.nn.functional as F

from cuda_timing import bench as bench_eager, bench_kernel

CUDA = ctypes.CDLL("libcuda.so.1")
SHARED_LIMIT = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
TMAP_DTYPE = {"F16": 6, "BF16": 9, "F32": 7}
SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}
TORCH_DTYPE = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "i64": torch.int64,
               "i32": torch.int32}


def check(status, what):
    if status != 0:
        name = ctypes.c_char_p()
        CUDA.cuGetErrorName(status, ctypes.byref(name))
        raise RuntimeError(f"{what}: {name.value.decode() if name.value else status}")


class TensorMap:
    """A 128-byte, 64-byte-aligned CUtensorMap encoded over a torch tensor, as kiln's runtime
    encodes them at load (runtime/src/cuda/tma.rs)."""

    def __init__(self, spec, tensor):
        self.raw = (ctypes.c_uint8 * 192)()
        base = ctypes.addressof(self.raw)
        self.address = (base + 63) // 64 * 64
        dims = (ctypes.c_uint64 * 4)(*spec["dims"])
        strides = (ctypes.c_uint64 * 3)(*spec["strides"])
        box = (ctypes.c_uint32 * 4)(*spec["box_dims"])
        unit = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
        check(CUDA.cuTensorMapEncodeTiled(
            ctypes.c_void_p(self.address), ctypes.c_int(TMAP_DTYPE[spec["dtype"]]), ctypes.c_uint32(4),
            ctypes.c_void_p(tensor.data_ptr()), dims, strides, box, unit,
            ctypes.c_int(0), ctypes.c_int(SWIZZLE[spec["swizzle_bytes"]]), ctypes.c_int(3), ctypes.c_int(0)),
            "cuTensorMapEncodeTiled")


class Kernel:
    """One generated kernel loaded into torch's context, launched on torch's current stream."""

    def __init__(self, case, directory):
        k = case["kernel"]
        self.name, self.launch_cfg = k["name"], k["launch"]
        ptx = open(os.path.join(directory, case["module"]), "rb").read() + b"\0"
        self.module = ctypes.c_void_p()
        check(CUDA.cuModuleLoadData(ctypes.byref(self.module), ptx), f"loading {self.name}")
        self.function = ctypes.c_void_p()
        check(CUDA.cuModuleGetFunction(ctypes.byref(self.function), self.module, self.name.encode()), self.name)
        shared = self.launch_cfg["shared_bytes"]
        if shared > 48 * 1024:
            check(CUDA.cuFuncSetAttribute(self.function, SHARED_LIMIT, shared), "shared memory limit")
        self.signature = k["signature"]
        self.scalars = case.get("scalars", {})

    def bind(self, tensors):
        """Keeps the argument values alive and returns the `void**` cuLaunchKernel takes."""
        self.values = []
        for name, kind in self.signature:
            if isinstance(kind, dict) and "TensorMap" in kind:
                self.values.append(TensorMap(kind["TensorMap"], tensors[name]))
            elif kind == "Ptr":
                self.values.append(ctypes.c_uint64(tensors[name].data_ptr()))
            elif kind == "U32":
                self.values.append(ctypes.c_uint32(self.scalars[name]))
            else:
                raise ValueError(f"{self.name}: parameter {name} of kind {kind} has no binding here")
        pointers = [ctypes.c_void_p(v.address) if isinstance(v, TensorMap) else ctypes.cast(ctypes.pointer(v), ctypes.c_void_p)
                    for v in self.values]
        self.params = (ctypes.c_void_p * len(pointers))(*[p.value for p in pointers])

    def __call__(self):
        g, b = self.launch_cfg["grid"], self.launch_cfg["block"]
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        check(CUDA.cuLaunchKernel(self.function, g[0], g[1], g[2], b[0], b[1], b[2],
                                  self.launch_cfg["shared_bytes"], stream, self.params, None), self.name)


def tensors_of(case):
    out = {}
    gen = torch.Generator(device="cuda").manual_seed(1)
    for name, (shape, dtype, scale) in case["buffers"].items():
        if dtype == "i64":
            out[name] = torch.full(shape, 1234, dtype=torch.int64, device="cuda")
        elif scale == 0:
            # Outputs, and scratch a kernel needs zero before its launch (split-K counters).
            out[name] = torch.zeros(shape, dtype=TORCH_DTYPE[dtype], device="cuda")
        else:
            out[name] = (torch.rand(shape, generator=gen, device="cuda") * 2 - 1).mul_(scale).to(TORCH_DTYPE[dtype])
    return out


def peers(case, t):
    """The peer computations of `case` over its tensors: name -> callable returning the output."""
    p = case["peer"]
    if p["kind"] == "matmul":
        epilogue = p.get("epilogue")
        if epilogue == "bias_gelu":
            return {"torch.matmul + eager bias, GELU": lambda: F.gelu(t["x"] @ t["w"].T + t["bias"], approximate="tanh")}
        if epilogue == "bias_gelu_erf":
            return {"torch.matmul + eager bias, GELU(erf)": lambda: F.gelu(t["x"] @ t["w"].T + t["bias"])}
        if epilogue == "swiglu":
            def swiglu():
                h = t["x"] @ t["w"].T
                gate, up = h.chunk(2, dim=-1)
                return F.silu(gate) * up
            return {"torch.matmul + eager SiLU(gate) * up": swiglu}
        if epilogue == "bias":
            return {"F.linear (cuBLAS bias epilogue)": lambda: F.linear(t["x"], t["w"], t["bias"])}
        if epilogue == "bias_residual":
            return {"torch.matmul + eager bias, residual": lambda: t["x"] @ t["w"].T + t["bias"] + t["residual"]}
        return {"torch.matmul": lambda: t["x"] @ t["w"].T}
    if p["kind"] == "layer_norm":
        cols = t["x"].shape[-1]
        return {"F.layer_norm": lambda: F.layer_norm(t["x"], (cols,), t["weight"], t["bias"], p["eps"])}
    if p["kind"] == "rms_norm":
        cols = t["x"].shape[-1]
        return {"F.rms_norm": lambda: F.rms_norm(t["x"], (cols,), t["weight"], p["eps"])}
    from torch.nn.attention import sdpa_kernel, SDPBackend
    q, k, v = t["q"], t["k"], t["v"]
    causal, dropout = p["causal"], p["dropout"]
    if p.get("window"):
        # A sliding window as a boolean mask (row i sees keys i - w < j <= i), on the backends
        # that take one; K/V expanded to the query heads outside the timed call.
        rows = torch.arange(q.shape[2], device="cuda")[:, None]
        keys = torch.arange(k.shape[2], device="cuda")[None, :]
        mask = (keys <= rows) & (keys > rows - p["window"])
        group = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

        def masked(backend):
            def run():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask, scale=p["scale"])
            return run
        return {"sdpa efficient, window mask": masked(SDPBackend.EFFICIENT_ATTENTION),
                "sdpa cudnn, window mask": masked(SDPBackend.CUDNN_ATTENTION)}

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout, scale=p["scale"],
                                                      enable_gqa=p.get("gqa", False))
        return run
    return {"sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION), "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}


def case_list(dirs, only):
    """The cases to run and the directory each comes from: one directory's as they are; for
    `label=dir` arguments, each case of the first in every build, alternating the order."""
    builds = [d.split("=", 1) if "=" in d else (None, d) for d in dirs]
    if len(builds) > 1 and any(label is None for label, _ in builds):
        sys.exit("bench-kernels: several case directories need a label each (label=DIR)")
    lists = []
    for label, directory in builds:
        cases = json.load(open(os.path.join(directory, "cases.json")))
        lists.append([c for c in cases if not only or re.search(only, c["case"])])
    if len(builds) == 1:
        return [(case, builds[0][1]) for case in lists[0]]
    by_name = [{c["case"]: c for c in cases} for cases in lists]
    entries = []
    for i, first in enumerate(lists[0]):
        name = first["case"]
        order = list(zip(builds, by_name))
        if i % 2:
            order.reverse()
        for (label, directory), cases in order:
            if name not in cases:
                print(f"{name}: not among {directory}'s cases", file=sys.stderr)
                continue
            entries.append((dict(cases[name], case=f"{name} [{label}]"), directory))
    return entries


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="+", help="a case directory, or label=DIR for each of several builds")
    ap.add_argument("--json")
    ap.add_argument("--eager-timing", action="store_true")
    ap.add_argument("--only", help="a regular expression: run only the cases whose name it matches")
    a = ap.parse_args()
    if a.eager_timing:
        def bench(fn):
            return bench_eager(fn), "eager"
    else:
        bench = bench_kernel
    torch.zeros(1, device="cuda")  # torch's primary context is current from here on
    entries = case_list(a.cases, a.only)
    records = []
    print(f"{'case':<40} {'kiln kernel':<44} {'kiln ms':>8}  {'peer':<30} {'peer ms':>8}  ratio (peer/kiln)", flush=True)
    for case, directory in entries:
        t = tensors_of(case)
        kernel = Kernel(case, directory)
        kernel.bind(t)
        kiln_ms, kiln_mode = bench(kernel)
        record = {"case": case["case"], "kernel": kernel.name, "path": case["kernel"]["path"],
                  "kiln_ms": kiln_ms, "kiln_timing": kiln_mode,
                  "kiln_TFLOPs": case["flops"] / kiln_ms / 1e9, "peers": {}}
        kernel(); torch.cuda.synchronize()
        got = t["out"].float()
        for name, fn in peers(case, t).items():
            try:
                ms, mode = bench(fn)
            except Exception as e:  # a backend may refuse the configuration
                record["peers"][name] = {"error": str(e)[:160]}
                continue
            entry = {"ms": ms, "timing": mode, "TFLOPs": case["flops"] / ms / 1e9, "ratio": ms / kiln_ms}
            if mode != kiln_mode:
                # Times taken two ways do not compare: the ratio is left out.
                entry["ratio"] = None
                print(f"{case['case']}: kiln timed as {kiln_mode}, {name} as {mode}", file=sys.stderr)
            if not case["peer"].get("dropout"):
                want = fn().float().reshape(got.shape)
                entry["rel_err"] = ((got - want).abs().max() / want.abs().max()).item()
            record["peers"][name] = entry
        records.append(record)
        # Kernels without FLOPs to count (norms) report the bytes their tensors hold, per second.
        moved = sum(x.numel() * x.element_size() for x in t.values())
        for name, e in record["peers"].items():
            if "error" in e:
                print(f"{case['case']:<40} {kernel.name[:44]:<44} {kiln_ms:8.4f}  {name:<30} {'refused':>8}", flush=True)
                continue
            err = f"{e['rel_err']:.1e}" if "rel_err" in e else "-"
            if case["flops"]:
                rate = f"{record['kiln_TFLOPs']:6.1f} vs {e['TFLOPs']:6.1f} TFLOP/s"
            else:
                rate = f"{moved / kiln_ms / 1e9:6.2f} vs {moved / e['ms'] / 1e9:6.2f} TB/s"
            ratio = f"{e['ratio']:5.2f}x" if e["ratio"] is not None else "  n/a "
            print(f"{case['case']:<40} {kernel.name[:44]:<44} {kiln_ms:8.4f}  {name:<30} {e['ms']:8.4f}  {ratio}  {rate}  err {err}", flush=True)
        del t
        torch.cuda.empty_cache()
    if a.json:
        json.dump(records, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
