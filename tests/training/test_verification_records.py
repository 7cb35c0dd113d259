"""Verification metrics (eval_fpr) in a run: the Evaluator's reports, metrics.jsonl's validation
records, report.json's test report, the monitors roc_auc / tpr@fpr=<x>, and the config's checks."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import TensorDataset

from rankwise.metrics import verification_metrics
from rankwise.training import ConfigError, Evaluator, Trainer, config_from_dict
from rankwise.training.monitor import check_monitor, monitor_value


def clustered(n_classes=4, per_class=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(n_classes).repeat_interleave(per_class)
    centers = 2 * torch.randn(n_classes, 5, generator=generator)
    return TensorDataset(centers[labels] + torch.randn(len(labels), 5, generator=generator), labels)


MODEL = torch.nn.Linear(5, 3)
CPU = torch.device("cpu")


def test_the_evaluator_adds_the_pair_view_of_the_same_embeddings(two_ranks):
    data, gallery = clustered(), clustered(per_class=9, seed=1)
    ranking = Evaluator(ks=(1,), fpr=(0.1, 0.01)).rank(MODEL, CPU, data, gallery)
    with torch.no_grad():
        query, others = MODEL(data.tensors[0]), MODEL(gallery.tensors[0])
    expected = verification_metrics(
        query, data.tensors[1], others, gallery.tensors[1], fpr=(0.01, 0.1)
    )
    assert ranking.report.verification == expected
    assert Evaluator(ks=(1,)).rank(MODEL, CPU, data).report.verification is None
    for rank in (0, 1):  # a data-parallel evaluator gives the one-process pair view
        sharded = Evaluator(ks=(1,), fpr=(0.1,), strategy=two_ranks(rank)).rank(MODEL, CPU, data)
        alone = Evaluator(ks=(1,), fpr=(0.1,)).rank(MODEL, CPU, data)
        assert sharded.report.to_dict() == alone.report.to_dict()
    with pytest.raises(ValueError, match="`fpr`"):
        Evaluator(fpr=(1.0,))


def test_a_run_records_the_verification_metrics_and_selects_on_them(tiny_config, tmp_path):
    config = tiny_config(
        tmp_path / "run", eval_fpr=[0.1, 0.01], **{"selection.monitor": "tpr@fpr=0.1"}
    )
    assert config.eval_fpr == [0.01, 0.1]
    trainer = Trainer.from_config(config)
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    validations = [r for r in records if r["kind"] == "val"]
    assert validations and all(
        set(r["verification"]["tpr_at_fpr"]) == {"0.01", "0.1"} for r in validations
    )
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    test = report["test"]["verification"]
    assert 0 <= test["roc_auc"] <= 1 and test["pairs"].startswith("leave-one-out")
    assert test["n_positive_pairs"] > 0 and test["n_negative_pairs"] > 0
    best = report["best_val"]
    assert monitor_value(best, "tpr@fpr=0.1") == best["verification"]["tpr_at_fpr"]["0.1"]


def test_monitor_names_and_values():
    assert check_monitor("roc_auc", fprs=[1e-3]) == "roc_auc"
    assert check_monitor("tpr@fpr=1e-3", [1], fprs=[0.001]) == "tpr@fpr=1e-3"
    with pytest.raises(ValueError, match="add 0.01 to eval_fpr"):
        check_monitor("tpr@fpr=0.01", fprs=[1e-3], argument="selection.monitor")
    with pytest.raises(ValueError, match="eval_fpr=\\[\\]"):
        check_monitor("roc_auc", fprs=[])
    with pytest.raises(ValueError, match="unknown validation metric"):
        check_monitor("tpr@fpr=2")
    summary = {"map": 0.5, "verification": {"roc_auc": 0.9, "tpr_at_fpr": {"0.001": 0.25}}}
    assert monitor_value(summary, "roc_auc") == 0.9
    assert monitor_value(summary, "tpr@fpr=1e-3") == 0.25
    with pytest.raises(ValueError, match="evaluated at the FPR budgets: 0.001"):
        monitor_value(summary, "tpr@fpr=0.01")
    with pytest.raises(ValueError, match="budgets: none"):
        monitor_value({"map": 0.5}, "roc_auc")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"eval_fpr": [0.0]}, "eval_fpr"),
        ({"eval_fpr": [1e-3, 1.5]}, "eval_fpr"),
        ({"eval_fpr": ["x"]}, "eval_fpr"),
        ({"selection": {"monitor": "roc_auc"}}, "add a budget to eval_fpr"),
        ({"eval_fpr": [0.1], "selection": {"monitor": "tpr@fpr=0.2"}}, "add 0.2 to eval_fpr"),
    ],
)
def test_bad_eval_fpr_and_verification_monitors_are_config_errors(tiny_config, changes, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(tiny_config.data(**changes))


def test_the_bench_table_shows_the_verification_columns_only_when_evaluated():
    from rankwise.metrics import retrieval_metrics
    from rankwise.reporting import bench_table_markdown
    from rankwise.workflows.bench import _mean_std

    data = clustered()
    x, y = data.tensors
    plain = retrieval_metrics(x, y, ks=(1, 10))
    verified = [
        plain.with_verification(verification_metrics(x, y, fpr=(1e-3,))),
        plain.with_verification(verification_metrics(x, y, fpr=(1e-3,), similarity="dot")),
    ]
    row = {"loss": "auc", "label": "auc", "seeds": [0, 1], "seconds": 1.0, **_mean_std(verified)}
    aucs = [r.verification.roc_auc for r in verified]
    assert row["roc_auc_mean"] == pytest.approx(sum(aucs) / 2) and "tpr@fpr=0.001_std" in row
    reference = {**_mean_std([plain]), "loss": "input", "label": "input", "seconds": 0.0}
    assert "roc_auc_mean" not in reference
    summary = {"dataset": "digits", "protocol": "open-set", "seeds": [0, 1], "rows": [row]}
    text = bench_table_markdown({**summary, "reference_rows": [reference]})
    header = text.split("|---")[0].splitlines()[-1]
    assert "ROC AUC" in header and "tpr@fpr=0.001" in header
    assert text.strip().splitlines()[-1].count("—") == 3  # the reference row: two dashes, no time
    plain_row = {**row, **_mean_std([plain, plain])}
    plain_row = {k: v for k, v in plain_row.items() if not k.startswith(("roc_auc", "tpr@"))}
    assert "ROC AUC" not in bench_table_markdown({**summary, "rows": [plain_row]})
