"""Thread tuning: a background thread is SCHED_BATCH (its wake-ups preempt no one) and
named for top -H / py-spy; the threads around it keep their policy."""
from __future__ import annotations

import os
import threading

import pytest

from kvstore.tuning import background_thread

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling")


def test_a_background_thread_is_batch_and_named_and_no_other_thread_changes():
    seen = {}

    def body():
        background_thread("kvtier-a-very-long-name")
        tid = threading.get_native_id()
        seen["policy"] = os.sched_getscheduler(0)
        with open(f"/proc/self/task/{tid}/comm") as f:
            seen["name"] = f.read().strip()

    before = os.sched_getscheduler(0)
    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == {"policy": os.SCHED_BATCH, "name": "kvtier-a-very-l"}  # 15 bytes kept
    assert os.sched_getscheduler(0) == before  # the calling thread only
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        assert f.read().strip() != "kvtier-a-very-l"
