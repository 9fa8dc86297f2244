"""A pipeline's command that ended from Ctrl-C is an interrupt of the pipeline, not a failure: when the signal
reaches the child first (e.g. while it still imports torch), the parent must still end as interrupted (exit 130)."""


import pytest

from grpo_mega.run import commands


class _Exited:
    def __init__(self, code):
        self.code = code

    def wait(self, timeout=None):
        return self.code


@pytest.mark.parametrize("code", [130, -2])
def test_a_command_ended_by_sigint_raises_keyboard_interrupt(monkeypatch, tmp_path, code):
    monkeypatch.setattr(commands.subprocess, "Popen", lambda *args, **kwargs: _Exited(code))
    with pytest.raises(KeyboardInterrupt, match=f"interrupted \\(exit {code}\\)"):
        commands.run_command(["sft", "--config", "x.yaml"], tmp_path / "sft.log", show=False)


def test_a_command_that_fails_otherwise_is_a_failure(monkeypatch, tmp_path):
    monkeypatch.setattr(commands.subprocess, "Popen", lambda *args, **kwargs: _Exited(1))
    with pytest.raises(commands.CommandFailed, match="failed \\(exit 1\\)"):
        commands.run_command(["sft", "--config", "x.yaml"], tmp_path / "sft.log", show=False)
