"""What `kvtier demo` / `kvtier cluster` start ends with them: SIGTERM unwinds the command
(its `with` blocks stop the store and workers, exit 143), and a launcher killed outright
(SIGKILL: no clean-up of its own) still takes them along (the kernel's parent-death
signal). Both left every child running before."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# a `kvtier` command of the real CLI that holds a store node as `kvtier demo` does
HOLD = textwrap.dedent("""
    import sys, time
    from kvtier import cli
    from engine_adapter.serving.launcher import ClusterConfig, store_node

    def run(a):
        with store_node(ClusterConfig(colocated=1, dram_size="1MiB"), sys.argv[1], sys.stdout) as d:
            print(f"holding daemon {d.pid}", flush=True)
            time.sleep(600)
        return 0

    cli.COMMANDS.append(("hold", "hold a store node", lambda p: None, run))
    sys.exit(cli.main(["hold"]))
""")


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def start_holder(tmp_path) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "store")], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    for line in proc.stdout:
        if line.startswith("holding daemon"):
            return proc, int(line.split()[-1])
    raise AssertionError(f"the holder ended: {proc.wait()} {proc.stderr.read()}")


def wait_gone(pid: int, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pid)


@pytest.fixture
def holders():
    started = []
    yield started
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def test_sigterm_stops_what_the_command_started_and_exits_143(tmp_path, holders):
    proc, daemon = start_holder(tmp_path)
    holders.append(proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 143
    assert "kvtier hold: terminated" in proc.stderr.read()
    assert not alive(daemon), "the store node outlived the command that started it"


def test_a_killed_launcher_still_takes_its_children_along(tmp_path, holders):
    proc, daemon = start_holder(tmp_path)
    holders.append(proc)
    proc.kill()
    proc.wait()
    assert wait_gone(daemon), "the store node outlived a launcher killed with SIGKILL"


def test_a_daemon_process_ends_with_the_program_that_started_it(tmp_path, holders):
    """A plain DaemonProcess (a benchmark's, a test's: no launcher, no env of its own) is
    taken along when the program that started it is killed outright. bench/store_service.py
    killed mid-run had left its daemon running."""
    script = textwrap.dedent("""
        import sys, time
        from kvstore.daemon.process import DaemonProcess
        d = DaemonProcess(sys.argv[1], dram_size="1MiB", ssd_size="0").start()
        print(f"holding daemon {d.pid}", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "store")], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    holders.append(proc)
    line = proc.stdout.readline()
    assert line.startswith("holding daemon"), (line, proc.stderr.read())
    daemon = int(line.split()[-1])
    assert alive(daemon)
    proc.kill()
    proc.wait()
    assert wait_gone(daemon), "the daemon outlived the program that started it"


def test_a_sigterm_during_teardown_waits_for_it_then_ends_the_command():
    """A SIGTERM while the command stops what it started is raised once that is done (it
    cut a worker's stop short, or turned the store's graceful stop into SIGKILL), and the
    handler in place before the command is back after it."""
    from kvstore.lifetime import Terminated, on_sigterm, teardown
    before = signal.getsignal(signal.SIGTERM)
    finished = []
    with pytest.raises(Terminated):
        with on_sigterm():
            with teardown():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # (a handler runs between bytecodes: it has by now)
                finished.append(True)
    assert finished == [True]
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_cli_puts_the_sigterm_handler_back():
    """`kvtier.cli.main` called as a library (tests, embedders) leaves SIGTERM as it was."""
    from kvtier.cli import main
    before = signal.getsignal(signal.SIGTERM)
    assert main(["hash", "--model", "m", "--num-layers", "1", "--num-kv-heads", "1",
                 "--head-dim", "8", "--block-tokens", "4", "1", "2", "3", "4"]) == 0
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("whose", ["a live stranger", "an ended process"])
def test_a_parent_pid_that_is_not_the_parent(whose):
    """KVTIER_PARENT_PID naming a live process that is not the parent (a stray variable,
    a wrapper between launcher and child) is warned about and ignored; one naming a
    process that has ended means the launcher is gone: the child stops."""
    if whose == "a live stranger":
        pid = 1
    else:
        done = subprocess.Popen([sys.executable, "-c", "pass"])
        done.wait()
        pid = done.pid
    child = subprocess.run(
        [sys.executable, "-c", "from kvstore.lifetime import exit_with_parent; "
         "exit_with_parent(); print('carried on')"],
        cwd=ROOT, env={**os.environ, "KVTIER_PARENT_PID": str(pid)}, capture_output=True,
        text=True, timeout=60)
    if whose == "a live stranger":
        assert child.returncode == 0 and "carried on" in child.stdout
        assert f"KVTIER_PARENT_PID={pid} is not this process's parent" in child.stderr
    else:
        assert child.returncode == -signal.SIGTERM and "has ended" in child.stderr
