"""``grpo-mega prm eval``: score step-labelled rows and/or rerank a policy's samples with the PRM, and write the
report (``prm.evaluate``, ``prm.best_of_n``) as one JSON file, its path printed last; keys that do not apply are
null."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from prm.evaluate import REPORT_KEYS, data_report, finish_report

logger = logging.getLogger(__name__)


def add_eval_arguments(parser) -> None:
    """The flags of ``grpo-mega prm eval``."""
    from prm.scoring import add_data_arguments, add_prm_arguments

    add_prm_arguments(parser)
    add_data_arguments(parser, required=False)
    parser.add_argument("--dev-file", default=None, help="dev split for the ProcessBench threshold (same format)")
    parser.add_argument("--dev-fraction", type=float, default=0.3,
                        help="without --dev-file: share of --data rows used to choose the threshold")
    parser.add_argument("--policy", default=None, help="best-of-N: the policy (HF folder or grpo-mega checkpoint)")
    parser.add_argument("--prompts", default=None, help="best-of-N: prompts with gold answers (jsonl)")
    parser.add_argument("--n", type=int, default=8, help="best-of-N: samples per prompt")
    parser.add_argument("--max-prompts", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--reward", default="synthetic", help="best-of-N: the verifier of a sample's final answer")
    parser.add_argument("--step-pattern", default=None, help="best-of-N: regex that ends a step (see step_split)")
    parser.add_argument("--samples-out", default=None, help="best-of-N: write the scored samples here (jsonl)")
    parser.add_argument("--out", required=True, help="the report (JSON)")


def run_eval(args) -> Path:
    """``grpo-mega prm eval``: writes the JSON report and returns its path."""
    import torch.distributed as dist

    from grpo_mega.parallel import destroy_distributed
    from prm.scoring import close_scorer, open_scorer, read_data

    if args.data is None and args.policy is None:
        raise ValueError("prm eval: give --data (step-labelled rows) and/or --policy with --prompts (best-of-N)")
    _, scorer = open_scorer(args)
    report: dict = {"prm": str(args.prm)}
    if args.data is not None:
        examples = read_data(args)
        dev = read_data(args, path=args.dev_file) if args.dev_file else []
        report.update(data_report(examples, scorer.score_examples(examples), dev_examples=dev,
                                  dev_scores=scorer.score_examples(dev) if dev else [],
                                  dev_fraction=args.dev_fraction, seed=args.seed))
        report["data"] = str(args.data)
    if args.policy is not None:
        from prm.best_of_n import best_of_n_report

        if args.prompts is None:
            raise ValueError("prm eval: --policy needs --prompts (prompts with gold answers)")
        report.update(best_of_n_report(args, scorer))
    report = finish_report(report)
    out = Path(args.out)
    if dist.get_rank() == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        logger.info("PRM evaluation: %s", {k: report[k] for k in REPORT_KEYS})
    close_scorer(scorer)  # vLLM's groups before the job's
    destroy_distributed()
    return out
