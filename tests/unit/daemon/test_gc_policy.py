"""The daemon's cyclic-GC policy (`kvstore.tuning.freeze_gc_heap`, which `kvtier serve`
calls once serving): its start is frozen out of the collector, and so is whatever survives
each full collection after it, so no full pass walks the blocks the daemon holds. Run in a
child process: the policy is process-wide."""
import subprocess
import sys
import textwrap


def _run(body: str) -> str:
    child = textwrap.dedent("""
        import gc
        from kvstore.tiermap import Entry, State
        from kvstore.tuning import freeze_gc_heap
        freeze_gc_heap()
    """) + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_what_survives_a_full_collection_is_frozen_and_not_walked_again():
    out = _run("""
        frozen = gc.get_freeze_count()
        entries = {i: Entry(i.to_bytes(16, "little"), 0, i, State.COMMITTED)
                   for i in range(50_000)}
        gc.collect()
        assert gc.get_freeze_count() >= frozen + 50_000, (frozen, gc.get_freeze_count())
        assert len(gc.get_objects(2)) < 1_000  # the next full pass walks none of them
        del entries  # frozen objects are still freed by their reference counts
        assert gc.get_freeze_count() < frozen + 1_000
        print("ok")
    """)
    assert out.strip() == "ok"


def test_unreachable_cycles_are_collected_not_frozen():
    out = _run("""
        class Node:
            pass
        frozen = gc.get_freeze_count()
        gc.disable()  # no automatic pass meanwhile: the explicit one finds them all
        for _ in range(1_000):
            a, b = Node(), Node()
            a.other, b.other = b, a  # a cycle, garbage once the loop moves on
        del a, b
        gc.enable()
        assert gc.collect() >= 2_000
        assert gc.get_freeze_count() < frozen + 100
        print("ok")
    """)
    assert out.strip() == "ok"


def test_a_collection_of_the_young_generations_freezes_nothing():
    out = _run("""
        frozen = gc.get_freeze_count()
        keep = [Entry(i.to_bytes(16, "little"), 0, i, State.COMMITTED) for i in range(5_000)]
        gc.collect(1)
        assert gc.get_freeze_count() == frozen
        print("ok")
    """)
    assert out.strip() == "ok"
