"""Issue 33 case 2: a stop signal at any moment, imports included, ends with 128 + signal
and never raises inside an import (`core.stopping`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hyperpipe.core.errors import Stopped

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="needs POSIX signals")


def test_a_signal_during_an_import_waits_until_the_import_is_done(tmp_path):
    # the module signals itself half-way through its own import, then keeps importing
    (tmp_path / "heavy.py").write_text(textwrap.dedent("""
        import os, signal, time
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(20):
            time.sleep(0.01)
        print("import done", flush=True)
    """))
    script = textwrap.dedent("""
        from hyperpipe.cli.main import sigterm_as_exit
        with sigterm_as_exit():
            import heavy
            import time
            time.sleep(20)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=30, env=env)
    assert proc.returncode == 143, proc.stderr
    assert "import done" in proc.stdout
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "hyperpipe: stopped by SIGTERM"


def test_a_signal_before_arming_is_raised_on_entry_not_lost():
    from hyperpipe.core import stopping
    stopping.install(("SIGTERM",))
    try:
        os.kill(os.getpid(), signal.SIGTERM)          # while not armed: recorded only
        with pytest.raises(Stopped) as info:
            with stopping.armed():
                pytest.fail("the recorded signal was not raised on entry")
        assert info.value.signum == signal.SIGTERM
    finally:
        stopping.uninstall()


def test_a_repeat_during_clean_up_does_not_interrupt_it():
    from hyperpipe.core import stopping
    stopping.install(("SIGTERM", "SIGHUP"))
    cleaned = False
    try:
        with pytest.raises(Stopped) as info, stopping.armed():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(300):                  # raised within the patience (0.5 s)
                    time.sleep(0.01)
            finally:
                os.kill(os.getpid(), signal.SIGHUP)   # a second signal while cleaning up
                for _ in range(100):
                    time.sleep(0.01)
                cleaned = True
    finally:
        stopping.uninstall()
    assert cleaned and info.value.signum == signal.SIGTERM
