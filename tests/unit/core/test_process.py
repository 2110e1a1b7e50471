"""exit_now: a `keel` process ends with its code, its atexit handlers and its buffered output, and waits
for a thread that is still working."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import keel_env

ENDS = """
import atexit, sys, threading, time
from pathlib import Path
from keel.core.process import exit_now
atexit.register(lambda: print("atexit ran"))
sys.stdout.write("buffered, ")
if len(sys.argv) > 1:
    threading.Thread(target=lambda: (time.sleep(0.5), Path(sys.argv[1]).write_text("done"))).start()
exit_now(3)
"""


def test_exit_keeps_the_code_the_atexit_handlers_and_the_output(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", ENDS], env=keel_env(), capture_output=True, text=True)
    assert done.returncode == 3 and done.stdout == "buffered, atexit ran\n", done
    late = tmp_path / "late"
    done = subprocess.run([sys.executable, "-c", ENDS, str(late)], env=keel_env(), capture_output=True, text=True)
    assert done.returncode == 3 and done.stdout == "buffered, atexit ran\n" and late.read_text() == "done", done
