"""A sandbox worker: a pre-started interpreter that runs one tool call at a time, each in processes of its own.

Started by ``grpo_mega.tools.pool`` as ``python -m grpo_mega.tools.worker '<json>'``; it reads requests on stdin
and answers on its original stdout (frames of ``grpo_mega.tools.protocol``) until stdin closes. Per call:

    worker --fork into a new PID namespace--> supervisor (PID 1 there, root): a mount namespace with a private
    /tmp and /proc, the call's folder --fork--> the call (its own session, stdout/stderr to a pipe, rlimits, a user
    id of its own, seeded): runs the tool, writes its result, exits.

The worker enforces the wall clock: at the deadline it SIGKILLs the supervisor, and the kernel kills every process
of the PID namespace with it. The supervisor dies with the worker (PR_SET_PDEATHSIG), so killing the worker
unwinds the call too. Nothing the call does reaches the worker's pipes to the pool: the call
gets /dev/null as stdin and only its two pipes.
"""

from __future__ import annotations

import gc
import io
import json
import os
import random
import select
import shutil
import signal
import sys
import tempfile
import time

from grpo_mega.tools import isolation
from grpo_mega.tools.base import HARD_OUTPUT_BYTES, SandboxConfig
from grpo_mega.tools.protocol import receive, send
from grpo_mega.tools.python_tool import error_line, kind_of, run_code
from grpo_mega.tools.user_tools import tool_answer


def _write_json(fd: int, message: dict) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _cut(text: str, limit: int) -> str:
    data = text.encode("utf-8", "backslashreplace")
    if len(data) <= limit:
        return text
    return data[:limit].decode("utf-8", "replace") + f"\n[... {len(data) - limit} more bytes cut]"


def _run_tool(request: dict, tools: dict, config: SandboxConfig) -> dict:
    """In the call's process: the tool's outcome, as the result message."""
    if request["tool"] == "python":
        error, message = run_code(request["code"])
        return {"error": error, "message": message}
    try:
        content, reward = tool_answer(tools[request["name"]](**request["arguments"]))
    except MemoryError:
        return {"error": "memory", "message": "MemoryError: out of memory (the sandbox's memory limit)"}
    except BaseException as error:
        return {"error": kind_of(error), "message": _cut(error_line(error), 1000)}
    if reward is not None and reward != reward:
        reward = None  # NaN is no reward
    return {"error": None, "content": _cut(content, config.max_output_bytes), "reward": reward}


def _call(request, tools, config, uid, folder, out_w, res_w) -> None:
    """The call's own process: never returns."""
    try:
        os.setsid()
        for fd in (1, 2):
            os.dup2(out_w, fd)
        os.chdir(folder)
        os.environ.update(HOME=folder, TMPDIR=folder)
        isolation.limit_call(config, uid)
        for name in ("stdout", "stderr"):
            setattr(sys, name, io.TextIOWrapper(io.FileIO(1 if name == "stdout" else 2, "w", closefd=False),
                                                encoding="utf-8", errors="backslashreplace", write_through=True))
        random.seed(config.seed)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed(config.seed)
        owner = os.getpid()
        result = _run_tool(request, tools, config)
        if os.getpid() == owner:  # a process the code forked that fell through to here says nothing
            _write_json(res_w, {"result": result})
    except BaseException as error:  # the sandbox itself failed to set the call up: say so, it is not the code's
        _write_json(res_w, {"result": {"error": "crashed", "message": f"sandbox setup failed: {error_line(error)}"}})
    finally:
        os._exit(0)


def _supervise(request, tools, config, uid, out_w, res_w, ctrl_w) -> None:
    """The supervisor (PID 1 of the call's namespace when the kernel gave one): never returns."""
    try:
        isolation.die_with_parent()
        folder = isolation.private_mounts(4 * config.file_size_mb) if isolation.new_mount_namespace() else None
        if folder is None:
            folder = tempfile.mkdtemp(prefix="grpo-mega-tool-")
            _write_json(ctrl_w, {"folder": folder})
        if uid is not None:
            os.chown(folder, uid, uid)
        child = os.fork()
        if child == 0:
            os.close(ctrl_w)  # the call must not be able to write the chain's own messages (a folder to remove)
            _call(request, tools, config, uid, folder, out_w, res_w)
        os.close(out_w)
        os.close(res_w)
        _write_json(ctrl_w, {"process": child})
        while True:  # as PID 1 we adopt the call's orphans: reap them until the call itself ends
            pid, status = os.waitpid(-1, 0)
            if pid == child:
                break
        _write_json(ctrl_w, {"status": status})
    finally:
        os._exit(0)


def _start_call(request, tools, config, uid, pipes) -> int:
    """Forks the call's supervisor, the first process of a new PID namespace when the kernel allows; returns its
    pid. ``pipes``: (read, write) of the output, result and control pipes."""
    in_namespace = isolation.new_pid_namespace()
    try:
        pid = os.fork()
    except OSError:
        pid = -1
    if pid != 0:
        if in_namespace:
            isolation.restore_pid_namespace(OWN_PID_NAMESPACE)  # the next call needs a new one again
        if pid < 0:
            raise OSError("fork failed")
        return pid
    (out_r, out_w), (res_r, res_w), (ctrl_r, ctrl_w) = pipes
    try:
        for fd in (out_r, res_r, ctrl_r, PROTOCOL_OUT, OWN_PID_NAMESPACE):
            os.close(fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        _supervise(request, tools, config, uid, out_w, res_w, ctrl_w)
    finally:
        os._exit(0)


def _kill(pid: int | None, group: bool = False) -> None:
    if pid:
        try:
            (os.killpg if group else os.kill)(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_call(request: dict, tools: dict, config: SandboxConfig, uid: int | None) -> dict:
    """Runs one call in its own processes, under the wall clock; the answer message for the pool."""
    pipes = [os.pipe() for _ in range(3)]
    started = time.monotonic()
    try:
        process = _start_call(request, tools, config, uid, pipes)
    except OSError as error:  # the machine is out of processes or memory: this call fails, the worker lives
        for fd in (fd for pipe in pipes for fd in pipe):
            os.close(fd)
        return {"error": "crashed", "content": f"the sandbox could not start the call: {error}"}
    (out_r, out_w), (res_r, res_w), (ctrl_r, ctrl_w) = pipes
    for fd in (out_w, res_w, ctrl_w):
        os.close(fd)
    # the call can write to its result pipe at will: keep no more of it than a whole answer can take
    result_limit = 8 * config.max_output_bytes + (1 << 16)
    kept, total, stopped, give_up = bytearray(), 0, None, None
    received = {res_r: b"", ctrl_r: b""}
    open_fds = [out_r, res_r, ctrl_r]
    while open_fds:
        now = time.monotonic()
        if stopped is None and now >= started + config.timeout_s:
            stopped = "timeout"
        if stopped is not None and give_up is None:  # kill the namespace's init: the kernel kills the rest
            _kill(process)
            _kill(_parse(received[ctrl_r]).get("process"), group=True)  # when there is no PID namespace
            give_up = now + 1.0
        if give_up is not None and now >= give_up:
            break
        wait = (give_up if give_up is not None else started + config.timeout_s) - now
        ready, _, _ = select.select(open_fds + [0], [], [], max(wait, 0.001))
        if 0 in ready:  # the pool sends nothing during a call: this is its end (EOF), the trainer died
            os._exit(0)  # the supervisor dies with us (PR_SET_PDEATHSIG), and the call's namespace with it
        for fd in ready:
            data = os.read(fd, 1 << 16)
            if not data:
                open_fds.remove(fd)
            elif fd != out_r:
                received[fd] += data
                if len(received[res_r]) > result_limit and stopped is None:
                    stopped = "output_limit"
                    received[res_r] = b""
            else:
                total += len(data)
                kept += data[:max(0, config.max_output_bytes - len(kept))]
                if total > HARD_OUTPUT_BYTES and stopped is None:
                    stopped = "output_limit"
    for fd in (out_r, res_r, ctrl_r):
        os.close(fd)
    chain, result = _parse(received[ctrl_r]), _parse(received[res_r]).get("result")
    _reap(process)
    if chain.get("folder"):
        shutil.rmtree(chain["folder"], ignore_errors=True)
    return _answer(request, config, chain.get("status"), result, stopped, bytes(kept), total)


def _parse(results: bytes) -> dict:
    """The JSON lines of a pipe, merged (the first value of a key wins: the call's own result comes first)."""
    messages = {}
    for line in results.decode(errors="replace").splitlines():
        try:
            message = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill, or one the call's code wrote: ours are whole JSON objects
        if isinstance(message, dict):
            messages.update({k: v for k, v in message.items() if k not in messages})
    return messages


def _reap(process: int) -> None:
    for _ in range(200):
        if os.waitpid(process, os.WNOHANG)[0]:
            return
        time.sleep(0.005)
    _kill(process)
    os.waitpid(process, 0)


def _answer(request, config, status, result, stopped, kept: bytes, total: int) -> dict:
    output = kept.decode("utf-8", "replace")
    if stopped == "output_limit":
        output += f"\n[... output cut at {len(kept)} bytes]"
    elif total > len(kept):
        output += f"\n[... {total - len(kept)} more bytes of output cut]"
    if request["tool"] != "python":
        output = ""  # a user tool's prints are its own business: the policy sees what it returns
    if stopped == "timeout":
        return {"error": "timeout", "content": _join(output, f"timed out after {config.timeout_s:g} s")}
    if stopped == "output_limit":
        return {"error": "output_limit", "content": _join(output, f"stopped after printing more than "
                                                                  f"{HARD_OUTPUT_BYTES} bytes")}
    if isinstance(result, dict):
        if request["tool"] == "python":
            return {"error": result.get("error"), "content": _join(output, result.get("message") or "")}
        if result.get("error"):
            return {"error": result["error"], "content": str(result.get("message", ""))}
        return {"error": None, "content": str(result.get("content", "")), "reward": result.get("reward")}
    if status is None:
        return {"error": "crashed", "content": _join(output, "the call's process died without an answer")}
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        kind = {signal.SIGXCPU: "cpu_time", signal.SIGXFSZ: "file_size"}.get(number, "crashed")
        limit = {"cpu_time": f" (CPU time limit {config.cpu_time_s:g} s)",
                 "file_size": f" (file size limit {config.file_size_mb} MiB)"}.get(kind, "")
        return {"error": kind, "content": _join(output, f"killed by {signal.Signals(number).name}{limit}")}
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else status
    return {"error": "crashed", "content": _join(output, f"the process exited with code {code} before answering")}


def _join(output: str, message: str) -> str:
    if not message:
        return output
    return f"{output.rstrip(chr(10))}\n{message}" if output.strip() else message


PROTOCOL_OUT = -1
OWN_PID_NAMESPACE = -1


def main() -> None:
    global PROTOCOL_OUT, OWN_PID_NAMESPACE
    setup = json.loads(sys.argv[1])
    config = SandboxConfig(**setup["config"])
    PROTOCOL_OUT = os.dup(1)
    OWN_PID_NAMESPACE = os.open("/proc/self/ns/pid", os.O_RDONLY)
    os.dup2(2, 1)  # whatever a user tool's module prints while importing must not garble our frames
    uid = isolation.sandbox_uid()
    network = "allowed (sandbox.network: true)" if config.network else isolation.isolate_network()
    try:  # imported once here, so that calls using it start fast and it is seeded per call (numpy.random is lazy:
        import numpy.random  # noqa: F401  seeding it in the call would import it there, ~50 ms each call)
    except ImportError:
        pass
    gc.freeze()  # a collection in a call would touch (copy) every object of ours: keep them out of its sight
    tools = {}
    try:
        from grpo_mega.reward.registry import import_user_function
        for name, spec in setup["user_tools"].items():
            tools[name] = import_user_function(spec, what="user tool")
    except BaseException as error:
        send(PROTOCOL_OUT, {"ready": False, "error": f"{type(error).__name__}: {error}"})
        return
    send(PROTOCOL_OUT, {"ready": True, "network": network, "uid": uid})
    while True:
        request = receive(0)
        if request is None:
            return
        try:
            send(PROTOCOL_OUT, run_call(request, tools, config, uid))
        except BrokenPipeError:
            return  # the pool is gone (its process died): so are we


if __name__ == "__main__":
    main()
