"""PRM scoring throughput: steps scored per second by ``StepScorer.score_steps`` (what ``grpo-mega prm score`` and
process-supervised GRPO call) on the Megatron forward engine, on 1 and 2 processes.

Two PRM layouts on the quickstart policy's shape (``grpo_mega.quickstart.pipeline.POLICY_SHAPE``, the synthetic task's
tokenizer): ``classifier`` (a two-class head read at the step tag " ки", Qwen2.5-Math-PRM's layout) and
``likelihood`` (the quickstart's PRM: the causal LM's smallest token probability in each step, no tag; its head
computes full-vocabulary log-probs). Solutions are rendered up to 192 tokens; the weights are the engine's seeded
random initialisation (throughput does not depend on them). The solutions are the synthetic task's held-out problems with planted errors (``prm.synthetic.planted_error_examples``).
Each layout runs in fresh processes: build the engine (``startup_seconds``), score a warm-up slice, then score all
solutions ``--repeats`` times; reported from the median pass: steps/s, solutions/s and rendered tokens/s.

Layouts: ``1p`` one process with 2 threads; on 2 processes with 1 thread each: ``dp2`` (TP=1 x DP=2), ``tp2``,
``pp2``. Prints the table and writes the JSON record (path printed last).

    python bench/prm_scoring.py            # 512 solutions, 3 passes, 4 layouts x 2 PRMs (about 4 min on 2 idle cores)
    python bench/prm_scoring.py --quick    # 128 solutions, 2 passes

``--scorers engine vllm`` compares the scorers instead (``process_reward.scorer``; one process, 2 threads), on GRPO
batches: ``--groups`` prompts x ``--group-size`` completions (the held-out problems, each completion with its own
planted error), at two PRM sizes (``--sizes``: ``small`` the quickstart shape, ``large`` 2x wider and 2x deeper),
each PRM layout, packed and not: the engine with the prompt once per group (``share_prompt_prefix``) or row by
row, vLLM with its prefix cache read (``skip_reading_prefix_cache=False``, 32-token blocks: the CPU backend's
default 128 holds no prompt of these rows) or not. Both load the same random weights from an HF folder; one
process per (size, layout) times the variants in turn in every pass (``_score_alternating``); the record is
bench/results/prm_scorers.json.

    python bench/prm_scoring.py --scorers engine vllm --groups 24 --repeats 5    # 16 rows, ~10 min on 2 cores
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

from report import build_record, load_average, text_table, write_record  # noqa: E402

LAYOUTS = {"1p": (1, 1, 1), "dp2": (1, 1, 2), "tp2": (2, 1, 2), "pp2": (1, 2, 2)}
"""name -> (tensor, pipeline, processes)."""
STEP_TAG = " ки"
MAX_LENGTH = 192
MAX_TOKENS_PER_MICRO_BATCH = 8192
PRM_LAYOUTS = {"classifier": STEP_TAG, "likelihood": ""}
"""PRM layout -> its step tag."""


def build_inputs(folder: Path, solutions: int, seed: int = 0) -> tuple[dict[str, Path], list]:
    """The synthetic task (quickstart shape), each PRM layout's HF config folder (the classifier's made from the
    policy config; the likelihood PRM is the policy's causal LM itself) and ``solutions`` held-out solutions with
    planted errors; returns ({layout: PRM folder}, examples)."""
    from grpo_mega.data.synthetic import read_jsonl
    from grpo_mega.quickstart.pipeline import QuickstartPlan, build_data_and_model
    from prm.spec import prm_hf_config_from_policy
    from prm.synthetic import planted_error_examples

    model_dir, _, heldout = build_data_and_model(folder, QuickstartPlan(num_train=1000, num_heldout=solutions), seed)
    prm_dirs = {"classifier": prm_hf_config_from_policy(model_dir, folder / "prm", "classifier"),
                "likelihood": Path(model_dir)}
    return prm_dirs, planted_error_examples(read_jsonl(heldout)[:solutions], seed=seed)


def _score(prm_dir: str, prm_layout: str, examples: list, tensor: int, pipeline: int, repeats: int) -> dict:
    """One rank: build the forward engine, warm up, time ``repeats`` passes of ``score_examples``."""
    from transformers import AutoConfig, AutoTokenizer

    from grpo_mega.parallel import destroy_distributed, init_distributed
    from prm.engines import build_prm_forward_engine
    from prm.spec import PRMSpec
    from prm.rendering import RenderSettings
    from prm.scoring import StepScorer

    init_distributed(tensor, pipeline, seed=0)
    start = time.perf_counter()
    spec = PRMSpec(prm_layout, PRM_LAYOUTS[prm_layout])
    tokenizer = AutoTokenizer.from_pretrained(prm_dir)
    engine = build_prm_forward_engine(AutoConfig.from_pretrained(prm_dir), spec, tokenizer,
                                      max_tokens_per_micro_batch=MAX_TOKENS_PER_MICRO_BATCH)
    scorer = StepScorer(engine, tokenizer, RenderSettings(step_tag=PRM_LAYOUTS[prm_layout]), max_length=MAX_LENGTH)
    startup = time.perf_counter() - start
    scorer.score_examples(examples[:32])  # warm-up
    seconds = []
    for _ in range(repeats):
        scores = scorer.score_examples(examples)
        seconds.append(scorer.last_seconds)
    tokens = sum(len(scorer.render(e.prompt, e.steps).input_ids) for e in examples)
    destroy_distributed()
    return {"seconds": seconds, "startup_seconds": startup, "scored_steps": sum(map(len, scores)), "tokens": tokens,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def throughput(prm_layout: str, layout: str, per_rank: list[dict], solutions: int) -> dict:
    """The layout's row from its ranks' results: the slowest rank's median pass sets the rate."""
    passes = [max(seconds) for seconds in zip(*(r["seconds"] for r in per_rank))]
    median = statistics.median(passes)
    first = per_rank[0]
    tensor, pipeline, processes = LAYOUTS[layout]
    return {"prm": prm_layout, "layout": layout, "processes": processes, "tensor": tensor, "pipeline": pipeline,
            "threads_per_process": 2 if processes == 1 else 1, "solutions": solutions,
            "steps": first["scored_steps"], "tokens": first["tokens"], "pass_seconds": passes,
            "seconds": median, "steps_per_s": first["scored_steps"] / median, "solutions_per_s": solutions / median,
            "tokens_per_s": first["tokens"] / median, "startup_seconds": max(r["startup_seconds"] for r in per_rank),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank)}


COLUMNS = [("prm", "prm", ""), ("layout", "layout", ""), ("procs", "processes", "d"), ("solutions", "solutions", "d"),
           ("steps", "steps", "d"), ("pass s", "seconds", ".3f"), ("steps/s", "steps_per_s", ".0f"),
           ("solutions/s", "solutions_per_s", ".0f"), ("tokens/s", "tokens_per_s", ".0f"),
           ("startup s", "startup_seconds", ".1f"), ("RSS MiB", "peak_rss_mb", ".0f")]


SIZES = {"small": {}, "large": {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 8,
                                 "num_attention_heads": 8, "num_key_value_heads": 4}}
"""PRM sizes for ``--scorers``: changes to the quickstart shape."""
VLLM_BLOCK_SIZE = 32


def build_scorer_inputs(folder: Path, groups: int, group_size: int, sizes: list[str]) -> tuple[dict, list]:
    """{(size, layout): HF PRM folder with random weights} and ``groups`` x ``group_size`` examples, a group's
    completions contiguous (each with its own planted error, ``planted_error_examples`` with seed k)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from grpo_mega.data.synthetic import read_jsonl
    from grpo_mega.quickstart.pipeline import QuickstartPlan, build_data_and_model
    from prm.hf_model import HFClassifierPRM
    from prm.spec import prm_hf_config_from_policy
    from prm.synthetic import planted_error_examples

    model_dir, _, heldout = build_data_and_model(folder, QuickstartPlan(num_train=1000, num_heldout=groups), 0)
    problems = read_jsonl(heldout)[:groups]
    per_seed = [planted_error_examples(problems, seed=k, error_fraction=0.75) for k in range(group_size)]
    examples = [per_seed[k][i] for i in range(len(problems)) for k in range(group_size)]
    dirs = {}
    for size in sizes:
        fields = {**AutoConfig.from_pretrained(model_dir).to_dict(), **SIZES[size]}
        fields.pop("layer_types", None)  # per layer: derived again for the new depth
        config = Qwen2Config(**fields)
        causal = folder / f"{size}_causal"
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(causal)
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(causal)
        classifier = prm_hf_config_from_policy(causal, folder / f"{size}_classifier", "classifier")
        torch.manual_seed(1)
        model = HFClassifierPRM(AutoConfig.from_pretrained(classifier))
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(classifier / "model.safetensors"))
        dirs[(size, "classifier")], dirs[(size, "likelihood")] = classifier, causal
    return dirs, examples


def _score_alternating(prm_dir: str, prm_layout: str, examples: list, scorer_kinds: list, repeats: int) -> dict:
    """One process: the PRM on each scorer, packed and not, every pass timing each variant in turn (the load of a
    shared machine then weighs on all alike). vLLM's unpacked variant is the same engine not reading its prefix
    cache (``skip_reading_prefix_cache=True``), the cache reset before every pass."""
    from grpo_mega.parallel import init_distributed
    from prm.scoring import open_step_scorer
    from prm.spec import PRMChoices

    init_distributed(1, 1, seed=0)
    variants, startup = {}, {}
    for kind in scorer_kinds:
        choices = PRMChoices(layout=prm_layout, step_tag=PRM_LAYOUTS[prm_layout] or None, scorer=kind)
        for packed in (False, True):
            start = time.perf_counter()
            if kind == "vllm":
                from prm.vllm_scoring import open_vllm_step_scorer

                if packed:  # one vLLM engine, read with and without its cache
                    variants[(kind, True)] = variants[(kind, False)]
                    continue
                _, scorer = open_vllm_step_scorer(prm_dir, choices, max_length=MAX_LENGTH, block_size=VLLM_BLOCK_SIZE)
            else:
                _, scorer = open_step_scorer(prm_dir, choices, max_length=MAX_LENGTH, share_prompt_prefix=packed,
                                             max_tokens_per_micro_batch=MAX_TOKENS_PER_MICRO_BATCH)
            startup[(kind, packed)] = time.perf_counter() - start
            variants[(kind, packed)] = scorer
            scorer.score_examples(examples[:32])  # warm-up
    seconds = {key: [] for key in variants}
    scores = {}
    for _ in range(repeats):
        for (kind, packed), scorer in variants.items():
            if kind == "vllm":  # a GRPO step's completions are new: no block of an earlier pass may be read
                scorer.prefix_cache = packed
                scorer.llm.reset_prefix_cache()
            scores[(kind, packed)] = scorer.score_examples(examples)
            seconds[(kind, packed)].append(scorer.last_seconds)
    tokens = sum(len(variants[(scorer_kinds[0], False)].render(e.prompt, e.steps).input_ids) for e in examples)
    return {"variants": [{"scorer": kind, "packed": packed, "seconds": seconds[(kind, packed)],
                          "startup_seconds": startup.get((kind, packed), startup.get((kind, False))),
                          "scores": scores[(kind, packed)]} for kind, packed in variants],
            "tokens": tokens, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


SCORER_COLUMNS = [("size", "size", ""), ("prm", "prm", ""), ("scorer", "scorer", ""), ("packed", "packed", ""),
                  ("completions", "completions", "d"), ("steps", "steps", "d"), ("pass s", "seconds", ".3f"),
                  ("fastest s", "fastest_seconds", ".3f"), ("s/256x6", "seconds_per_256x6", ".3f"),
                  ("vs row-by-row engine", "speedup", ".2f"),
                  ("max |diff|", "max_score_diff", ".1e"), ("startup s", "startup_seconds", ".1f"),
                  ("RSS MiB", "peak_rss_mb", ".0f")]


def compare_scorers(args) -> None:
    """The ``--scorers`` table (module docstring); each row's scores against the row-by-row engine's."""
    from grpo_mega.run.launcher import spawn_local_ranks

    started, load_before = time.time(), load_average()
    dirs, examples = build_scorer_inputs(args.work / "scorers", args.groups, args.group_size, args.sizes)
    steps = sum(len(e.steps) for e in examples)
    rows = []
    for size in args.sizes:
        for prm_layout in args.prm_layouts:
            (result,) = spawn_local_ranks(
                _score_alternating, 1, (str(dirs[(size, prm_layout)]), prm_layout, examples, sorted(args.scorers),
                                        args.repeats), threads=2, timeout=1800)
            reference = result["variants"][0]  # the first scorer (engine), row by row
            base = [v for row in reference["scores"] for v in row]
            for variant in result["variants"]:
                median = statistics.median(variant["seconds"])
                flat = [v for row in variant["scores"] for v in row]
                rows.append({"size": size, "prm": prm_layout, "scorer": variant["scorer"],
                             "packed": "yes" if variant["packed"] else "no", "completions": len(examples),
                             "steps": steps, "tokens": result["tokens"], "pass_seconds": variant["seconds"],
                             "seconds": median, "seconds_per_256x6": median * 256 * 6 / steps,
                             "fastest_seconds": min(variant["seconds"]),
                             "speedup": statistics.median(reference["seconds"]) / median,
                             "max_score_diff": max(abs(a - b) for a, b in zip(flat, base)),
                             "startup_seconds": variant["startup_seconds"], "peak_rss_mb": result["peak_rss_mb"]})
                print(f"{size} {prm_layout} {variant['scorer']} packed={variant['packed']}: {median:.3f} s",
                      flush=True)
    record = build_record({
        "prm": {"sizes": {size: SIZES[size] for size in args.sizes}, "shape": "grpo_mega.quickstart.pipeline."
                "POLICY_SHAPE with the size's changes", "layouts": {k: {"step_tag": PRM_LAYOUTS[k]}
                                                                      for k in args.prm_layouts},
                "max_length": MAX_LENGTH, "weights": "random (the same HF folder for both scorers)",
                "vllm_block_size": VLLM_BLOCK_SIZE, "threads": 2},
        "groups": args.groups, "group_size": args.group_size, "repeats": args.repeats, "results": rows,
    }, started=started, load_before=load_before)
    print(text_table(SCORER_COLUMNS, rows))
    write_record(record, args.out if args.out != DEFAULT_OUT else ROOT / "bench/results/prm_scorers.json")


DEFAULT_OUT = ROOT / "bench/results/prm_scoring.json"


def main() -> None:
    from grpo_mega.run.launcher import spawn_local_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--solutions", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes over all solutions (median reported)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--prm-layouts", nargs="+", default=list(PRM_LAYOUTS), choices=list(PRM_LAYOUTS))
    parser.add_argument("--quick", action="store_true", help="128 solutions, 2 passes")
    parser.add_argument("--work", type=Path, default=Path("/tmp/grpo_mega_bench/prm_scoring"))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--scorers", nargs="+", choices=("engine", "vllm"), default=None,
                        help="compare these scorers (module docstring) instead of the engine's layouts")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--groups", type=int, default=64, help="--scorers: prompts per batch")
    parser.add_argument("--group-size", type=int, default=4, help="--scorers: completions per prompt")
    args = parser.parse_args()
    if args.scorers:
        return compare_scorers(args)
    if args.quick:
        args.solutions, args.repeats = 128, 2
    if args.solutions < 1 or args.repeats < 1:
        parser.error("--solutions and --repeats must be positive")
    started, load_before = time.time(), load_average()
    prm_dirs, examples = build_inputs(args.work, args.solutions)
    rows = []
    for prm_layout in args.prm_layouts:
        for layout in args.layouts:
            tensor, pipeline, processes = LAYOUTS[layout]
            per_rank = spawn_local_ranks(
                _score, processes, (str(prm_dirs[prm_layout]), prm_layout, examples, tensor, pipeline, args.repeats),
                threads=2 if processes == 1 else 1, timeout=1800)
            rows.append(throughput(prm_layout, layout, per_rank, len(examples)))
            print(f"{prm_layout} {layout}: {rows[-1]['steps_per_s']:.0f} steps/s", flush=True)
    record = build_record({
        "prm": {"layouts": {name: {"step_tag": tag} for name, tag in PRM_LAYOUTS.items() if name in args.prm_layouts},
                "shape": "grpo_mega.quickstart.pipeline.POLICY_SHAPE",
                "max_length": MAX_LENGTH, "max_tokens_per_micro_batch": MAX_TOKENS_PER_MICRO_BATCH,
                "weights": "random init", "engine": "megatron (forward-only)"},
        "repeats": args.repeats, "results": rows,
    }, started=started, load_before=load_before)
    print(text_table(COLUMNS, rows))
    write_record(record, args.out)


if __name__ == "__main__":
    main()
