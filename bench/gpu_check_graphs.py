"""The GPU check's ``graphs`` stage (``bench/gpu_check.py``): the hf engine's decode with each ``rollout.decode_graphs``
mode against today's loop, in one process on one device, so that one device call decides the default (issue 77).

For each mode (``off``, ``static``, ``cuda_graphs``, ``static_compile``; the last two on CUDA only, recorded as
skipped elsewhere) the same generate call as the ``decode`` stage (``rollout_batch`` prompts x ``group``, up to
``response_length`` tokens, temperature 1, seed 1) runs once cold (the figure that holds the graph capture or the
compilation: ``first_call_seconds``, beside the runner's own ``capture_seconds`` / ``compile_seconds``), then
``REPEATS`` times: the median's milliseconds per decode step (the call's seconds over its steps, prefill included)
and generated tokens/s. Random weights never emit EOS, so every row runs every step; an ``ending`` call makes
1/``EOS_SHARE`` of the vocabulary EOS so that rows end at different steps and the static modes move down the batch
buckets (one capture per bucket reached). Samples: the share of rows whose tokens equal ``off``'s at the same seed
(plain and ``ending``) and the largest log-prob difference over the tokens of equal rows; bf16 attention over the
static cache's masked columns and at the bucket's batch size rounds differently, so near-ties may flip a token.

Estimated cost on one H100 for the Qwen2.5-0.5B shape (256 rows x 64 tokens): ``off`` / ``static`` ~4 calls of
1-9 s each; ``cuda_graphs`` the same plus ~0.2 s of capture per bucket (~20 buckets reached by the ``ending`` call);
``static_compile`` 40-120 s of inductor compilation, once. About 2-3 minutes in all; the CPU dry run (tiny shape)
runs ``off`` and ``static`` in seconds. ``GPU_CHECK_GRAPH_MODES=off,cuda_graphs`` (comma-separated) measures only
those modes (the others recorded as not run), e.g. to leave out the compilation where the call's time is short.
"""

from __future__ import annotations

import os
import statistics
import time

from gpu_check_decode import REPEATS, _prompt_ids, _synchronize

MODES_CUDA = ("off", "static", "cuda_graphs", "static_compile")
MODES_CPU = ("off", "static")
EOS_SHARE = 32
"""The ``ending`` call's EOS ids: one id in this many (a random-weight model's tokens are ~uniform), so a row's
expected length is ~this many steps."""
FLOOR_MS_PER_STEP_GRAPHS = 6.0
"""Issue 77's floor for the gpu_check GRPO config's decode on one H100 / H200 with CUDA graphs."""


def stage_graphs(task: dict, device: str, settings: dict) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_mega.rollout import SamplingConfig

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(task["model_dir"])
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    prompts = _prompt_ids(task, settings["rollout_batch"])
    new_tokens, rows = settings["response_length"], len(prompts) * settings["group"]
    vocabulary = model.get_input_embeddings().num_embeddings
    sampling = SamplingConfig(temperature=1.0, n=settings["group"], max_new_tokens=new_tokens, seed=1)

    def call(engine, eos: set[int] | None = None):
        """(seconds, completions) of one generate call; ``eos``: the EOS ids of the ``ending`` call."""
        saved = engine.eos_token_ids
        engine.eos_token_ids = saved if eos is None else eos
        try:
            _synchronize(device)
            start = time.perf_counter()
            completions = engine.generate(prompts, sampling)
            _synchronize(device)
            return time.perf_counter() - start, completions
        finally:
            engine.eos_token_ids = saved

    ending_eos = set(range(vocabulary // 2, vocabulary, EOS_SHARE))
    figures: dict = {"rows": rows, "max_new_tokens": new_tokens, "dtype": str(dtype).removeprefix("torch."),
                     "ending_eos_ids": len(ending_eos), "modes": {}}
    reference: dict = {}
    chosen = os.environ.get("GPU_CHECK_GRAPH_MODES", ",".join(MODES_CUDA)).split(",")
    for mode in MODES_CUDA:
        if mode != "off" and mode not in chosen:  # off is every figure's reference
            figures["modes"][mode] = {"not_run": "GPU_CHECK_GRAPH_MODES"}
            continue
        if device != "cuda" and mode not in MODES_CPU:
            figures["modes"][mode] = {"skipped": "needs CUDA (torch.cuda graphs / reduce-overhead compile)"}
            continue
        try:
            figures["modes"][mode] = _measure(mode, model, task["model_dir"], prompts, call, ending_eos, reference,
                                              rows)
        except Exception as error:  # one mode's failure is a figure, not the stage's end
            figures["modes"][mode] = {"failed": f"{type(error).__name__}: {error}"[:2000]}
        if device == "cuda":
            torch.cuda.empty_cache()
    off = figures["modes"]["off"].get("ms_per_step")
    for name, entry in figures["modes"].items():
        if off and entry.get("ms_per_step"):
            entry["speedup_vs_off"] = round(off / entry["ms_per_step"], 3)
    if device == "cuda":
        timed = [(entry["ms_per_step"], name) for name, entry in figures["modes"].items() if "ms_per_step" in entry]
        figures["fastest"] = min(timed)[1] if timed else None
        graphs = figures["modes"].get("cuda_graphs", {}).get("ms_per_step")
        figures["floor"] = {"ms_per_step_graphs": FLOOR_MS_PER_STEP_GRAPHS, "measured": graphs,
                            "met": graphs is not None and graphs <= FLOOR_MS_PER_STEP_GRAPHS}
    del model
    return figures


def _measure(mode, model, tokenizer_dir, prompts, call, ending_eos, reference, rows) -> dict:
    from grpo_mega.rollout.hf_engine import HFRolloutEngine

    engine = HFRolloutEngine(model, tokenizer_dir, generation_batch_size=len(prompts), decode_graphs=mode)
    first_seconds, _ = call(engine)  # cold: the capture / compilation of the full batch's bucket
    runs = [call(engine) for _ in range(REPEATS)]
    seconds = statistics.median(s for s, _ in runs)
    completions = runs[0][1]
    generated = sum(len(c.response_ids) for c in completions)
    ending_seconds, ending = call(engine, ending_eos)
    entry = {"first_call_seconds": round(first_seconds, 3), "seconds": round(seconds, 4),
             "ms_per_step": round(1000 * seconds / max(generated / rows, 1), 3), "generated_tokens": generated,
             "tokens_per_s": round(generated / seconds, 1), "ending_seconds": round(ending_seconds, 4),
             "ending_generated_tokens": sum(len(c.response_ids) for c in ending)}
    runner = None if engine.static_decoder is None else engine.static_decoder.step_fn
    if hasattr(runner, "capture_seconds"):
        entry["capture_seconds"] = round(runner.capture_seconds, 3)
        entry["buckets_captured"] = sorted(runner.graphs)
    if getattr(runner, "first_call_seconds", None) is not None:
        entry["compile_seconds"] = round(runner.first_call_seconds, 3)
    if mode == "off":
        reference.update(plain=completions, ending=ending)
    else:
        entry["samples_match"] = {name: _match(reference[name], ours)
                                  for name, ours in (("plain", completions), ("ending", ending))}
    del engine
    return entry


def _match(reference, ours) -> dict:
    """The share of rows whose tokens equal the reference's, and the largest log-prob difference on those rows."""
    equal = [(a, b) for a, b in zip(reference, ours) if a.response_ids == b.response_ids]
    difference = max((abs(x - y) for a, b in equal for x, y in zip(a.response_logprobs, b.response_logprobs)),
                     default=0.0)
    return {"rows_equal_share": round(len(equal) / max(len(reference), 1), 4),
            "max_logprob_difference_equal_rows": round(difference, 6)}

def graphs_summary(graphs: dict) -> dict:
    """The ``graphs`` stage's lines of the speed summary: ms per step and tokens/s per mode, the fastest."""
    summary = {}
    for name, entry in (graphs.get("modes") or {}).items():
        if "ms_per_step" in entry:
            summary[f"decode_ms_per_step_{name}"] = entry["ms_per_step"]
    if "fastest" in graphs:
        summary["decode_fastest_mode"] = graphs["fastest"]
        summary["decode_floor_ms_per_step_graphs"] = FLOOR_MS_PER_STEP_GRAPHS
    return summary
