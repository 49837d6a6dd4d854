"""Issue 33 case 12: Ctrl-C reaches every process of the group; a search's pool workers
end quietly (their parent reports the stop), with no traceback of their own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, signal, time
    from hyperpipe.search.backends import process_pool

    if __name__ == "__main__":
        with process_pool(2) as pool:
            assert list(pool.map(abs, [-1, -2, -3, -4])) == [1, 2, 3, 4]
            for pid in list(pool._processes):     # idle workers, as Ctrl-C finds them
                os.kill(pid, signal.SIGINT)
            deadline = time.monotonic() + 30
            while any(p.exitcode is None for p in pool._processes.values()) and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
            codes = sorted(p.exitcode for p in pool._processes.values())
        print("exit codes", codes, flush=True)
""")


def test_ctrl_c_ends_pool_workers_without_a_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=60, env=env, cwd=tmp_path)
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, \
        proc.stderr
    # each worker ends by its Ctrl-C (130), or, when the pool saw the other one end first,
    # by the pool's SIGTERM to what is left of a broken pool (-15): both quietly
    assert "exit codes [" in proc.stdout, proc.stdout + proc.stderr
    codes = proc.stdout.split("exit codes [", 1)[1].split("]", 1)[0].split(", ")
    assert "130" in codes and set(codes) <= {"130", "-15"}, proc.stdout
