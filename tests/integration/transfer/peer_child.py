"""A transfer agent in its own process, driven line by line over stdin (used by the tests).

Commands: `peer HEX` add a peer from its metadata; `notes` print notifications (hex, comma
separated) after waiting up to 2 s; `digest` print xxh3_64 of the exported region;
`write KIND N` WRITE the first N bytes of our region into the peer's first region; `quit`.
"""
import sys

import numpy as np
import xxhash

from transfer import Agent, AgentConfig, BackendKind, DescList, Op, ShmSegment


def main() -> None:
    kinds = tuple(BackendKind(k) for k in sys.argv[1].split(","))
    size = int(sys.argv[2])
    agent = Agent("child", AgentConfig(backends=kinds, io_timeout_s=3.0))
    seg = ShmSegment.create(size)
    seg.array[:] = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    region = agent.register(seg)
    print(agent.metadata().hex(), flush=True)
    peer = None
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "peer":
            peer = agent.add_peer(bytes.fromhex(args[0]))
            print("ok", flush=True)
        elif cmd == "notes":
            notes = agent.notifications(timeout=2.0)
            print(",".join(n.payload.hex() for n in notes) or "-", flush=True)
        elif cmd == "digest":
            print(xxhash.xxh3_64_hexdigest(seg.array), flush=True)
        elif cmd == "write":
            n = int(args[1])
            target = agent.peer_regions(peer)[0].region_id
            local = agent.prepare(DescList.from_tuples([(region, 0, n)]))
            remote = agent.prepare(DescList.from_tuples([(target, 0, n)]), peer=peer,
                                   backend=BackendKind(args[0]))
            agent.post(Op.WRITE, local, None, remote, None, notify=b"child").wait(5)
            print("ok", flush=True)
        elif cmd == "quit":
            break
    agent.close()
    seg.close()


if __name__ == "__main__":
    main()
