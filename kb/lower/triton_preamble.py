"""The runtime preamble of every Triton module kb.lower.triton generates, as a module of its own.

The text between the two marker lines below is pasted, byte for byte, at the top of each generated module, so the
modules stand alone (they import only math, os, torch, triton and the standard library, and under the interpreter
kernel-kb's fixes for it); kept here it is linted and imported by tests like any other code. It holds:
- under TRITON_INTERPRET=1, the interpreter fixes of `kb.lower.interpreter_fixes` (imported only then);
- the device helpers the lowered expressions call (`_floordiv`, `_floormod`, `_tanh`) and their host twins (`_h*`);
- the block-class table: building it on the GPU (`_hblock_classes`), the per-row block lists
  (`_hblock_lists`) and the cache keyed by the mask's inputs (`_cached_table`);
- the design choice per GPU and shape bucket (`_choose`, which the forward's `_choose_design` and the backward's
  `_choose_bwd_design` call: the listed designs compiled together, `_compile_designs`, timed once per bucket,
  `_timed_choice`, and the choice kept on disk for later processes, `_keep_choice` / `_kept_choice`), the split-KV
  count rule (`_auto_splits`, `_split_rule`), the Hopper tensor-descriptor test (`_use_tma`) and the argument checks
  of the host function (`_bind`).

The helpers read `PROGRAM`, `DESIGNS`, `PROGRAM_DESIGN`, `TIME_DESIGNS` and `OP_NAME`, which each generated module defines after
the preamble (kb.lower.triton writes them); the placeholders at the end of this file stand in for them here.
"""

# ---- generated modules: preamble begins (pasted byte for byte; edit only between these lines) ----
import concurrent.futures
import contextvars
import json
import logging
import math
import weakref
import os

import torch
import triton
import triton.language as tl

_log = logging.getLogger("kernel_kb.generated")


if os.environ.get("TRITON_INTERPRET") == "1":  # Triton 3.6's interpreter needs fixes (bf16 dots among them)
    try:
        from kb.lower.interpreter_fixes import install as _install_interpreter_fixes
    except ImportError:
        _log.warning("TRITON_INTERPRET=1 without kernel-kb importable: Triton 3.6's interpreter multiplies bf16 "
                     "dots wrongly, so this module's results under it may be wrong")
    else:
        _install_interpreter_fixes()


@triton.jit
def _floordiv(a, b):
    q = a // b
    return tl.where((a % b != 0) & ((a < 0) != (b < 0)), q - 1, q)


@triton.jit
def _floormod(a, b):
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


# tanh as one MUFU op (PTX tanh.approx.f32, max relative error 2**-10.99), as FlashAttention-3's softcap: 2*sigmoid(2x)-1
# costs an exp2 and a reciprocal, which with the softmax's exp2 made a softcap kernel's inner loop MUFU-bound at D=128.
# The interpreter runs no PTX: there, the exact form.
_TANH_APPROX = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def _tanh(x):
    if _TANH_APPROX:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x.to(tl.float32)], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0


def _tensor(*xs):
    return any(isinstance(x, torch.Tensor) for x in xs)


def _hcdiv(a, b):
    return -(-a // b)


def _hmaximum(a, b):
    return torch.maximum(torch.as_tensor(a), torch.as_tensor(b)) if _tensor(a, b) else max(a, b)


def _hminimum(a, b):
    return torch.minimum(torch.as_tensor(a), torch.as_tensor(b)) if _tensor(a, b) else min(a, b)


def _hwhere(c, x, y):
    return torch.where(torch.as_tensor(c), torch.as_tensor(x), torch.as_tensor(y)) if _tensor(c, x, y) else (x if c else y)


def _hnot(x):
    return ~x if isinstance(x, torch.Tensor) else not x


def _hfloat(f):
    return lambda x: f(torch.as_tensor(x).float())


_hexp, _hexp2, _hlog, _htanh = _hfloat(torch.exp), _hfloat(torch.exp2), _hfloat(torch.log), _hfloat(torch.tanh)
_hsigmoid, _hsqrt, _habs = _hfloat(torch.sigmoid), _hfloat(torch.sqrt), lambda x: torch.as_tensor(x).abs()
_htrunc = lambda x: torch.as_tensor(x).long() if _tensor(x) else int(x)  # toward zero (IR trunc)


def _hload(t, idx):
    """t[idx] with broadcast index tensors; out-of-range elements read 0 (the IR's load rule)."""
    idx = torch.broadcast_tensors(*(torch.as_tensor(i, device=t.device).long() for i in idx))
    ok = torch.ones(idx[0].shape, dtype=torch.bool, device=t.device)
    for i, n in zip(idx, t.shape):
        ok &= (i >= 0) & (i < n)
    vals = t[tuple(torch.where(ok, i, 0) for i in idx)]
    return torch.where(ok, vals, torch.zeros((), dtype=t.dtype, device=t.device))


def _hblock_classes(launch, nb, nh, M, N, BLOCK_M, BLOCK_N, device):
    """[nb, nh, cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)] int8: 0 empty, 1 partial, 2 full (IR block classes), filled by
    `launch(bc)`: the module's block-class kernel, one program per tile (no Python loop over batches or blocks)."""
    bc = torch.empty(nb, nh, _hcdiv(M, BLOCK_M), _hcdiv(N, BLOCK_N), dtype=torch.int8, device=device)
    if bc.numel():
        launch(bc)
    return bc


_TABLES = {}  # block tables by (design, dims, scalars): the mask inputs they were built from, and the table


def _cached_table(key, mask_inputs, build):
    """The block table for these mask inputs, rebuilt only when one of them changed shape or contents (compared
    element by element with a copy kept here, so a new tensor at a reused address is never taken for the old).
    The very tensors of the last call, unmodified since (torch's version counter), skip the comparison and the
    device synchronisation it costs: a model passing one id tensor to every layer compares it once."""
    if _capturing():
        return build()  # in a CUDA graph: built by every replay from the inputs' contents then, never kept
    hit = _TABLES.get(key)
    if hit is not None:
        copies, table, seen = hit
        if all(ref() is a and a._version == version for a, (ref, version) in zip(mask_inputs, seen)):
            return table
        if all(a.shape == c.shape and a.dtype == c.dtype and a.device == c.device and torch.equal(a, c)
               for a, c in zip(mask_inputs, copies)):
            _TABLES[key] = (copies, table, _witness(mask_inputs))
            return table
    table = build()
    if len(_TABLES) >= 8:
        _TABLES.pop(next(iter(_TABLES)))
    _TABLES[key] = (tuple(a.detach().clone() for a in mask_inputs), table, _witness(mask_inputs))
    return table


def _witness(tensors):
    return tuple((weakref.ref(t), t._version) for t in tensors)


def _hblock_table(bc, by_kv=False):
    """(classes, block lists per query-block row[, per KV-block column: a backward's KV-outer query loops])."""
    if by_kv:
        return bc, _hblock_lists(bc), _hblock_lists(bc.transpose(2, 3))
    return bc, _hblock_lists(bc)


def _hblock_lists(block_class):
    """[nb, nh, nm, 2, 2 * nn + 1] int32 from the class table: for class c (0 partial, 1 full) of each
    row, entries [0, nn] count the blocks of that class before block j, then come their indices ascending."""
    nn = block_class.shape[-1]
    of_class = torch.stack((block_class == 1, block_class == 2), dim=3)
    out = torch.zeros(*of_class.shape[:-1], 2 * nn + 1, dtype=torch.int32, device=block_class.device)
    out[..., 1:nn + 1] = of_class.cumsum(-1)
    out[..., nn + 1:] = torch.argsort((~of_class).to(torch.int8), dim=-1, stable=True)
    return out


_PICKED = {}  # shape bucket (`_shape_bucket`) -> the design this module runs for its shapes (chosen once per bucket)


def _interpreting(t):
    return os.environ.get("TRITON_INTERPRET") == "1" or not t.is_cuda


def _capturing():
    """True inside a CUDA graph capture: no trial launch, timing or host-side cache may happen there."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _fits(design, launch, program):
    """Run `launch(design)`; False when the GPU cannot run the design (shared memory or registers)."""
    try:
        launch(design)
        return True
    except triton.runtime.errors.OutOfResources as err:
        _log.info("%s: design %s does not fit this GPU (%s)", program, design, err)
        return False


def _choose_design(t, D, key, launch):
    """The forward's design for inputs like `t` with head dim D (`_choose`, over DESIGNS)."""
    return _choose(t, D, key, launch, _PICKED, DESIGNS, PROGRAM_DESIGN, PROGRAM, TIME_DESIGNS, "call")


def _choose(t, D, key, launch, picked, designs, own, program, timed, what):
    """The design of `designs` ({arch: {head-dim bucket: designs best first}}) for inputs like `t` with head dim D,
    chosen once per shape bucket (`_shape_bucket(key)`) and kept in `picked`: on a GPU the table lists, the fastest
    of its designs that fit, timed on these shapes (`_timed_choice`; `timed` off, the first that fits); on another
    GPU, the fastest of every design listed for this head dim (else every listed design) and `own`, timed and
    logged; under the interpreter, `own`, the program's schedule (the one verified on CPU); inside a CUDA graph
    capture, `own`, not kept (no trial launch or timing may happen there). A timed choice is also kept on disk
    (`_keep_choice`), and a later process on the same GPU and Triton runs it without timing (`_kept_choice`)."""
    key = _shape_bucket(key)
    if key in picked:
        return picked[key]
    if _interpreting(t):
        picked[key] = own
        return own
    if _capturing():
        # trial launches would be captured, timing synchronises: the program's own schedule, not kept, so a call
        # outside a capture still chooses
        _log.warning("%s: first %s for shapes %s inside a CUDA graph capture: running the program's own design; "
                     "run one before capturing to run the design chosen for this GPU", program, what, key[2:])
        return own
    arch = "sm%d%d" % torch.cuda.get_device_capability(t.device)
    bucket = max(16, triton.next_power_of_2(D))
    listed = designs.get(arch, {}).get(bucket, ())
    timing = _time_designs(timed)
    if timing:
        kept = "%s|%s|triton %s|%r" % (what, torch.cuda.get_device_name(t.device), triton.__version__, key)
        choice = _kept_choice(kept, designs, own, launch, program)
        if choice is not None:
            picked[key] = choice
            return choice
        choice, timing = _timed_choice(listed, launch, key, program)
    else:
        _compile_designs(listed[:1], launch, program)
        choice = next((d for d in listed if _fits(d, launch, program)), None)
    if choice is None:
        # this head dim's designs on any arch, else every listed design (a head dim no table lists, e.g. 192)
        pool = [d for table in designs.values() for d in table.get(bucket, ())]
        pool = pool or _every_design(designs)
        pool = list(dict.fromkeys(pool + [own]))
        _compile_designs(pool, launch, program)
        timed_pool = _timings([d for d in pool if _fits(d, launch, program)], launch)
        if not timed_pool:
            raise RuntimeError(f"{program}: none of the designs {pool} runs on this GPU ({arch})")
        ms, choice = min(timed_pool)
        why = f"none of the {len(listed)} designs listed" if listed else "no design measured"
        _log.warning("%s: %s for %s at head dim %d fits; timed %d designs for shapes %s, running %s (%.3f ms)",
                     program, why, arch, D, len(timed_pool), key[2:], choice, ms)
    if timing:  # a choice by timing is kept for later processes; the first-that-fits rule needs none
        _keep_choice(kept, choice, program)
    picked[key] = choice
    return choice


def _every_design(designs):
    """Every design of a table {arch: {head-dim bucket: designs}}, in table order."""
    return [d for table in designs.values() for ds in table.values() for d in ds]


def _choices_file():
    """The file where this module keeps the designs its timings chose, for later processes on the same GPU:
    KB_DESIGN_CACHE_DIR, else $XDG_CACHE_HOME/kernel-kb/designs (~/.cache/...), named by OP_NAME (the KB id and this
    module's digest: another module, or this one regenerated differently, keeps its own); None without OP_NAME."""
    name = globals().get("OP_NAME")
    if name is None:
        return None
    root = os.environ.get("KB_DESIGN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "kernel-kb", "designs")
    return os.path.join(root, name + ".json")


def _read_choices(path, program):
    """{kept key: design} from `path`; {} where it is missing or unreadable (logged: it is rewritten whole next time)."""
    try:
        with open(path) as f:
            doc = json.load(f)
        return {k: tuple(v) for k, v in doc["choices"].items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        _log.warning("%s: ignoring the design choices in %s (%s)", program, path, err)
        return {}


def _kept_choice(kept, designs, own, launch, program):
    """The design an earlier process's timing chose for `kept` (what, GPU, Triton version, shape bucket), if it is
    one of this module's designs and fits; else None. A file is data from disk: anything else in it is ignored."""
    path = _choices_file()
    design = _read_choices(path, program).get(kept) if path else None
    if design is None:
        return None
    known = set(_every_design(designs)) | {own}
    if design not in known:
        return None
    _compile_designs([design], launch, program)
    if not _fits(design, launch, program):
        return None
    _log.info("%s: running %s for %s, as timed before (%s)", program, design, kept, path)
    return design


def _keep_choice(kept, design, program):
    """Adds `kept` -> `design` to this module's choices file (read, merged, replaced whole: a reader never sees half
    a file); a file that cannot be written costs only the timing in the next process."""
    path = _choices_file()
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        choices = {k: list(v) for k, v in _read_choices(path, program).items()}
        choices[kept] = list(design)
        tmp = "%s.%d.tmp" % (path, os.getpid())
        with open(tmp, "w") as f:
            json.dump({"schema": "kernel-kb/design-choices/v1", "choices": choices}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as err:
        _log.info("%s: could not keep the design choice in %s (%s)", program, path, err)


def _time_designs(on):
    """Whether a GPU the module lists designs for times them: the module's switch (TIME_DESIGNS; off in modules
    generated with --deterministic, whose results must not depend on which design a timing picked), unless
    KB_DESIGN_TIMING=0 turns it off for the process."""
    return on and os.environ.get("KB_DESIGN_TIMING", "1") != "0"


def _shape_bucket(key):
    """`key` with its sizes rounded up to powers of two: the shapes one choice serves. A sequence length that changes
    every step, or a decode cache that grows by a token a call, is chosen for (trial launches, timing) once per
    doubling, not at every new length. Whether a design fits depends on its tiles and the head dim's padding, not
    on these sizes."""
    return tuple(triton.next_power_of_2(x) if type(x) is int and x > 0 else x for x in key)


def _timings(designs, launch):
    """[(ms, design)] for `designs` (already known to fit), each timed by triton.testing.do_bench."""
    from triton.testing import do_bench

    return [(do_bench(lambda d=d: launch(d), warmup=5, rep=20), d) for d in designs]


def _timed_choice(listed, launch, key, program):
    """(design, measured): the fastest of the `listed` designs that fit (`_fits` runs one) on the shapes of `key`, a
    shape bucket (None when none fits); measured is False where no GPU memory was left to time them and the first
    that fits runs. The KB ranks designs from sweeps at other shapes, and its first pick ran at 0.91 (forward) / 0.96
    (backward) of a sweep's best where the fastest of its first four ran at 0.95 / 0.99 (leave one spec out:
    `python -m bench.design_ranking`)."""
    _compile_designs(listed, launch, program)
    fitting = [d for d in listed if _fits(d, launch, program)]
    if len(fitting) < 2:
        return (fitting[0] if fitting else None), True
    try:
        ms, choice = min(_timings(fitting, launch))
    except torch.cuda.OutOfMemoryError:  # do_bench flushes L2 with a 256 MB buffer: a model near the memory limit
        _log.warning("%s: no GPU memory left to time designs for shapes %s: running the first listed that fits, %s",
                     program, key[2:], fitting[0])
        return fitting[0], False
    _log.info("%s: timed %d listed designs for shapes %s: running %s (%.3f ms)", program, len(fitting), key[2:],
              choice, ms)
    return choice, True


# set by _compile_designs for its own thread only (a context variable): _kb_launch compiles (warmup) and launches
# nothing; another thread's calls meanwhile launch as always
_COMPILE_ONLY = contextvars.ContextVar("kb_compile_only", default=False)


def _compile_designs(designs, launch, program):
    """Compile the kernels of every design in `designs` (a backward design has three) at once, in threads (Triton's
    AsyncCompileMode: its MLIR passes and ptxas run without the GIL), so a first call that times N designs waits
    about one compile, not 3N; `launch` then finds them built. A design that fails here is left to its trial launch
    (`_fits`), which raises or reports the same error."""
    async_mode = getattr(triton, "AsyncCompileMode", None)
    active = getattr(getattr(triton.runtime, "_async_compile", None), "active_mode", None)
    if async_mode is None or not designs or (active is not None and active.get() is not None):
        return  # no such Triton, nothing to build, or the caller's own batch is open (they do not nest)
    workers = min(8, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool, async_mode(pool, ignore_errors=True):
        token = _COMPILE_ONLY.set(True)
        try:
            for design in designs:
                try:
                    launch(design)
                except Exception as err:  # e.g. a head dim the design cannot pad: its trial launch says so
                    _log.debug("%s: compiling design %s ahead failed (%s)", program, design, err)
        finally:
            _COMPILE_ONLY.reset(token)


def _design7(design):
    """A design tuple with its GQA-packing flag (tuples written before packing existed have 6 entries: no packing)."""
    return (*design, False)[:7]


_MIN_SPLIT_BLOCKS = 4  # no split shorter than this many KV blocks (each split costs a q load, a partial write and read)


def _auto_splits(programs, kv_blocks, device):
    """Split-KV count for a grid of `programs` (at one split; packed: B * Hkv * row blocks) over `kv_blocks` KV
    blocks, from the SM count (flash-decoding); 1 off CUDA. See _split_rule."""
    if device.type != "cuda":
        return 1
    return _split_rule(programs, kv_blocks, torch.cuda.get_device_properties(device).multi_processor_count)


def _split_rule(programs, kv_blocks, sms):
    """Enough programs for about two waves of `sms` SMs, no split shorter than _MIN_SPLIT_BLOCKS KV blocks, at most
    128; among [that count, twice it] the one that fills its last wave best (the smallest on ties); then the count
    whose splits are all non-empty (every split is a whole number of KV blocks, the last one possibly shorter)."""
    cap = max(1, min(128, kv_blocks // _MIN_SPLIT_BLOCKS))
    want = min(cap, _hcdiv(2 * sms, programs))
    if want <= 1:
        return 1
    busy = {n: programs * n / (_hcdiv(programs * n, sms) * sms) for n in range(want, min(cap, 2 * want) + 1)}
    best = max(busy, key=lambda n: (busy[n], -n))
    return _hcdiv(kv_blocks, _hcdiv(kv_blocks, best))


def _tma_alloc(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _use_tma(tensors, tile_sides):
    """The Hopper tensor-descriptor path (USE_TMA): a CUDA GPU of capability >= 9.0, not interpreting,
    tile sides <= 256, every tensor's last dim contiguous, its base and other strides 16-byte aligned."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not tensors or not all(t.is_cuda for t in tensors):
        return False
    if torch.cuda.get_device_capability(tensors[0].device) < (9, 0) or max(tile_sides) > 256:
        return False
    for t in tensors:
        if t.dim() < 2 or t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * t.element_size() % 16 for s in t.stride()[:-1]):
            return False
    triton.set_allocator(_tma_alloc)  # device-side descriptors live in a small global scratch
    return True


class ForwardArgumentError(ValueError):
    """Bad arguments to forward(): a missing aux tensor or scalar, or inconsistent shapes."""


def _bind(dims, name, t, spec):
    if t.dim() != len(spec):
        raise ForwardArgumentError(f"{name}: expected {len(spec)} dims {spec}, got shape {tuple(t.shape)}")
    for d, n in zip(spec, t.shape):
        if isinstance(d, int):
            if d != n:
                raise ForwardArgumentError(f"{name}: expected size {d}, got shape {tuple(t.shape)}")
        elif dims.setdefault(d, n) != n:
            raise ForwardArgumentError(f"{name}: dim {d} is {n} here but {dims[d]} elsewhere")

# ---- launch plans: what forward() allocates and launches for one call signature, replayed without deciding again


_PLANS = {}  # call key -> _Plan (at most _MAX_PLANS; the oldest goes first)
_MAX_PLANS = 64
_UNPLANNED = object()  # in a call key: a value the plan cannot hold (a tensor where a scalar goes)


def _tkey(t):
    """What a launch depends on in a tensor: shape, strides, dtype, device and 16-byte alignment (Triton specialises
    pointers on it, and the tensor-descriptor path needs it)."""
    if not isinstance(t, torch.Tensor):
        return _UNPLANNED  # a missing or wrong argument: the host function says what is wrong
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0


def _skey(x):
    """A scalar argument as a call key holds it: its value, or _UNPLANNED (a tensor is read on the host, so no plan)."""
    return x if x is None or isinstance(x, (int, float)) else _UNPLANNED


class _Plan:
    """The allocations and kernel launches of one forward() call, replayable for any call with the same key: the key
    (_tkey of every tensor, the scalars, the forced design) fixes every shape, stride, grid, constexpr and design.
    A compiled kernel is launched directly, skipping Triton's per-call binding and specialisation, which would only
    find the same kernel again; under the interpreter each launch goes through Triton as usual."""

    def __init__(self):
        self.allocs, self.launches, self.returns, self.tma = [], [], (), False

    def replay(self, inputs):
        env = list(inputs)
        for factory, shape, dtype, device in self.allocs:
            env.append(factory(shape, dtype=dtype, device=device))
        if self.tma:
            triton.set_allocator(_tma_alloc)
        for run, args, slots in self.launches:
            args = list(args)
            for pos, slot in slots:
                args[pos] = env[slot]
            run(*args)
        return tuple(env[i] for i in self.returns)


class _Recorder:
    """Watches one forward() call (through _kb_alloc and _kb_launch) and makes its _Plan; tensors are told apart by
    identity: the call's inputs, then what it allocated. Anything else (a cached block table) makes no plan."""

    def __init__(self, inputs):
        self.plan, self.slots, self.ok = _Plan(), {id(t): i for i, t in enumerate(inputs)}, True

    def alloc(self, factory, shape, dtype, t):
        self.slots[id(t)] = len(self.slots)
        self.plan.allocs.append((factory, shape, dtype, t.device))

    def launch(self, fn, grid, args, constexprs, num_warps, num_stages, kernel):
        slots = [(i, self.slots.get(id(a))) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.ok = self.ok and all(s is not None for _, s in slots)
        static = [None if isinstance(a, torch.Tensor) else a for a in args]
        names = getattr(fn, "arg_names", None)
        if kernel is not None and hasattr(kernel, "__getitem__") and names is not None:
            # a compiled kernel takes every argument in signature order, constexprs included, and a 3-axis grid
            grid = (*grid, 1, 1)[:3]
            self.plan.launches.append((kernel[grid], (*static, *(constexprs[n] for n in names[len(args):])), slots))
        else:
            self.plan.launches.append((_jit_launch(fn, grid, constexprs, num_warps, num_stages), static, slots))
        self.plan.tma = self.plan.tma or bool(constexprs.get("USE_TMA"))

    def finish(self, outs):
        ret = tuple(self.slots.get(id(t)) for t in outs)
        if not self.ok or None in ret:
            return None
        self.plan.returns = ret
        return self.plan


def _jit_launch(fn, grid, constexprs, num_warps, num_stages):
    return lambda *args: fn[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)


def _kb_alloc(rec, factory, shape, dtype, device):
    """factory(shape, dtype=dtype, device=device) (torch.empty or torch.zeros), seen by the recorder `rec` (or None)."""
    t = factory(shape, dtype=dtype, device=device)
    if rec is not None:
        rec.alloc(factory, shape, dtype, t)
    return t


def _kb_launch(rec, fn, grid, args, num_warps, num_stages, **constexprs):
    """fn[grid](*args, **constexprs) with the launch options, seen by the recorder `rec` (or None); while
    `_compile_designs` runs, the kernel is only compiled."""
    if _COMPILE_ONLY.get():
        fn.warmup(*args, grid=grid, **constexprs, num_warps=num_warps, num_stages=num_stages)
        return
    kernel = fn[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
    if rec is not None:
        rec.launch(fn, grid, args, constexprs, num_warps, num_stages, kernel)


def _kb_planned(key, inputs, run):
    """run(rec): the forward call recorded, its plan kept under `key` for the calls after it (see _Plan)."""
    if _UNPLANNED in key:
        return run(None)
    rec = _Recorder(inputs)
    outs = run(rec)
    plan = rec.finish(outs)
    if plan is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = plan
    return outs


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _direct(tensors):
    """An eager call that needs no autograd and no tracing: plain tensors (no fake or wrapper subclasses), grad not
    needed, not inside torch.compile and no dispatch or function mode active. Such a call skips the operator's
    dispatcher and runs the host function itself; any other goes through the registered operator."""
    c = torch._C
    if torch.compiler.is_compiling() or c._len_torch_dispatch_stack() or c._is_torch_function_mode_enabled():
        return False
    grad = torch.is_grad_enabled()
    return all(type(t) in _PLAIN_TENSORS and not (grad and t.requires_grad) for t in tensors)
# ---- generated modules: preamble ends ----

# placeholders for the generated module's own constants (see the module docstring)
PROGRAM = "triton_preamble"
DESIGNS: dict = {}
PROGRAM_DESIGN = (64, 64, 1, 4, 2, False, False)
TIME_DESIGNS = True
OP_NAME = None
