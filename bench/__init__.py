"""kvtier's benchmarks: one module per figure, each measuring its baseline in the same run,
printing the shared table (kvtier.report) and taking `--json PATH`.

    python -m bench.store_tiers      # or: kvtier bench store
"""
