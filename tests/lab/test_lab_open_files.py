"""The lab counts module references per open file, as chrdev_open() takes them, not per process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gpulab.kernel.kernelio import open_file_counts


def _hold(path: Path, opens: int, dups: int = 0) -> subprocess.Popen[bytes]:
    code = (
        "import os,sys,time\n"
        f"fds=[os.open({str(path)!r}, os.O_RDONLY) for _ in range({opens})]\n"
        f"extra=[os.dup(fds[0]) for _ in range({dups})]\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
    return p


def test_open_files_not_processes(tmp_path: Path) -> None:
    node = tmp_path / "dev"
    node.write_bytes(b"")
    procs = []
    try:
        assert open_file_counts([node]) == {str(node): 0}
        procs.append(_hold(node, 1))
        assert open_file_counts([node]) == {str(node): 1}
        procs.append(_hold(node, 2))  # a second open(2) by one process is a second open file
        assert open_file_counts([node]) == {str(node): 3}
        procs.append(_hold(node, 1, dups=2))  # dup(2) shares the open file: no new reference
        assert open_file_counts([node]) == {str(node): 4}
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert open_file_counts([node]) == {str(node): 0}


def test_fork_shares_the_open_file(tmp_path: Path) -> None:
    node = tmp_path / "dev"
    node.write_bytes(b"")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: open, fork, both hold the same open file
        os.close(r)
        fd = os.open(node, os.O_RDONLY)
        child = os.fork()
        if child == 0:
            os.read(os.open("/dev/zero", os.O_RDONLY), 1)
            import time

            time.sleep(60)
            os._exit(0)
        os.write(w, f"{child}\n".encode())
        import time

        time.sleep(60)
        os.close(fd)
        os._exit(0)
    os.close(w)
    grandchild = int(os.read(r, 64).decode().strip())
    try:
        assert open_file_counts([node]) == {str(node): 1}
    finally:
        for p in (grandchild, pid):
            os.kill(p, 9)
        os.waitpid(pid, 0)


def test_gpu_nodes_are_character_devices(tmp_path: Path) -> None:
    """/dev/nvidia* are character devices on a real host (and on 6.1/6.12 under QEMU), not regular files."""
    import stat
    import subprocess as sp

    from gpulab.host import boot

    dev = tmp_path / "dev"
    boot.make_dev(dev, [0, 1])
    try:
        for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
            assert stat.S_ISCHR(os.stat(dev / name).st_mode), name
        fd = os.open(dev / "nvidia-uvm", os.O_RDONLY)
        os.close(fd)
    finally:
        sp.run(["umount", str(dev)], check=False)
