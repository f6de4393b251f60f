"""Rebuild the offline FlashInfer bundle a GPU machine installs for the serving baseline (measuring only).

    python -m bench.gpu.flashinfer_wheels OUT_DIR [--no-aot] [--only decode|sink|ragged|bidir ...] [--jobs N]

Writes into OUT_DIR, through pip's configured index (pinned versions, no network needed on the device):
- `flashinfer_python-0.7.4-py3-none-any.whl`: the release wheel (sha256 checked against FLASHINFER_SHA256), slimmed
  from ~101 MB to ~18 MB by the keep rules below, RECORD regenerated;
- `apache_tvm_ffi-0.1.15.post2-cp312-*.whl`, `packaging-26.4-py3-none-any.whl`: its two dependencies that a
  Python 3.12 / torch 2.11+cu130 machine lacks, for cp312 manylinux x86_64;
- `curand_include.tgz`: the cuRAND headers (from the nvidia-curand wheel) that FlashInfer's sources include and a
  CUDA toolkit without cuRAND lacks (a JIT build on the device needs them too);
- `aot/<module>/<module>.so` (unless --no-aot): the four JIT modules bench/gpu/serving_flashinfer.py loads at the
  held-out serving specs' BENCH shapes (bench/heldout_serving), built here for sm_90a with the local nvcc, linked
  against an empty stub libcuda (no driver here), so the device never compiles;
- `README.txt`: the device-side install snippet.
Bench tooling only: nothing in the product imports it. Builds take minutes each (decode ~25 s, the others 3-8 min on
2 cores); --only picks modules.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

__all__ = ["main", "slim_wheel", "FLASHINFER", "FLASHINFER_SHA256"]

FLASHINFER = "flashinfer-python==0.7.4"
FLASHINFER_SHA256 = "a051a62e09a2738e8b0de47a1944fd2f0f3eff01b728b662141ea660cb09dd32"
DEVICE_DEPS = ("apache-tvm-ffi==0.1.15.post2", "packaging==26.4")  # for the device: cp312 manylinux
HOST_DEPS = ("apache-tvm-ffi==0.1.15.post2", "einops==0.8.2", "tabulate==0.10.0", "nvidia-ml-py==13.615.71")  # import here
CURAND = "nvidia-curand==10.4.4.72"  # its nvidia/cu13/include/curand*.h
CUDA_HOME = "/usr/local/cuda"
ARCH = "9.0a"
_DIST_INFO = "flashinfer_python-0.7.4.dist-info/"

# The keep rules (everything else in the wheel is dropped). `import flashinfer` and the attention JIT generators were
# traced with 0.7.4 on CPU: the package directories they import from are _IMPORTED_DIRS, kept whole (the package data
# beside a module, e.g. build.json, *_workloads.json, goes with it); dropped are the unimported Python trees (cute_dsl
# attention, experimental/b12x, comm, ...) and the other ops' vendored csrc/ (together ~83 of the 101 MB).
_KEEP_PREFIXES = (
    _DIST_INFO,  # metadata (RECORD is rewritten)
    "flashinfer/jit/",  # the JIT generators (all Python)
    # the headers an attention module's sources include
    "flashinfer/data/include/", "flashinfer/data/cccl/", "flashinfer/data/spdlog/",
    "flashinfer/data/cutlass/include/", "flashinfer/data/cutlass/tools/util/include/",
)
_IMPORTED_DIRS = """. attention attn_scores autotuner cudnn cute_dsl cutile experimental experimental/cake_nvfp4_per_token
    cake_causal_conv1d_det_train_backend cake_gated_act_mxfp8_backend cake_gdp_backend cake_mhc_det_train_backend
    cake_mhc_det_train_head_backend cake_muse_spark_norm_backend cake_rmsnorm_det_train_backend
    cake_rmsnorm_silu_gate_det_train_backend cake_rmsnorm_silu_gate_train_backend cake_rmsnorm_train_backend
    fused_moe fused_moe/backends fused_moe/backends/cudnn_frost fused_moe/backends/cudnn_frost/bf16
    fused_moe/backends/cudnn_frost/mxfp8 fused_moe/backends/cudnn_frost/mxfp8_mxfp4 fused_moe/backends/cudnn_frost/nvfp4
    fused_moe/backends/frost_low_latency fused_moe/backends/frost_low_latency/fma fused_moe/backends/trtllm
    fused_moe/cute_dsl fused_moe/shared gdn_kernels gdn_kernels/blackwell gdn_kernels/delta_rule_dsl
    gdn_kernels/experimental gemm gemm/kernels gemm/kernels/native_bf16_fp4 grouped_mm grouped_mm/cudnn
    grouped_mm/cute_sm120_fp8_groupwise grouped_mm/cute_sm120_mxfp8_groupwise kda_kernels kda_kernels/sm120_prefill
    mamba megamoe mla mla/_batch_mla mla/_batch_mla/_backends msa_ops norm prims_ts prims_ts/gemm quantization
    topk_varlen trace trace/templates"""
# files directly in these directories; data/csrc: its top level holds the attention sources and templates (its
# subdirectories are the other ops' kernels)
_KEEP_FILES_IN: tuple[str, ...] = ("flashinfer/data/csrc", *("flashinfer" if d == "." else f"flashinfer/{d}"
                                                             for d in _IMPORTED_DIRS.split()))
MODULES = ("decode", "sink", "ragged", "bidir")


class BuildError(Exception):
    """A step failed; its message is the one-line error main prints."""


def _say(msg: str) -> None:
    print(f"[flashinfer_wheels] {msg}", flush=True)


def _pip_download(dest: Path, reqs: tuple[str, ...], *extra: str) -> list[Path]:
    """`pip download --no-deps` of pinned requirements into dest (a fresh directory); the files it wrote."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "off",
           "-d", str(dest), *extra, *reqs]
    got = subprocess.run(cmd, capture_output=True, text=True)
    if got.returncode != 0:
        raise BuildError(f"pip download {' '.join(reqs)} failed: {(got.stderr.strip().splitlines() or ['?'])[-1]}")
    return sorted(dest.iterdir())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _kept(name: str) -> bool:
    if name == _DIST_INFO + "RECORD":
        return False
    return name.startswith(_KEEP_PREFIXES) or os.path.dirname(name) in _KEEP_FILES_IN


def slim_wheel(src: Path, out: Path) -> int:
    """Repack src into out keeping the files _kept names, with a RECORD of their sha256; the number of files kept."""
    record = []
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in sorted(zin.infolist(), key=lambda i: i.filename):
            if info.is_dir() or not _kept(info.filename):
                continue
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{info.filename},sha256={digest},{len(data)}")
        record.append(f"{_DIST_INFO}RECORD,,")
        zout.writestr(_DIST_INFO + "RECORD", "\n".join(record) + "\n")
    return len(record) - 1


def _curand_headers(whl: Path, dest: Path, tgz: Path) -> None:
    """nvidia/cu13/include/curand*.h of the wheel into dest, and as a tgz of those files (at its root)."""
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(whl) as z, tarfile.open(tgz, "w:gz") as tar:
        names = sorted(n for n in z.namelist() if n.startswith("nvidia/cu13/include/curand"))
        if not names:
            raise BuildError(f"no nvidia/cu13/include/curand*.h in {whl.name}")
        for n in names:
            data = z.read(n)
            (dest / Path(n).name).write_bytes(data)
            ti = tarfile.TarInfo(Path(n).name)
            ti.size, ti.mode = len(data), 0o644
            tar.addfile(ti, io.BytesIO(data))


def _spec_module(stem: str) -> ModuleType:
    return importlib.import_module(f"bench.heldout_serving.{stem}")


def _jit_specs(fi_modules: ModuleType, fi_core: ModuleType, only: tuple[str, ...]) -> dict[str, Any]:
    """The JitSpecs serving_flashinfer.py's wrappers resolve to on sm90a, at each spec's BENCH head dim and its dtype
    (q of get_inputs(); all bf16); idx int32 throughout."""
    def dim_dtype(stem: str) -> tuple[ModuleType, int, torch.dtype]:
        spec = _spec_module(stem)
        return spec, int(spec.BENCH["D"]), spec.get_inputs()[0].dtype

    M, i32 = fi_modules, torch.int32
    out: dict[str, Any] = {}
    if "decode" in only:  # BatchDecodeWithPagedKVCacheWrapper, pos_encoding_mode ALIBI (2), no window, no softcap
        _, d, dt = dim_dtype("paged_gqa_decode_alibi")
        out["decode"] = M.gen_batch_decode_module(dt, dt, dt, i32, d, d, 2, False, False)
    if "sink" in only:  # BatchDecodeWithAttentionSinkWrapper: fa3 (auto on sm90a), window_left = WINDOW - 1
        spec, d, dt = dim_dtype("paged_decode_window_sinks")
        sink_args = fi_core.BatchAttentionWithAttentionSinkWrapper._sink_jit_args
        backend, args, kw = sink_args(torch.device("cuda"), "fa3", dt, dt, d, d, int(spec.WINDOW) - 1)
        out["sink"] = M.gen_customize_batch_prefill_module(backend, *args, **kw)
    if "ragged" in only:  # BatchPrefillWithRaggedKVCacheWrapper: fa3 (auto on sm90a), causal, logits_soft_cap
        _, d, dt = dim_dtype("varlen_prefill_softcap")
        out["ragged"] = M.gen_batch_prefill_module("fa3", dt, dt, dt, i32, d, d, 0, False, True, False, False)
    if "bidir" in only:  # BatchPrefillWithCausalBidirectionalRangesWrapper (fa2 only)
        _, d, dt = dim_dtype("chunked_prefill_prefix_lm")
        out["bidir"] = M.gen_batch_prefill_bidirectional_ranges_module(dt, dt, dt, i32, d, d, False)
    return out


def _build_aot(out_dir: Path, work: Path, slim: Path, curand: Path, only: tuple[str, ...], jobs: int) -> None:
    """Install the slimmed wheel for this Python, build the modules with nvcc for sm_90a, copy them to OUT/aot."""
    nvcc = Path(CUDA_HOME) / "bin" / "nvcc"
    if not nvcc.exists():
        raise BuildError(f"no nvcc at {nvcc} (CUDA_HOME)")
    site, stubs = work / "site", work / "stubs"
    t = time.time()
    deps = _pip_download(work / "host_deps", HOST_DEPS)
    got = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet", "--target",
                          str(site), str(slim), *map(str, deps)], capture_output=True, text=True)
    if got.returncode != 0:
        raise BuildError(f"pip install --target {site} failed: {(got.stderr.strip().splitlines() or ['?'])[-1]}")
    stubs.mkdir()  # -lcuda needs a libcuda.so to link against; the driver supplies the real one at load time
    (stubs / "stub.c").write_text("\n")
    cc = subprocess.run(["cc", "-shared", "-fPIC", "-o", str(stubs / "libcuda.so"), str(stubs / "stub.c")],
                        capture_output=True, text=True)
    if cc.returncode != 0:
        raise BuildError(f"stub libcuda.so: {cc.stderr.strip()[:200]}")
    os.environ.update(CUDA_HOME=CUDA_HOME, FLASHINFER_CUDA_ARCH_LIST=ARCH, FLASHINFER_WORKSPACE_BASE=str(work / "ws"),
                      FLASHINFER_EXTRA_LDFLAGS=f"-L{stubs}", FLASHINFER_EXTRA_CUDAFLAGS=f"-isystem {curand}",
                      MAX_JOBS=str(jobs))
    sys.path.insert(0, str(site))
    fi_modules = importlib.import_module("flashinfer.jit.attention.modules")
    fi_core = importlib.import_module("flashinfer.attention._core")
    _say(f"host site ready ({time.time() - t:.0f} s)")
    for key, spec in _jit_specs(fi_modules, fi_core, only).items():
        name = str(spec.name)
        t = time.time()
        _say(f"building {key}: {name} ...")
        try:
            spec.build(verbose=False)
        except Exception as err:
            raise BuildError(f"building {name} failed: {type(err).__name__}: {str(err).strip()[-300:]}") from err
        so = Path(spec.jit_library_path)
        dest = out_dir / "aot" / name / f"{name}.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, dest)
        _say(f"built {key} in {time.time() - t:.0f} s: aot/{name}/{name}.so ({dest.stat().st_size >> 10} KiB)")


_README = """FlashInfer 0.7.4 for bench/gpu/serving_flashinfer.py on a GPU machine (Python 3.12, torch 2.11+cu130, no network).
Rebuild: python -m bench.gpu.flashinfer_wheels OUT_DIR   (see its docstring). {aot}

OUT=/path/to/this/dir
pip install --no-index --no-deps --target /tmp/site $OUT/*.whl
[ -d $OUT/aot ] && mkdir -p /tmp/site/flashinfer/data/aot && cp -r $OUT/aot/. /tmp/site/flashinfer/data/aot/
mkdir -p /tmp/curand_include && tar xzf $OUT/curand_include.tgz -C /tmp/curand_include
export PYTHONPATH=/tmp/site${{PYTHONPATH:+:$PYTHONPATH}} FLASHINFER_CUDA_ARCH_LIST={arch} \\
       FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer_ws FLASHINFER_EXTRA_CUDAFLAGS="-isystem /tmp/curand_include"
python -c "import flashinfer; print(flashinfer.__version__)"   # smoke import: 0.7.4
# `import flashinfer` imports pynvml (flashinfer/utils.py): the image must have nvidia-ml-py.
"""


def _aot_note(out: Path) -> str:
    built = sorted(p.name for p in (out / "aot").glob("*/*.so"))
    if not built:
        return "No AOT modules: the device JIT-compiles (needs nvcc)."
    nvcc = subprocess.run([str(Path(CUDA_HOME) / "bin" / "nvcc"), "--version"], capture_output=True, text=True)
    version = (nvcc.stdout.strip().splitlines() or ["nvcc ?"])[-1]
    return f"AOT modules (sm_{ARCH.replace('.', '')}, {version}):\n" + "\n".join(f"  {n}" for n in built)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the bundle's directory (created; files of the same name replaced)")
    ap.add_argument("--no-aot", action="store_true", help="skip building the JIT modules")
    ap.add_argument("--only", nargs="+", choices=MODULES, default=list(MODULES), help="build only these modules")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel nvcc jobs (MAX_JOBS)")
    args = ap.parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="flashinfer_wheels-") as tmp:
            work = Path(tmp)
            t = time.time()
            (whl,) = _pip_download(work / "release", (FLASHINFER,))
            if (sha := _sha256(whl)) != FLASHINFER_SHA256:
                raise BuildError(f"sha256 mismatch for {whl.name}: expected {FLASHINFER_SHA256}, got {sha}")
            _say(f"downloaded {whl.name} ({whl.stat().st_size >> 20} MiB, sha256 ok) in {time.time() - t:.0f} s")
            t, slim = time.time(), out / whl.name
            n = slim_wheel(whl, slim)
            _say(f"slimmed to {n} files, {slim.stat().st_size / 2**20:.1f} MiB in {time.time() - t:.0f} s")
            t = time.time()
            platform = ("--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--platform",
                        "manylinux_2_28_x86_64", "--platform", "manylinux_2_24_x86_64")
            for dep in _pip_download(work / "device_deps", DEVICE_DEPS, *platform):
                shutil.copy2(dep, out / dep.name)
                _say(f"fetched {dep.name}")
            (curand_whl,) = _pip_download(work / "curand", (CURAND,))
            _curand_headers(curand_whl, work / "curand_include", out / "curand_include.tgz")
            _say(f"dependency wheels and curand_include.tgz in {time.time() - t:.0f} s")
            if not args.no_aot:
                _build_aot(out, work, slim, work / "curand_include", tuple(args.only), args.jobs)
        (out / "README.txt").write_text(_README.format(arch=ARCH, aot=_aot_note(out)))
    except (BuildError, OSError, subprocess.SubprocessError) as err:
        print(f"flashinfer_wheels: error: {err}", file=sys.stderr)
        return 1
    _say(f"done in {time.time() - start:.0f} s: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
