"""Every file of a run folder (or a report folder) is opened as data, through one helper (``read_in``, ``write_in``,
``entries``), as git treats its work tree: the folder itself is the user's choice, but under it no component may be
a symbolic link (each is opened with O_NOFOLLOW from the one before, openat-style), a file that is a FIFO, device or
socket is refused before it is opened for data, a size is checked before the bytes are read, and a write goes to a
temporary file created beside its target (O_EXCL, O_NOFOLLOW) and renamed over it, so a link at the target is
replaced, never followed. A name longer than a file system takes is shortened with its hash (``bounded``). Anything
else is a one-line error naming the path.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import stat
from pathlib import Path

from ..errors import UserError

MAX_FILE_BYTES = 2 ** 30   # a file read from a run folder is at most this large unless its reader says otherwise

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)



def bounded(name: str, limit: int = 200) -> str:
    """``name`` if it is at most ``limit`` bytes, else its start, "~" and 16 hex digits of its sha256 (its
    extension kept): the same long name always gives the same short one."""
    raw = name.encode("utf-8", "surrogatepass")
    if len(raw) <= limit:
        return name
    ext = os.path.splitext(name)[1] if len(os.path.splitext(name)[1]) <= 8 else ""
    head = raw[:max(1, limit - 17 - len(ext.encode()))].decode("utf-8", "ignore")
    return f"{head}~{hashlib.sha256(raw).hexdigest()[:16]}{ext}"



def _split(root, path) -> tuple[Path, list[str]]:
    root, p = Path(root), Path(path)
    try:
        rel = p.relative_to(root)
    except ValueError:
        if p.is_absolute():
            raise UserError(f"{str(p)[:300]} is not inside {str(root)[:300]}: the folder's files are read and written "
                            "only inside it") from None
        rel = p
    parts = [bounded(x) for x in rel.parts]
    if not parts or any(x in ("", ".", "..") or "\x00" in x for x in parts):
        raise UserError(f"{str(p)[:300]}: not a file name inside {str(root)[:300]}")
    return root, parts



def _refuse(root: Path, parts: list, why: str) -> UserError:
    return UserError(f"{str(root.joinpath(*parts))[:500]} {why}: the folder is damaged or hostile (a link, FIFO, "
                     "device or socket where a file or folder belongs); restore it or re-run")



def _walk(root: Path, parts: list, make: bool) -> int:
    """A descriptor of the folder ``root/parts`` reached without following a link below ``root`` (each missing
    folder made when ``make``); FileNotFoundError when it is missing, else a one-line error."""
    if make:
        os.makedirs(root, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i, name in enumerate(parts):
            try:
                nfd = os.open(name, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if not make:
                    raise
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                nfd = os.open(name, _DIR, dir_fd=fd)
            except OSError as e:
                raise _refuse(root, parts[:i + 1], f"is not a folder ({e.strerror})") from None
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd



def read_in(root, path, cap: int = MAX_FILE_BYTES) -> bytes | None:
    """The bytes of the regular file ``path`` under ``root`` (``path`` absolute inside it, or relative to it) of at
    most ``cap`` bytes; None when it (or a folder on its way) does not exist; a one-line error otherwise."""
    root, parts = _split(root, path)
    try:
        dfd = _walk(root, parts[:-1], False)
    except FileNotFoundError:
        return None
    try:
        try:
            st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_size > cap:
            raise _refuse(root, parts, "is not a regular file" if not stat.S_ISREG(st.st_mode) else
                          f"is larger than {cap >> 20} MiB")
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
                         dir_fd=dfd)
        except OSError as e:
            raise _refuse(root, parts, f"cannot be opened as a file ({e.strerror})") from None
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):   # replaced between the check and the open
            raise _refuse(root, parts, "is not a regular file")
        data = f.read(min(cap, st.st_size) + 1)
    if len(data) > cap:
        raise _refuse(root, parts, f"is larger than {cap >> 20} MiB")
    return data



def write_in(root, path, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` under ``root`` atomically (a temporary file beside it, renamed over it), every
    folder on the way reached without a link and made when missing; the path written (its name ``bounded``)."""
    root, parts = _split(root, path)
    dfd = _walk(root, parts[:-1], True)
    tmp = f".{parts[-1][:200]}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644,
                     dir_fd=dfd)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        try:
            os.replace(tmp, parts[-1], src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError as e:
            os.unlink(tmp, dir_fd=dfd)
            raise _refuse(root, parts, f"cannot be replaced ({e.strerror})") from None
    finally:
        os.close(dfd)
    return root.joinpath(*parts)



def entries(root, path, folders: bool = False) -> list[str]:
    """The names of the files directly in folder ``path`` under ``root``, sorted: everything but folders (a link, a
    FIFO or a device among them is refused by ``read_in`` when read); ``folders``: the folders only, never a link to
    one. [] when the folder does not exist."""
    root, parts = _split(root, path)
    try:
        dfd = _walk(root, parts, False)
    except FileNotFoundError:
        return []
    try:
        with os.scandir(dfd) as it:
            return sorted(e.name for e in it
                          if e.is_dir(follow_symlinks=False) == folders)
    finally:
        os.close(dfd)
