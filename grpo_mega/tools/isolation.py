"""The kernel's part of the sandbox: namespaces, private temporary folders, resource limits and a user id of the
call's own. Each function runs in a process of the call chain (``grpo_mega.tools.worker``) and says what it got,
so that the sandbox degrades to what the machine allows instead of failing.

- ``isolate_network`` (once per worker): a new network namespace in which no interface is up. Needs root or an
  unprivileged user namespace.
- ``new_pid_namespace`` (once per call, in the worker, undone by ``restore_pid_namespace`` after the fork): a PID
  namespace whose first process is the call's supervisor, so that its end kills every process the call started,
  however it daemonised (the kernel kills a PID namespace with its init).
- ``new_mount_namespace`` (in the supervisor): mounts of its own, for the private temporary folders.
- ``private_mounts`` (in the supervisor): a fresh tmpfs on every world-writable folder (/tmp, /var/tmp, /dev/shm,
  /run/lock), so that a call writes nowhere outside them, and /proc of the new PID namespace (the call sees only its
  own processes).
- ``limit_call`` (in the call's process): rlimits, then a user id of its own when running as root (RLIMIT_NPROC
  binds only non-root users, and counts per user id: a fresh id per worker makes the count the call's own; a
  non-root id also cannot write root's files or signal the trainer).
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 1 << 14, 1 << 18
PR_SET_PDEATHSIG = 1
# The call's user id: SANDBOX_UID_BASE + the worker's pid, unique among live workers on the machine (pids are), far
# above the ids of real users; no file on the machine belongs to it.
SANDBOX_UID_BASE = 1_000_000
WRITABLE_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")

_libc = ctypes.CDLL(None, use_errno=True)


def _call(name: str, *args) -> str | None:
    """None when the libc call succeeded, else its error text."""
    if getattr(_libc, name)(*args) != 0:
        return os.strerror(ctypes.get_errno())
    return None


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (the chain worker -> call -> supervisor unwinds from any link)."""
    _call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def isolate_network() -> str:
    """Moves this process (and every later child) into a network namespace of its own; what happened, in words."""
    error = _call("unshare", CLONE_NEWNET)
    if error is None:
        return "network namespace"
    if os.geteuid() != 0:
        uid, gid = os.geteuid(), os.getegid()
        user_error = _call("unshare", CLONE_NEWUSER | CLONE_NEWNET)
        if user_error is None:
            # map ourselves to root inside, so that the later PID / mount namespaces are allowed too
            for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"0 {uid} 1"),
                               ("/proc/self/gid_map", f"0 {gid} 1")):
                try:
                    with open(path, "w") as file:
                        file.write(text)
                except OSError:
                    pass
            return "user + network namespace"
        error = f"{error}; user namespace: {user_error}"
    return f"none ({error}): calls can reach the network"


def new_pid_namespace() -> bool:
    """Whether the next child of this process will be the first of a new PID namespace (its init: when it ends,
    the kernel kills every process of the namespace)."""
    return _call("unshare", CLONE_NEWPID) is None


def restore_pid_namespace(own_namespace_fd: int) -> None:
    """After that child: later children in our own PID namespace again (a process may unshare a PID namespace only
    while its children would be born in its own)."""
    _call("setns", own_namespace_fd, CLONE_NEWPID)


def new_mount_namespace() -> bool:
    """Whether this process now has a mount namespace of its own (mounts it makes are invisible outside)."""
    return _call("unshare", CLONE_NEWNS) is None


def _blocked_ancestor(path: str) -> str | None:
    """The highest folder on the way to ``path`` that other users cannot enter (no o+x), or None."""
    current = "/"
    for part in path.strip("/").split("/"):
        current = os.path.join(current, part)
        try:
            if not os.stat(current).st_mode & 0o001:
                return current
        except OSError:
            return None
    return None


def _reopen_interpreter(paths) -> None:
    """Lets a call under another user id read the interpreter and its packages when they live under a folder closed
    to other users (a pyenv Python in /root): a tmpfs hides that folder (and all else in it), and the folders
    Python needs are bound back in. Needs a mount namespace of our own."""
    needed = sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)})
    outermost = [p for p in needed if not any(p != q and p.startswith(q + "/") for q in needed)]
    plan = [(blocked, path) for path in outermost if (blocked := _blocked_ancestor(path))]
    handles = [(path, os.open(path, os.O_PATH)) for _, path in plan]  # before the folder is hidden
    for blocked in sorted({blocked for blocked, _ in plan}, key=len):
        if not any(blocked.startswith(other + "/") for other, _ in plan if other != blocked):
            _call("mount", b"tmpfs", blocked.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=0755")
    for path, handle in handles:
        os.makedirs(path, mode=0o755, exist_ok=True)
        _call("mount", f"/proc/self/fd/{handle}".encode(), path.encode(), None, MS_BIND | MS_REC, None)
        os.close(handle)


def private_mounts(size_mb: int) -> str | None:
    """In a new mount namespace: a private tmpfs of ``size_mb`` on each world-writable folder, the interpreter's
    folders readable to the call's user id, and a /proc of the current PID namespace. Returns the call's folder
    (inside the private /tmp), or None when mounting is refused."""
    if _call("mount", None, b"/", None, MS_REC | MS_PRIVATE, None) is not None:
        return None
    _reopen_interpreter([sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)),
                         *sys.path])
    flags = MS_NOSUID | MS_NODEV
    for folder in WRITABLE_FOLDERS:
        if os.path.isdir(folder):
            error = _call("mount", b"tmpfs", folder.encode(), b"tmpfs", flags,
                          f"size={size_mb}m,mode=1777".encode())
            if error is not None and folder == "/tmp":
                return None
    _call("mount", b"proc", b"/proc", b"proc", flags | MS_NOEXEC, None)  # best effort: the host's /proc otherwise
    folder = "/tmp/call"
    os.mkdir(folder, 0o700)
    return folder


def sandbox_uid() -> int | None:
    """The user id calls of this worker run as, or None when they keep ours (not root: we cannot switch). Ask
    before ``isolate_network``: inside a user namespace we look like root but cannot switch either."""
    return SANDBOX_UID_BASE + os.getpid() if os.geteuid() == 0 else None


def limit_call(config, uid: int | None) -> None:
    """Applies the call's rlimits to this process, then switches to ``uid`` (a user id of the call's own) if given.
    ``config`` is a SandboxConfig."""
    mib = 1 << 20
    cpu = max(1, int(round(config.cpu_time_s)))
    memory, file_size = config.memory_mb * mib, config.file_size_mb * mib
    limits = [(resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, memory, memory),
              (resource.RLIMIT_FSIZE, file_size, file_size), (resource.RLIMIT_CORE, 0, 0),
              (resource.RLIMIT_NPROC, config.max_processes, config.max_processes)]
    for which, soft, hard in limits:
        try:
            resource.setrlimit(which, (soft, hard))
        except (ValueError, OSError):
            pass  # a limit above the hard one we were given: keep the lower one we have
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
