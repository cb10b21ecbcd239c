"""``Tree``: what a folder holds, to put it back as it was after an attack job (fdg_audit/audit/serve.py: the
sandbox's /tmp and /dev/shm; fdg_audit/audit/sandbox.py: the view folder)."""
from __future__ import annotations

import os
import stat



class Tree:
    """What a folder holds (every entry's type and mode, not below a mount point), to compare and restore."""

    def __init__(self, top: str):
        self.top, self.dev = top, os.lstat(top).st_dev
        self.entries = self._scan()

    def _scan(self) -> dict:
        """{path: (type, mode)} of every entry; a bind's mount point (plugin sources, the view folder) by its type
        alone, and nothing below it. Directories are made searchable on the way (a job may have made one 0)."""
        out = {}
        for root, dirs, files in os.walk(self.top, onerror=_raise):
            st = os.lstat(root)
            if st.st_dev != self.dev:
                out[root] = (stat.S_IFDIR, None)
                dirs[:] = []
                continue
            out[root] = (stat.S_IFDIR, stat.S_IMODE(st.st_mode))
            for d in dirs:
                q = os.path.join(root, d)
                if os.path.islink(q):   # os.walk lists a link to a folder among the folders, and skips it
                    out[q] = (stat.S_IFLNK, None)
                elif os.lstat(q).st_dev == self.dev:
                    os.chmod(q, 0o700)
            for f in files:
                st = os.lstat(os.path.join(root, f))
                out[os.path.join(root, f)] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode))
        return out

    def restore(self) -> bool:
        """Remove what a job added, reset the folders that were there (mode, times, user xattrs); True when it
        holds what it held at the start."""
        try:
            now = self._scan()
            for p in sorted(set(now) - set(self.entries), key=len, reverse=True):   # a child before its parent
                os.rmdir(p) if now[p][0] == stat.S_IFDIR else os.unlink(p)
            for p, (kind, mode) in self.entries.items():
                if kind == stat.S_IFDIR and mode is not None:
                    for a in os.listxattr(p, follow_symlinks=False):
                        os.removexattr(p, a, follow_symlinks=False)
                    os.chmod(p, mode)
                    os.utime(p, (0, 0), follow_symlinks=False)
            return self._scan() == self.entries
        except OSError:
            return False


def _raise(e: OSError):
    raise e
