import argparse
import os
import subprocess
import sys

import torch

from kvtier.cli import main
from kvstore.keys import Namespace, hash_blocks
from kvstore.tiers.slabfile import stride_of
from kvstore.tiers.ssd import SsdTier

NS = Namespace("m", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=4)


def test_help_explains_every_command():
    out = subprocess.run([sys.executable, "-m", "kvtier", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for name in ("hash", "fsck", "bench"):
        assert name in out


def test_hash_prints_the_library_hashes(capsys):
    assert main(["hash", "--model", "m", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim",
                 "16", "--block-tokens", "4", *map(str, range(9))]) == 0
    out = capsys.readouterr().out
    hashes = hash_blocks(NS, list(range(9)))
    assert all(h.hex() in out for h in hashes) and out.count("block ") == 3


def test_fsck_finds_and_repairs_a_corrupted_block(tmp_path, capsys):
    tier = SsdTier(NS, str(tmp_path), 4)
    hashes = hash_blocks(NS, list(range(12)))
    slots = tier.alloc_n(3)
    tier.write_n(slots, hashes, torch.randint(0, 255, (3, NS.block_bytes), dtype=torch.uint8))
    tier.close()
    with open(tmp_path / "slabs.dat", "r+b") as f:  # one flipped payload byte of block 1
        f.seek(slots[1] * stride_of(NS.block_bytes) + 5)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    assert main(["fsck", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "2 blocks ok, 1 bad" in out and hashes[1].hex() in out
    assert main(["fsck", str(tmp_path), "--repair"]) == 0
    assert main(["fsck", str(tmp_path)]) == 0
    assert "2 blocks ok, 0 bad" in capsys.readouterr().out.splitlines()[-1]


def test_fsck_of_a_wrong_directory_is_a_clear_error(tmp_path, capsys):
    assert main(["fsck", str(tmp_path)]) == 2
    assert "not an SSD tier directory" in capsys.readouterr().err
    for junk in ("{not json", '{"model": "m", "colour": 3}', "[1, 2]"):
        (tmp_path / "tier.json").write_text(junk)
        assert main(["fsck", str(tmp_path)]) == 2
        assert "does not name a namespace" in capsys.readouterr().err


def test_fsck_names_a_slab_file_that_is_not_a_file(tmp_path, capsys):
    """slabs.dat (or headers.dat) made a directory: fsck had called it missing, every
    block gone, while the tier refused to open with EISDIR."""
    SsdTier(NS, str(tmp_path), 4).close()
    for name in ("slabs.dat", "headers.dat"):
        os.rename(tmp_path / name, tmp_path / f"{name}.bak")
        (tmp_path / name).mkdir()
        assert main(["fsck", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"{name} is not a regular file (a directory)" in err and "move" in err
        (tmp_path / name).rmdir()
        os.rename(tmp_path / f"{name}.bak", tmp_path / name)
    assert main(["fsck", str(tmp_path)]) == 0


def test_malloc_tuning_applies_on_glibc():
    import platform
    from kvstore.tuning import tune_malloc_for_large_blocks
    if platform.libc_ver()[0] != "glibc":
        import pytest
        pytest.skip("mallopt tuning is glibc-only")
    assert tune_malloc_for_large_blocks() is True


def test_odd_arguments_are_one_line_errors(capsys):
    """Each of these was a traceback (a ValueError, min() of an empty workload, a missing
    file, a size read only after a whole configuration had run)."""
    assert main(["hash", "--model", "m", "--num-layers", "0", "--num-kv-heads", "1",
                 "--head-dim", "8", "1", "2"]) == 2
    assert "num_layers" in capsys.readouterr().err
    assert main(["hash", "--model", "m", "--num-layers", "1", "--num-kv-heads", "1",
                 "--head-dim", "8", "99999999999"]) == 2
    assert "int32" in capsys.readouterr().err
    # kvtier cluster: each of these started the store and the workers, then failed with a
    # traceback (or, --port, an OverflowError at the bind)
    for argv, says in ((["--num-blocks", "1"], "--num-blocks"),
                       (["--max-num-seqs", "0"], "--max-num-seqs"),
                       (["--threads", "-1"], "--threads"), (["--port", "70000"], "--port"),
                       (["--dram-size", "1e9"], "--dram-size"),
                       (["--data-dir", __file__], "--data-dir")):
        assert main(["cluster", *argv]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err
    for argv, says in ((["--requests", "0"], "--requests"), (["--sessions", "0"], "--sessions"),
                       (["--workload", "/nowhere.jsonl"], "no such file"),
                       (["--dram-size", "abc"], "--dram-size"),
                       # (ClusterConfig's own checks: tracebacks before)
                       (["--chunk-tokens", "0"], "--chunk-tokens"),
                       (["--max-num-seqs", "0"], "--max-num-seqs"),
                       (["--dram-size", "0"], "--dram-size")):  # ((b) failed after (a) ran)
        assert main(["demo", *argv]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err


def test_ctrl_c_while_the_daemon_starts_is_no_traceback(tmp_path):
    """SIGINT before the daemon took it over printed a KeyboardInterrupt traceback. (From
    0.5 s on: before that the interpreter itself may still be starting, where nothing of
    the program can catch it.)"""
    import signal
    import time
    # (nor an abort: KeyboardInterrupt raised inside torch's import ended the process with
    # "terminate called after throwing pybind11::error_already_set"; nor a Ctrl-C lost
    # while the app was set up, the daemon serving on)
    for i, (delay, sig) in enumerate(((0.5, signal.SIGINT), (1.0, signal.SIGINT),
                                      (1.5, signal.SIGTERM), (2.0, signal.SIGINT),
                                      (3.0, signal.SIGINT))):
        p = subprocess.Popen([sys.executable, "-m", "kvtier", "serve", "--port", "0",
                              "--http-port", "0", "--data-dir", str(tmp_path / f"d{i}"),
                              "--ssd-size", "0", "--dram-size", "16MiB"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(delay)
            p.send_signal(sig)
            out, err = p.communicate(timeout=60)
        finally:  # (a daemon that missed its signal must not outlive the test)
            if p.poll() is None:
                p.kill()
                p.wait()
        assert p.returncode in (0, 128 + sig) and "Traceback" not in err, (delay, p.returncode, err)
        assert "terminate called" not in err


def test_demo_and_sched_bench_refuse_bad_traces_in_one_line(tmp_path, capsys):
    """A trace whose lines are not requests (a negative block id, a string of ids, no
    requests at all) ended `kvtier demo` and `kvtier bench sched` in tracebacks (KeyError,
    OverflowError, ZeroDivisionError); `--workers 1 --configs a` crashed building the
    prefill/decode setup it was not asked to run."""
    from kvtier import demo
    ok = '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n'
    traces = {"neg.jsonl": ok.replace("[1]", "[-1]"), "str.jsonl": ok.replace("[1]", '"123"'),
              "empty.jsonl": "\n"}
    for name, text in traces.items():
        (tmp_path / name).write_text(text)
        assert main(["demo", "--workload", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert name in err and "Traceback" not in err
        out = subprocess.run([sys.executable, "-m", "kvtier", "bench", "sched", "--quick",
                              "--trace", str(tmp_path / name)], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode != 0 and name in out.stderr and "Traceback" not in out.stderr
    parser = argparse.ArgumentParser()
    demo.configure(parser)
    args = parser.parse_args(["--workers", "1", "--configs", "ab"])
    assert [s.key for s in demo.setups(args)] == ["a", "b"]


def test_commands_that_need_what_a_store_only_install_leaves_out_name_the_extra():
    """`pip install kvtier` has no torch (nor the model loaders): the engine's commands said
    so in a traceback from deep in an import; each now names the pip extra to add, and a
    GPU tier asked for without torch is a config error. The store's own commands work."""
    # (torch made unimportable in a fresh interpreter, as on a store-only install)
    no_torch = "import sys; sys.modules['torch'] = None; from kvtier.cli import main; " \
               "sys.exit(main(sys.argv[1:]))"
    for argv, extra in ((["demo", "--help"], "hf"), (["cluster", "--model", "x"], "hf"),
                        (["bench", "store", "--quick"], "engine"),
                        (["serve", "--gpu-size", "1GiB", "--port", "0"], "engine")):
        got = subprocess.run([sys.executable, "-c", no_torch, *argv], capture_output=True,
                             text=True, timeout=120)
        assert got.returncode == 2, (argv, got.stderr)
        assert f"pip install 'kvtier[{extra}]'" in got.stderr and "Traceback" not in got.stderr
    ok = subprocess.run([sys.executable, "-c", no_torch, "hash", "--model", "m", "--num-layers",
                         "1", "--num-kv-heads", "1", "--head-dim", "64", "--block-tokens", "2",
                         "1", "2"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "block 0:" in ok.stdout, ok.stderr
