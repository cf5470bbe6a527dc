"""Reading a file that holds credentials (the cluster secret, the API keys file)."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def read_private_text(path: str | os.PathLike[str], what: str) -> str:
    """The UTF-8 text of `path`, or ValueError naming `what` (e.g. "the cluster secret file")
    when it cannot be read, is not a regular file, is not owned by this user or root, or may
    be read or written by its group or others (ssh's rule: ``chmod 600``). The file opened is
    the one checked (fstat, not a name that may be swapped), and a FIFO cannot hang the
    caller (O_NONBLOCK; it is refused). Never quotes the file's content."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{what} {p} is not a regular file")
            if st.st_mode & 0o077:
                raise ValueError(
                    f"{what} {p} may be read or written by its group or others "
                    f"(mode {stat.S_IMODE(st.st_mode):04o}); `chmod 600 {p}`")
            if st.st_uid not in (os.geteuid(), 0):
                raise ValueError(f"{what} {p} is owned by uid {st.st_uid}, not by this user "
                                 f"({os.geteuid()}) or root")
            return f.read().decode()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {p}: {exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {p} is not UTF-8 text") from None
