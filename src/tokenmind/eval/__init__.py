"""Evaluation: loss, perplexity and bits per byte; multiple-choice log-likelihood accuracy;
generative exact match (GSM8K); code pass@k (HumanEval); and `run_eval`, which runs a list of
tasks on one model and reports them."""

from .code import pass_at_k
from .generative import extract_answer
from .multiple_choice import evaluate_mc
from .perplexity import evaluate_lm, shard_val_loss
from .runner import TASKS, EvalConfig, run_eval

__all__ = ["TASKS", "EvalConfig", "evaluate_lm", "evaluate_mc", "extract_answer", "pass_at_k", "run_eval",
           "shard_val_loss"]
