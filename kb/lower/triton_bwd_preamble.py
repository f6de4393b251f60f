"""The runtime of generated Triton backward modules (after the forward preamble), as a module of its own.

The text between the two marker lines below is pasted, byte for byte, into each module kb.lower.triton_bwd generates,
right after the forward preamble (kb/lower/triton_preamble.py), whose names (torch, `_choose`) it uses; here they are
imported, so the text is linted and imported by tests like any other code. It holds:
- the backward's own design choice per GPU and shape bucket (`_choose_bwd_design`, cache `_BWD_PICKED`), the
  forward preamble's `_choose` over its own table, apart from the forward's so that a module can hold both
  (kb.lower.triton_bwd.lower_autograd);
- the order of a backward kernel's programs per launch (`_longest_first`, the HEAVY_FIRST constexpr).

The helpers read `BWD_PROGRAM`, `BWD_DESIGNS`, `BWD_PROGRAM_DESIGN` and `BWD_TIME_DESIGNS`, which each generated backward module defines
after its kernels (kb.lower.triton_host.backward_design_lines writes them); the placeholders at the end of this file
stand in for them here.
"""


import torch

from kb.lower.triton_preamble import _choose  # one namespace with the forward preamble when pasted

# ---- generated modules: preamble begins (pasted byte for byte; edit only between these lines) ----
_BWD_PICKED = {}  # shape bucket -> the design the backward runs for its shapes (chosen once per bucket)


def _longest_first(programs, device):
    """A backward kernel's grid in order of program length (HEAVY_FIRST) where it is at most 4 waves of the GPU's SMs:
    there the last wave's long programs set the time; over more waves the head-by-head order's L2 reuse counts
    more (measured at 2 waves, faster, and 31, slower; 4 lies between, untuned). False off CUDA."""
    return device.type == "cuda" and programs <= 4 * torch.cuda.get_device_properties(device).multi_processor_count


def _choose_bwd_design(t, D, key, launch):
    """The backward's design for inputs like `t` with head dim D: the forward preamble's `_choose` over BWD_DESIGNS,
    kept apart from the forward's (a module holds both)."""
    return _choose(t, D, key, launch, _BWD_PICKED, BWD_DESIGNS, BWD_PROGRAM_DESIGN, BWD_PROGRAM, BWD_TIME_DESIGNS,
                   "backward")
# ---- generated modules: preamble ends ----

# placeholders for the generated module's own constants (see the module docstring)
BWD_PROGRAM = "triton_bwd_preamble"
BWD_DESIGNS: dict = {}
BWD_PROGRAM_DESIGN = (64, 64, 1, 4, 2, False, False)
BWD_TIME_DESIGNS = True
