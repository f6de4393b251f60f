"""What the tests share: record builders, IR fixtures, reference attention, service processes, fixtures.

Test files are named after what they test: `tests/test_<package>_<module>[_<aspect>].py`, where
<package> is the folder under kb/ (ir, lower, store) or the top-level package (ingest, retrieve, verify,
generate, bench, cli), e.g. kb/ir/text.py -> test_ir_text.py, ingest/lift_triton.py ->
test_ingest_lift_triton.py; modules of kb/ itself drop the package (kb/embed.py -> test_embed.py).
A test file imports what it shares from here, never from another test file.
"""
