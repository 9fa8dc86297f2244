"""Which HF-named tensors a weight sync must deliver, with their shapes, and which of them have arrived.

Names are the Hugging Face checkpoint names, i.e. a transformers model's ``state_dict()`` keys. Tied weights
(``lm_head.weight`` and ``model.embed_tokens.weight`` with ``tie_word_embeddings``) are one tensor under two
names: either name delivers it, and it counts once. A sync is bracketed by :meth:`WeightUpdateTracker.begin`
and :meth:`WeightUpdateTracker.finish`; ``finish`` fails unless every tensor arrived, so a partial sync cannot
leave stale weights behind unnoticed.
"""

from __future__ import annotations

import re

import torch

# transformers 5 holds an MoE layer's experts packed (Qwen3-MoE: ``mlp.experts.gate_up_proj`` [E, 2 * I, H], gate rows
# first, and ``mlp.experts.down_proj`` [E, H, I]) while checkpoints, grpo-mega's export and vLLM name one tensor per
# expert (``mlp.experts.{e}.gate_proj.weight`` [I, H], ``up_proj``, ``down_proj``).
_PACKED_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<packed>gate_up_proj|down_proj)$")


def checkpoint_state_dict(model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers model's ``state_dict(keep_vars=True)`` under checkpoint names: each packed expert parameter
    (``_PACKED_EXPERTS``) replaced by one view per expert and projection, so that copying a checkpoint-named tensor
    into its entry writes that expert's rows of the packed parameter in place. Other entries are kept as they are."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model_state.items():
        match = _PACKED_EXPERTS.match(name)
        if match is None or tensor.dim() != 3:
            out[name] = tensor
            continue
        prefix = match["prefix"]
        for expert in range(tensor.shape[0]):
            if match["packed"] == "down_proj":
                out[f"{prefix}.{expert}.down_proj.weight"] = tensor[expert]
                continue
            gate, up = tensor[expert].chunk(2, dim=0)
            out[f"{prefix}.{expert}.gate_proj.weight"] = gate
            out[f"{prefix}.{expert}.up_proj.weight"] = up
    return out


class WeightUpdateTracker:
    """Checks names and shapes of incoming tensors against a reference state dict and tracks completeness.

    The reference comes from ``model.state_dict(keep_vars=True)``: tied weights are then one object under several
    names. Its tensors may live on the meta device (only names and shapes are read here).
    """

    def __init__(self, reference: dict[str, torch.Tensor]):
        self._reference = reference
        self._names_of: dict[int, list[str]] = {}
        for name, tensor in reference.items():
            self._names_of.setdefault(id(tensor), []).append(name)
        self._received: set[int] | None = None
        self.bytes_received = 0
        """Bytes accepted since the last begin() (numel x element size, as sent)."""

    @property
    def active(self) -> bool:
        """True between begin() and finish()."""
        return self._received is not None

    def begin(self) -> None:
        """Start a sync: forget what earlier syncs delivered."""
        self._received = set()
        self.bytes_received = 0

    def accept(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Mark ``name`` received and return the reference tensor it updates.

        Raises RuntimeError outside begin()/finish(), ValueError for a name the model does not have or a shape
        that differs from the model's.
        """
        if self._received is None:
            raise RuntimeError("update_weights called without begin_weight_update()")
        target = self._reference.get(name)
        if target is None:
            raise ValueError(
                f"weight update: unknown tensor name {name!r}; the rollout model has {len(self._reference)} "
                f"tensors, e.g. {sorted(self._reference)[:3]}"
            )
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"weight update: tensor {name!r} has shape {tuple(tensor.shape)}, the rollout model expects "
                f"{tuple(target.shape)}"
            )
        self._received.add(id(target))
        self.bytes_received += tensor.numel() * tensor.element_size()
        return target

    def missing(self) -> list[str]:
        """Names (one entry per tensor; tied aliases joined by " / ") not received since begin()."""
        received = self._received or set()
        return [" / ".join(names) for key, names in self._names_of.items() if key not in received]

    def finish(self) -> None:
        """End the sync; raises ValueError listing the tensors that did not arrive."""
        if self._received is None:
            raise RuntimeError("finish_weight_update called without begin_weight_update()")
        missing = self.missing()
        self._received = None
        if missing:
            shown = ", ".join(missing[:10]) + (f", ... ({len(missing)} in all)" if len(missing) > 10 else "")
            raise ValueError(f"weight update incomplete: {len(missing)} tensors were not sent: {shown}")
