"""A training run's life above the engines, shared by every trainer (GRPO colocated and async, SFT, PRM training).

It holds ``lifecycle`` (``RunHarness``: distributed set-up, stop agreement, the metrics log, scheduled saves, the
final shutdown) and ``resume`` (what a training checkpoint holds for each trainer, and saving and restoring it: the
one place a resume is read). It may import the layers below it (``run``, ``parallel``, ``checkpoint``, ``config``,
``perf``); the trainers (``grpo_mega.trainer``, ``grpo_mega.sft``, ``grpo_mega.rollout_worker``, ``prm.train``)
import it, and nothing below them does.
"""
