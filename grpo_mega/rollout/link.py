"""The rollout world's end of the bridge (``rollout.mode: async``, ``grpo_mega.rollout_worker``): the trainer's
messages received and relayed to every rollout rank, weights versions loaded into the engine, and, on a stop signal,
a probe of whether the trainer is still there (:meth:`RolloutLink.check_trainer`)."""

from __future__ import annotations

import signal
import sys
import time

import torch

from grpo_mega.rollout.bridge import Bridge, share_in_world, share_tensors_in_world
from grpo_mega.run.control import STOP_SIGNALS


PROBE_TAG = 2
"""The bridge tag of :meth:`RolloutLink.check_trainer`'s probes (the two streams use 0 and 1): the trainer never
receives on it, so a probe to a live trainer stays queued in gloo (one notice, no bytes) and changes nothing."""


class TrainerStopped(Exception):
    """The trainer said stop while this world waited for weights."""


class TrainerLost(ConnectionError):
    """A stop signal reached this rollout rank and its trainer is gone (the bridge to it is closed): ``peer_lost``."""


class RolloutLink:
    """The rollout world's end of the bridge, on every rollout rank: rank 0 talks, the others hear it relayed."""

    def __init__(self, bridge: Bridge | None, engine):
        self.bridge = bridge  # None on the rollout ranks other than 0
        self.engine = engine
        self.version = -1
        self.receive_seconds = 0.0
        self.trainer_lost = False  # check_trainer found the bridge closed

    def receive(self) -> tuple[str, object]:
        return share_in_world(self.bridge.receive() if self.bridge else None, source_has_it=self.bridge is not None)

    def send(self, kind: str, payload=None, *, key: int = 0) -> None:
        if self.bridge is not None:
            self.bridge.send(kind, payload, key=key)

    def take_weights(self) -> int:
        """Load the next weights version into the engine (``TrainerStopped`` on ``stop``); returns the version."""
        kind, message = self.receive()
        if kind == "stop":
            raise TrainerStopped
        if kind != "weights":
            raise RuntimeError(f"the trainer sent {kind!r} where a weights version was due")
        start = time.perf_counter()
        from grpo_mega.parallel import get_device  # megatron: only where weights arrive

        device = get_device()
        self.engine.begin_weight_update()
        while True:
            kind, entries = self.receive()
            if kind == "weights_end":
                break
            named = self.bridge.receive_bucket(entries) if self.bridge is not None else None
            self.engine.update_weights(list(share_tensors_in_world(named, entries, device)))
        self.engine.finish_weight_update()
        self.receive_seconds += time.perf_counter() - start
        self.version = message["version"]
        return self.version

    def settle(self, up_to_key: int | None = None) -> None:
        if self.bridge is not None:
            self.bridge.settle(up_to_key)

    def check_trainer(self, signal_name: str) -> None:
        """Raise :class:`TrainerLost` when the trainer's end of the bridge is closed: a send to a process that is
        gone fails at once (gloo: ``Connection closed by peer``), one to a live trainer is queued on
        :data:`PROBE_TAG` and never taken. Only the rank on the bridge can tell."""
        if self.bridge is None:
            return
        try:
            # The send's work is dropped, not kept: it never finishes (the trainer posts no receive on PROBE_TAG,
            # and gloo fails no pending send when its peer dies later: measured), so kept probes would only pile
            # up, one per stop signal, with none ever drained. Dropping is safe: gloo's pair holds a pending send's
            # buffer by a weak pointer and skips it once gone (gloo/transport/tcp/pair.cc, Pair::send and
            # Pair::write), and a probe has no bytes to write. Measured: 1000 probes to a live peer dropped, then
            # an all_reduce, a tag-0 send / recv and destroy_process_group on that group ran as before.
            self.bridge.group.send([torch.zeros(0, dtype=torch.uint8)], self.bridge.peer, PROBE_TAG)
        except RuntimeError as error:
            self.trainer_lost = True
            raise TrainerLost(f"the trainer (job rank {self.bridge.peer}) is gone: {signal_name} reached this rollout "
                              f"rank and the bridge to the trainer is closed "
                              f"({(str(error).splitlines() or [''])[0][:200]})") from error

    def check_trainer_on_stop_signals(self) -> None:
        """After each stop signal (recorded first by the handler installed before), :meth:`check_trainer`, unless
        this rank is already ending: the trainer found lost, or an exception being handled (a bridge operation that
        failed first, whose cause the command is naming when the launcher's SIGTERM arrives). Measured before this
        check: the second probe raised inside the failure report and printed a 60-line traceback."""
        for sig in STOP_SIGNALS:
            recorded = signal.getsignal(sig)

            def on_signal(signum, frame, recorded=recorded):
                if callable(recorded):
                    recorded(signum, frame)
                if self.trainer_lost or sys.exc_info()[0] is not None:
                    return  # this rank is ending already, naming its cause: a repeat would cut that short
                self.check_trainer(signal.Signals(signum).name)

            signal.signal(sig, on_signal)
