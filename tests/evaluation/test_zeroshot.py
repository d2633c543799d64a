"""A local multiple-choice task in lm-eval YAML runs end to end, offline, and scores what a hand computation scores."""
from __future__ import annotations

import json

import pytest
import torch

from elsa_ds.cli import evaluate_parser
from elsa_ds.evaluation.zeroshot import PAPER_TASKS, expand_tasks
from tests.conftest import run_entry

ITEMS = [  # (question, choices, answer index)
    ("The sky on a clear day is", ["blue", "green"], 0), ("Fire is", ["hot", "cold"], 0), ("Ice is", ["hot", "cold"], 1),
    ("Grass is", ["red", "green"], 1), ("Snow is", ["white", "black"], 0), ("Coal is", ["white", "black"], 1),
    ("The sun rises in the", ["east", "west"], 0), ("The sun sets in the", ["east", "west", "north"], 1),
    ("Two plus two is", ["four", "five"], 0), ("A cat says", ["woof", "meow", "moo"], 1),
]
TASK_YAML = """\
task: elsa_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def write_task(root) -> None:
    tasks = root / "tasks"
    tasks.mkdir()
    data = tasks / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "label": y}) + "\n" for q, c, y in ITEMS))
    (tasks / "elsa_tiny_mc.yaml").write_text(TASK_YAML.format(data=data))


def hand_accuracy(model_dir) -> tuple[float, float]:
    """lm-eval's multiple-choice rule: argmax over choices of log p(" " + choice | question), summed over the
    choice's tokens (acc) and divided by its length in characters (acc_norm)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    acc = acc_norm = 0
    for question, choices, label in ITEMS:
        scores = []
        for choice in choices:
            context = tok(question)["input_ids"]
            whole = tok(question + " " + choice)["input_ids"]
            with torch.no_grad():
                logprobs = torch.log_softmax(model(input_ids=torch.tensor([whole])).logits[0].float(), -1)
            scores.append(sum(logprobs[i - 1, whole[i]].item() for i in range(len(context), len(whole))))
        acc += max(range(len(choices)), key=lambda i: scores[i]) == label
        acc_norm += max(range(len(choices)), key=lambda i: scores[i] / len(" " + choices[i])) == label
    return acc / len(ITEMS), acc_norm / len(ITEMS)


@pytest.mark.integration
def test_local_task_end_to_end(tmp_path, tiny_model_dir, offline):
    write_task(tmp_path)
    out = tmp_path / "result.json"
    run_entry("evaluate.py", ["--model", str(tiny_model_dir), "--tasks", "elsa_tiny_mc", "--include_path", str(tmp_path / "tasks"),
                              "--output", str(out)], timeout=300)
    result = json.loads(out.read_text())
    metrics = result["tasks"]["elsa_tiny_mc"]
    assert 0.0 <= metrics["acc"] <= 1.0 and metrics["samples"] == len(ITEMS)
    assert (metrics["acc"], metrics["acc_norm"]) == pytest.approx(hand_accuracy(tiny_model_dir))
    assert result["average_acc"] == metrics["acc"]
    assert result["zeroshot"]["num_fewshot"] == 0 and result["zeroshot"]["add_bos_token"] is True  # Gemma
    assert any((tmp_path / "datasets_cache").iterdir())  # the JSONL went through the private, offline datasets cache


def test_task_lists():
    assert evaluate_parser().parse_args(["--model", "m", "--tasks"]).tasks == "paper"
    assert evaluate_parser().parse_args(["--model", "m"]).tasks is None
    assert expand_tasks(["paper"]) == list(PAPER_TASKS)
    assert PAPER_TASKS == ("boolq", "rte", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa")
    assert expand_tasks(["rte", " mine", "paper"]) == ["rte", "mine", *(t for t in PAPER_TASKS if t != "rte")]


def test_task_data_that_cannot_be_fetched_is_one_line_not_a_traceback(tiny_model_dir, monkeypatch):
    """What the hub client raises when a task's data cannot be had (the early check trusts a partial cache) is an
    ElsaError naming the tasks (a walk: lm-eval's ConnectionError reached the user as a traceback after the job)."""
    import lm_eval
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from elsa_ds.errors import ElsaError
    from elsa_ds.evaluation.zeroshot import zeroshot

    def offline(**kwargs):
        raise ConnectionError("Couldn't reach 'aps/super_glue' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(lm_eval, "simple_evaluate", offline)
    model, tok = AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(ElsaError, match=r"^tasks boolq: lm-eval could not load their data \(ConnectionError: Couldn't reach"):
        zeroshot(model, tok, ["boolq"], None, 1, 2)
