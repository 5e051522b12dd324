"""Run a program on a fresh pseudo-terminal and keep it open (for decoys such as an editor).

The program's argv comes from ``GPULAB_ARGV`` (JSON) rather than this script's own argv, so that
``ps`` shows the program's command line once, as on a real host where someone left ``vim`` open in a
terminal. Output is read and thrown away; the holder exits when the program does.
"""

from __future__ import annotations

import json
import os
import pty
import select
import sys


def main() -> int:
    """Fork the program on a pty and drain its output until it exits."""
    argv = json.loads(os.environ.pop("GPULAB_ARGV"))
    pid, master = pty.fork()
    if pid == 0:
        os.environ.setdefault("TERM", "xterm")
        try:
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    while True:
        try:
            ready, _, _ = select.select([master], [], [], 60)
            if ready and not os.read(master, 65536):
                break
        except OSError:
            break
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
