"""kvtier, the application on top: the `kvtier` command line (`kvtier.cli`), the demo, and
the figure tables every benchmark and the demo print (`kvtier.report`).

The libraries underneath import nothing from here: `kernels` and `transfer` at the bottom,
`kvstore` (the storage tier, its daemon and SDK) above them, `engine_adapter` (the engine
and its serving cluster) above that, and `kvtier` on top (tests/unit/test_layers.py).
"""
