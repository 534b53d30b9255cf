"""bench.store_service's timing helper: a row and its baselines run in turns, the order
rotating (figures are not checked: tests never time things)."""
from bench.store_service import paired


def test_paired_runs_each_function_in_turns_with_a_rotating_order():
    order = []
    fns = [lambda k=k: order.append(k) for k in "abc"]
    stats = paired(fns, nbytes=1, seconds=0.0, turns=3)
    assert len(stats) == 3 and all(s.gbps > 0 and s.p99_us >= s.p50_us for s in stats)
    assert order[:3] == list("abc")  # the warm-up
    runs = [order[3]]  # the letters of each uninterrupted run, after the warm-up
    for k in order[4:]:
        if k != runs[-1][-1]:
            runs.append("")
        runs[-1] += k
    assert [r[0] for r in runs] == list("abc" "bca" "cab")
    assert all(len(r) >= 5 for r in runs)  # a turn is never a single call


def test_twin_row_times_one_copy_as_long_as_the_ops_p50():
    from bench.store_service import Stats, _twin_row
    sizes, calls = [], []

    def make_copy(n):
        sizes.append(n)
        return lambda: calls.append(n)
    row = _twin_row("shm put 256KiB x1", Stats(1.0, 33.0, 500.0), Stats(1.0, 24.0, 40.0),
                    make_copy, nbytes=1000, seconds=0.0)
    assert row.case == "shm put 256KiB x1 p99" and row.value == 500.0
    assert row.baseline == "a memcpy as long as its p50"
    assert sizes == [1375] and len(calls) >= 1 + 5  # warm-up + a turn, each of 1375 bytes


def test_start_busy_returns_once_its_processes_burn_and_stop_busy_ends_them():
    from bench.store_service import start_busy, stop_busy
    procs = start_busy(1)
    try:
        assert [p.poll() for p in procs] == [None]
        with open(f"/proc/{procs[0].pid}/maps") as f:  # past `import torch`: in its loop
            assert "libtorch_cpu" in f.read()
    finally:
        stop_busy(procs)
    assert procs[0].returncode is not None


def test_apaired_runs_plain_and_coroutine_functions_in_turns_on_one_loop():
    import asyncio

    from bench.store_service import apaired
    order = []

    def plain():
        order.append("s")

    async def coro():
        await asyncio.sleep(0)
        order.append("a")
    stats = asyncio.run(apaired([plain, coro], nbytes=1, seconds=0.0, turns=3))
    assert len(stats) == 2 and all(s.gbps > 0 for s in stats)
    assert order[:2] == ["s", "a"]  # the warm-up
    runs = [order[2]]
    for k in order[3:]:
        if k != runs[-1][-1]:
            runs.append("")
        runs[-1] += k
    # turns s a | a s | s a: the order rotates, so each side runs twice in a row once
    assert [r[0] for r in runs] == ["s", "a", "s", "a"]
    assert all(len(r) >= 5 for r in runs)
