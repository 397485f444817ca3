"""The read-out of the LM head and of a score head, by score mode, on given logits (no model)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from scorer.readout import label_logprobs, score
from scorer.request import ScoreHead, ScoreOptions


class Logits:
    """A model whose ``score_logits`` returns fixed rows."""

    def __init__(self, rows: list[list[float]]) -> None:
        self.rows = torch.tensor(rows)

    def score_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        return self.rows[: len(hidden_rows)]


def job(label_ids, items: int, mode: str):
    return SimpleNamespace(
        label_ids=tuple(label_ids), items=((1,),) * items, options=ScoreOptions(score_mode=mode)
    )


def test_one_output_is_read_against_zero_so_every_mode_is_the_logits():
    head = ScoreHead("Qwen2ForSequenceClassification", 1, 0)
    assert head.label_ids == (0, 1)
    model = Logits([[2.0], [-1.5]])
    for mode, want in (
        ("softmax", [1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(1.5))]),
        ("sigmoid", [1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(1.5))]),
        ("raw", [2.0, -1.5]),
        ("logprob", [-math.log1p(math.exp(-2.0)), -math.log1p(math.exp(1.5))]),
    ):
        flat = label_logprobs(model, torch.zeros(2, 4), [job(head.label_ids, 2, mode)]).tolist()
        got = [score(flat[i : i + 2], mode) for i in (0, 2)]
        assert got == pytest.approx(want, abs=1e-6), mode


def test_several_outputs_put_the_relevant_label_first():
    assert ScoreHead("LlamaForSequenceClassification", 3, 2).label_ids == (2, 0, 1)
    assert ScoreHead("LlamaForSequenceClassification", 3, 0).label_ids == (0, 1, 2)
    model = Logits([[0.5, -1.0, 2.0]])
    head = ScoreHead("LlamaForSequenceClassification", 3, 1)
    flat = label_logprobs(model, torch.zeros(1, 4), [job(head.label_ids, 1, "softmax")]).tolist()
    assert score(flat, "softmax") == pytest.approx(torch.softmax(model.rows[0], 0)[1].item(), abs=1e-6)
    assert score(flat, "logprob") == pytest.approx(torch.log_softmax(model.rows[0], 0)[1].item(), abs=1e-6)


def test_raw_and_normalised_jobs_share_a_batch():
    """The LM head: raw and sigmoid read the labels' logits, softmax and logprob their log-probs
    over the vocabulary, each job as its mode says within one batch."""
    rows = [[1.0, 3.0, -2.0, 0.5], [0.0, -1.0, 4.0, 2.0]]
    model = Logits(rows)
    jobs = [job((1, 2), 1, "raw"), job((1, 2), 1, "logprob")]
    flat = label_logprobs(model, torch.zeros(2, 4), jobs).tolist()
    lse = torch.logsumexp(torch.tensor(rows[1]), 0).item()
    assert flat == pytest.approx([3.0, -2.0, -1.0 - lse, 4.0 - lse], abs=1e-6)
    assert score(flat[:2], "raw") == 3.0
    assert score(flat[:2], "sigmoid") == pytest.approx(1 / (1 + math.exp(-3.0)))
    assert score([-800.0], "sigmoid") == 0.0 and score([800.0], "sigmoid") == 1.0  # no overflow
