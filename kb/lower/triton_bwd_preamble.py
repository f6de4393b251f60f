"""The runtime of generated Triton backward modules (after the forward preamble), as a module of its own.

The text between the two marker lines below is pasted, byte for byte, into each module kb.lower.triton_bwd generates,
right after the forward preamble (kb/lower/triton_preamble.py), whose names (os, torch, triton, tl, `_log`,
`_interpreting`) it uses; here they are imported from there, so the text is linted and imported by tests like any other
code. It holds:
- the backward's own design choice per GPU and shape (`_choose_bwd_design`, `_bwd_fits`, cache `_BWD_PICKED`),
  apart from the forward's `_choose_design` so that a module can hold both (kb.lower.triton_bwd.lower_autograd);
- the order of a backward kernel's programs per launch (`_longest_first`, the HEAVY_FIRST constexpr).

The helpers read `BWD_PROGRAM`, `BWD_DESIGNS` and `BWD_PROGRAM_DESIGN`, which each generated backward module defines
after its kernels (kb.lower.triton_host.backward_design_lines writes them); the placeholders at the end of this file
stand in for them here.
"""


import torch
import triton

from kb.lower.triton_preamble import (  # one namespace with the forward preamble when pasted
    _capturing,
    _interpreting,
    _log,
    _shape_bucket,
    _time_designs,
    _timed_choice,
    _timings,
)

# ---- generated modules: preamble begins (pasted byte for byte; edit only between these lines) ----
_BWD_PICKED = {}  # shape bucket -> the design the backward runs for its shapes (chosen once per bucket)


def _longest_first(programs, device):
    """A backward kernel's grid in order of program length (HEAVY_FIRST) where it is at most 4 waves of the GPU's SMs:
    there the last wave's long programs set the time; over more waves the head-by-head order's L2 reuse counts
    more (measured at 2 waves, faster, and 31, slower; 4 lies between, untuned). False off CUDA."""
    return device.type == "cuda" and programs <= 4 * torch.cuda.get_device_properties(device).multi_processor_count


def _bwd_fits(design, launch):
    """Run the backward at `design`; False when the GPU cannot run it (shared memory or registers)."""
    try:
        launch(design)
        return True
    except triton.runtime.errors.OutOfResources as err:
        _log.info("%s: design %s does not fit this GPU (%s)", BWD_PROGRAM, design, err)
        return False


def _choose_bwd_design(t, D, key, launch):
    """The backward's design for inputs like `t` with head dim D: the fastest of BWD_DESIGNS for this GPU and head dim
    that fit, timed on these shapes as the forward's (`_timed_choice`; with timing off, the first that fits); else
    the fastest of those listed for the head dim on any arch and the program's schedule, timed; under the interpreter
    or inside a CUDA graph capture, the program's own schedule. One choice per shape bucket (`_shape_bucket`)."""
    key = _shape_bucket(key)  # one choice serves every shape of its bucket, as the forward's
    if key in _BWD_PICKED:
        return _BWD_PICKED[key]
    if _interpreting(t):
        _BWD_PICKED[key] = BWD_PROGRAM_DESIGN
        return BWD_PROGRAM_DESIGN
    if _capturing():
        # as the forward's _choose_design: no trial launch or timing inside a capture, nothing kept
        _log.warning("%s: first backward for shape %s inside a CUDA graph capture: running the program's own design; "
                     "run one backward before capturing to run the design chosen for this GPU", BWD_PROGRAM, key[2:])
        return BWD_PROGRAM_DESIGN
    arch = "sm%d%d" % torch.cuda.get_device_capability(t.device)
    bucket = max(16, triton.next_power_of_2(D))
    listed = BWD_DESIGNS.get(arch, {}).get(bucket, ())
    if _time_designs(BWD_TIME_DESIGNS):
        choice = _timed_choice(listed, launch, _bwd_fits, key, BWD_PROGRAM)
    else:
        choice = next((d for d in listed if _bwd_fits(d, launch)), None)
    if choice is None:
        pool = [d for table in BWD_DESIGNS.values() for d in table.get(bucket, ())]
        pool = list(dict.fromkeys(pool + [BWD_PROGRAM_DESIGN]))
        timed = _timings([d for d in pool if _bwd_fits(d, launch)], launch)
        if not timed:
            raise RuntimeError(f"{BWD_PROGRAM}: none of the designs {pool} runs on this GPU ({arch})")
        ms, choice = min(timed)
        _log.warning("%s: no listed backward design for %s at head dim %d fits; timed %d for shape %s, running %s "
                     "(%.3f ms)", BWD_PROGRAM, arch, D, len(timed), key[2:], choice, ms)
    _BWD_PICKED[key] = choice
    return choice
# ---- generated modules: preamble ends ----

# placeholders for the generated module's own constants (see the module docstring)
BWD_PROGRAM = "triton_bwd_preamble"
BWD_DESIGNS: dict = {}
BWD_PROGRAM_DESIGN = (64, 64, 1, 4, 2, False, False)
BWD_TIME_DESIGNS = True
