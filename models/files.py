"""Writing files so that a kill or a full disk never leaves half of one, and refusing an unwritable path before work.

Every progress file (markers, manifests, settings, a merged record file) is written whole to a temporary name and
renamed over the old one: a reader sees the old file or the new one, never a mix. JSONL logs are appended instead.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import os
import shutil
import threading
from pathlib import Path
from typing import Callable

from models.errors import DraftheadsError


def _temporary_name(path: Path) -> Path:
    """Where `path` is written before its rename: per process and thread, so two writers never share one."""
    return path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def _remove_stale_temporaries(path: Path) -> None:
    """Temporaries of `path` whose writer is gone (killed with -9, no cleanup ran): a killed draft-file build left
    gigabytes that nothing removed."""
    for tmp in path.parent.glob(f"{glob.escape(path.name)}.*.*.tmp"):
        pid = tmp.name[len(path.name) + 1:].split(".")[0]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """write(tmp), flushed to disk, then tmp renamed to `path` and the rename flushed: a killed process or a crashed
    machine leaves the old file or the new one, whole. A failed write (a full disk) removes its partial temporary
    file, so it holds none of the space the user frees to rerun, and a killed writer's is removed by the next write."""
    _remove_stale_temporaries(path)
    tmp = _temporary_name(path)
    try:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(path.parent, directory=True)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync(path: Path, directory: bool = False) -> None:
    """Flush a file, or a directory's entries (a rename). Filesystems that cannot flush a directory (some FUSE, SMB
    and WSL mounts: EINVAL, ENOTSUP, EBADF, EACCES) are let be: the rename itself is done."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except PermissionError:
        if directory:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as e:
        if not (directory and e.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES)):
            raise
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """Flush every file under `directory` (written by another library, e.g. accelerate's save_state) and the
    directory itself, before a marker that says they are complete."""
    for path in sorted(Path(directory).rglob("*")):
        if path.is_file():
            _fsync(path)
    _fsync(Path(directory), directory=True)


def write_atomic(path: str | Path, data: bytes | str) -> None:
    write_whole(Path(path), lambda tmp: tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data))


def save_tensors(path: str | Path, tensors: dict, metadata: dict | None = None) -> None:
    """A safetensors file written whole (temporary name, then rename), with the permissions open() gives a new file.
    safetensors' save_file makes its files owner-only (0600) whatever the umask: a head exported for vLLM or SGLang
    running as another user, or a feature cache shared by a team, could not be opened."""
    from safetensors.torch import save_file

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp), metadata=metadata)
        umask = os.umask(0o022)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)

    write_whole(Path(path), write)


def build_directory_once(out: str | Path, build: Callable[[Path], None], required: tuple[str, ...] = (),
                         what: str = "the build") -> Path:
    """The directory `out`, made by `build(tmp)` into a temporary directory renamed into place, by one process only:
    the others (ranks starting together on a fresh machine) wait on `out.lock` and then read the finished one.
    `required`: files a finished directory holds; one without them (left by an older, broken build) is built again,
    and a build that does not write them is an error naming `what` (e.g. "converting target GGUF 'X'")."""
    out = Path(out)
    if _complete(out, required):
        return out
    with exclusive(out.with_name(out.name + ".lock")):
        if not _complete(out, required):  # nobody finished it while this process waited
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)  # a killed builder's: only the lock's holder builds
            build(tmp)
            missing = [name for name in required if not (tmp / name).is_file()]
            if missing:
                raise DraftheadsError(f"{what} wrote no {', '.join(missing)} (its partial output is in '{tmp}'); check "
                                      f"the free space under '{out.parent}' and rerun, which builds it again")
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
    return out


@contextlib.contextmanager
def exclusive(lock_path: Path, waiting: Callable[[], None] | None = None):
    """Hold an exclusive lock on the file `lock_path` (made if missing) through the block; other processes asking
    for it wait. `waiting()` runs first when another process holds it. Released when the block ends or the process
    dies (flock)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _complete(out: Path, required: tuple[str, ...]) -> bool:
    return out.is_dir() and all((out / name).is_file() for name in required)


def check_writable(path: str | Path, name: str, directory: bool = False) -> None:
    """Before any work: `path` (a directory, or a file's directory) exists or can be made, and takes files.
    `name` is what the user set (`output_dir`, `--out`): the error names it."""
    path = Path(path)
    where = path if directory else path.parent
    try:
        where.mkdir(parents=True, exist_ok=True)
        probe = where / f".{path.name}.{os.getpid()}.{threading.get_ident()}.write_probe"  # ranks probe at once
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise DraftheadsError(f"{name} '{path}' cannot be written ({e.strerror}); pick another "
                              f"{name if directory else 'path'}") from None
