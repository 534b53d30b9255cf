"""The put ring's two sides in one process: records stay pending until the daemon side
consumes them after committing, wrap-around, and a client that lies about its index."""
import numpy as np

from kvstore.putring import CR, CW, GR, GW, PutRing, ring_bytes


def ring(cap=4, gcap=4):
    buf = np.zeros(ring_bytes(cap, gcap), np.uint8)
    return PutRing(buf, cap, gcap), PutRing(buf)  # daemon side (creator), client side


def test_records_stay_pending_until_consumed():
    daemon, client = ring()
    client.push([b"a" * 16, b"b" * 16], [3, 5])
    assert daemon.peek() == ([b"a" * 16, b"b" * 16], [3, 5])
    assert client.pending() == 2 and client.room() == 2, "peek alone frees nothing"
    daemon.consume(2)
    assert client.pending() == 0 and client.room() == 4
    assert daemon.peek() == ([], [])


def test_wraps_around():
    daemon, client = ring(cap=3)
    for k in range(7):
        client.push([bytes([k]) * 16], [k])
        assert daemon.peek() == ([bytes([k]) * 16], [k])
        daemon.consume(1)


def test_a_few_records_and_many_read_alike_across_the_wrap():
    """`peek` reads a few records from the bytes and more through numpy: the same records,
    in order, whichever way, wrapped round the ring's end or not."""
    from kvstore.putring import FEW_RECORDS
    cap = 3 * FEW_RECORDS
    daemon, client = ring(cap=cap)
    for n in (1, FEW_RECORDS, FEW_RECORDS + 1, cap, 2, FEW_RECORDS + 3):
        for _ in range(2):  # the second time round starts elsewhere, often across the end
            hashes = [bytes([n, k]) * 8 for k in range(n)]
            slots = [(-1) ** k * (1 << 40) + k for k in range(n)]  # negative and wide too
            client.push(hashes, slots)
            assert daemon.peek() == (hashes, slots)
            daemon.consume(n)


def test_a_lying_write_index_reads_at_most_capacity():
    daemon, client = ring(cap=4)
    client.head[CW] = 1 << 40
    hashes, slots = daemon.peek()
    assert len(hashes) == len(slots) == 4


def test_grants_flow_the_other_way():
    daemon, client = ring(gcap=3)
    daemon.push_grants([7, 8])
    assert daemon.grant_room() == 1
    assert client.take_grants(5) == [7, 8] and client.take_grants(1) == []
    daemon.push_grants([9])
    assert daemon.unclaimed_grants() == [9]


def test_a_client_that_rewrites_the_daemons_indices_changes_nothing_the_daemon_reads():
    """The whole header is shared memory the client can write: the daemon keeps its own
    indices (commit read, grant write) and holds the client's (commit write, grant read)
    within the ring, so no value makes it fail, overflow or read past the ring."""
    daemon, client = ring(cap=4, gcap=4)
    daemon.push_grants([7, 8])
    client.push([b"a" * 16], [7])
    for lie in (0, 1 << 63, (1 << 64) - 1):
        client.head[CR], client.head[GW] = lie, lie
        assert daemon.peek() == ([b"a" * 16], [7])
        assert daemon.grant_room() == 2 and sorted(daemon.unclaimed_grants()) == [7, 8]
    for gr in (0, 1 << 63, (1 << 64) - 1):  # the client's own grant index, any value
        client.head[GR] = gr
        assert 0 <= daemon.grant_room() <= 4 and len(daemon.unclaimed_grants()) <= 4
    client.head[GR] = 0
    daemon.consume(1)
    daemon.push_grants([9, 10])
    assert daemon.peek() == ([], []) and int(daemon.head[CR]) == 1 and int(daemon.head[GW]) == 4
    client.head[CW] = 0  # moved back: nothing to read, nothing to fail
    assert daemon.peek() == ([], [])
