"""Golden snapshot of rankwise's numbers: every loss, metric, index and similarity fit, saved to one file.

A maintainer tool for refactors that must not change behaviour (issue 20): run it on two source
trees (``PYTHONPATH=<tree>/src python snapshot.py out.pt``) and compare the files with
``compare_golden.py``. Every loss of ``rankwise.losses.LOSSES`` is evaluated in float64 and float32
on fixed seeded embeddings under several label patterns (value and input gradient); every public
function of ``rankwise.metrics.__all__`` on seeded scores / embeddings with ties; ``HammingIndex``
search results; ``BilinearSimilarity`` and ``MMC`` fitted on a small seeded problem; the errors of
``build_loss`` and of every loss on invalid inputs. Only import paths that exist before the
redesign (commit ecbbf1e) and are kept after it are used. Errors are recorded as text
(``error/...`` keys) so that a loss refusing an input is part of the snapshot.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rankwise import metrics
from rankwise.hashing import HammingIndex
from rankwise.losses import LOSSES, build_loss
from rankwise.models import MMC, BilinearSimilarity

# Embedding dimension of every loss input (small: the snapshot runs in about a minute).
DIM = 8


def flatten(
    prefix: str, value: Any, tensors: dict[str, torch.Tensor], text: dict[str, str]
) -> None:
    """Store ``value`` under ``prefix``: tensors / arrays / numbers as tensors, the rest as text."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            flatten(f"{prefix}.{field.name}", getattr(value, field.name), tensors, text)
    elif isinstance(value, dict):
        for key, item in value.items():
            flatten(f"{prefix}.{key}", item, tensors, text)
    elif isinstance(value, (tuple, list)) and not all(
        isinstance(v, (int, float, bool)) for v in value
    ):
        for i, item in enumerate(value):
            flatten(f"{prefix}[{i}]", item, tensors, text)
    elif isinstance(value, torch.Tensor):
        tensors[prefix] = value.detach().cpu().clone()
    elif isinstance(value, np.ndarray) and value.dtype != object:
        tensors[prefix] = torch.from_numpy(np.ascontiguousarray(value).copy())
    elif isinstance(value, (bool, int, float, np.generic, list, tuple)):
        tensors[prefix] = torch.as_tensor(np.asarray(value))
    else:
        text[prefix] = repr(value)


class Snapshot:
    """Tensors and text entries by key; ``record`` runs one call and stores its result or error."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.text: dict[str, str] = {}

    def record(self, prefix: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Store ``fn(*args, **kwargs)`` under ``prefix``, or the type and message of its error."""
        try:
            result = fn(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - a refusal is part of the behaviour recorded
            self.text[f"error/{prefix}"] = f"{type(error).__name__}: {error}"
            return
        flatten(prefix, result, self.tensors, self.text)


def label_patterns() -> dict[str, dict[str, torch.Tensor | None]]:
    """Label layouts: P x K, imbalanced with a singleton, with a reference set, one class only."""
    gen = torch.Generator().manual_seed(1)
    return {
        "pk4x4": {"labels": torch.arange(4).repeat_interleave(4), "ref": None},
        "imbalanced": {
            "labels": torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 4, 4, 4, 1, 0]),
            "ref": None,
        },
        "with_ref": {
            "labels": torch.arange(4).repeat_interleave(4),
            "ref": torch.randint(0, 5, (20,), generator=gen),
        },
        "one_class": {"labels": torch.zeros(16, dtype=torch.long), "ref": None},
    }


def embedding_kinds(n: int, seed: int) -> dict[str, torch.Tensor]:
    """Float64 embeddings: Gaussian, tanh-relaxed codes in (-1, 1), and coarse ones with ties."""
    gen = torch.Generator().manual_seed(seed)
    gauss = torch.randn(n, DIM, generator=gen, dtype=torch.float64)
    return {
        "gauss": gauss,
        "tanh": torch.tanh(1.5 * gauss),
        "ties": torch.round(gauss * 2) / 2,
    }


def loss_call(name: str, dtype: torch.dtype, emb: torch.Tensor, pattern: dict, ref_emb) -> dict:
    """Value and input gradients of loss ``name`` on one input (two calls for stateful losses)."""
    torch.manual_seed(0)
    train_labels = torch.arange(5).repeat(10)
    loss_fn = build_loss(name, train_labels=train_labels, num_classes=5, embedding_dim=DIM)
    loss_fn = loss_fn.to(dtype)
    out: dict[str, Any] = {}
    for call in range(2):
        x = emb.to(dtype).clone().requires_grad_(True)
        ref = None if pattern["ref"] is None else ref_emb.to(dtype).clone().requires_grad_(True)
        value = loss_fn(x, pattern["labels"], ref, pattern["ref"])
        value.backward()
        out[f"call{call}"] = {"value": value.detach(), "grad": x.grad}
        if ref is not None:
            out[f"call{call}"]["ref_grad"] = ref.grad
    return out


def snapshot_losses(snap: Snapshot) -> None:
    """Every registered loss x dtype x embedding kind x label pattern."""
    embeddings = embedding_kinds(16, seed=0)
    ref_embeddings = embedding_kinds(20, seed=1)
    for name in LOSSES:
        try:
            build_loss(
                name, train_labels=torch.arange(5).repeat(10), num_classes=5, embedding_dim=DIM
            )
        except ImportError as error:
            snap.text[f"skipped/loss/{name}"] = f"{type(error).__name__}: {error}"
            print(f"skipped loss {name}: {error}", file=sys.stderr)
            continue
        for dtype in (torch.float64, torch.float32):
            for kind, emb in embeddings.items():
                for pattern_name, pattern in label_patterns().items():
                    key = f"loss/{name}/{str(dtype)[6:]}/{kind}/{pattern_name}"
                    snap.record(
                        key,
                        loss_call,
                        name,
                        dtype,
                        emb,
                        pattern,
                        ref_embeddings[kind],
                    )


def ranking_inputs() -> dict[str, torch.Tensor]:
    """Seeded score rows with many ties, binary relevance and graded gains."""
    gen = torch.Generator().manual_seed(2)
    scores = torch.randint(0, 6, (5, 30), generator=gen).to(torch.float64)
    relevance = (torch.rand(5, 30, generator=gen) < 0.3).to(torch.float64)
    relevance[:, 0] = 1.0
    gains = torch.randint(0, 4, (5, 30), generator=gen).to(torch.float64)
    return {"scores": scores, "relevance": relevance, "gains": gains}


def bad_inputs() -> dict[str, tuple]:
    """Invalid calls ``(embeddings, labels, ref_embeddings, ref_labels)`` every loss must refuse."""
    emb = torch.tanh(torch.randn(16, DIM, generator=torch.Generator().manual_seed(7)))
    labels = torch.arange(4).repeat_interleave(4)
    nan = emb.clone()
    nan[3, 2] = float("nan")
    return {
        "ref_embeddings_only": (emb, labels, emb, None),
        "ref_dim_mismatch": (emb, labels, emb[:, :4], labels),
        "labels_length": (emb, labels[:10], None, None),
        "one_dimensional": (emb[:, 0], labels, None, None),
        "nan": (nan, labels, None, None),
        "float_labels": (emb, labels.double() + 0.5, None, None),
    }


def snapshot_errors(snap: Snapshot) -> None:
    """The refusals of ``build_loss`` (unknown name or key) and of every loss on invalid inputs."""
    train_labels = torch.arange(5).repeat(10)
    snap.record("build_loss/unknown_name", build_loss, "no_such_loss", train_labels=train_labels)
    for name in LOSSES:
        snap.record(
            f"build_loss/{name}/unknown_key", build_loss, name, train_labels=train_labels, bogus=1
        )
        try:
            loss_fn = build_loss(name, train_labels=train_labels, num_classes=5, embedding_dim=DIM)
        except ImportError:
            continue  # listed under skipped/ by snapshot_losses
        for case, args in bad_inputs().items():
            snap.record(f"loss_error/{name}/{case}", loss_fn, *args)


def snapshot_ranking(snap: Snapshot) -> None:
    """average_precision, ndcg and their batched forms, per tie rule."""
    data = ranking_inputs()
    for ties in ("expected", "optimistic", "pessimistic"):
        snap.record(
            f"metrics/batched_average_precision/{ties}",
            metrics.batched_average_precision,
            data["scores"],
            data["relevance"],
            ties=ties,
        )
        snap.record(
            f"metrics/average_precision/{ties}",
            metrics.average_precision,
            data["scores"][0],
            data["relevance"][0],
            ties=ties,
        )
        for k in (None, 5):
            snap.record(
                f"metrics/batched_ndcg/{ties}/k{k}",
                metrics.batched_ndcg,
                data["scores"],
                data["gains"],
                k=k,
                ties=ties,
            )
            snap.record(
                f"metrics/ndcg/{ties}/k{k}",
                metrics.ndcg,
                data["scores"][1],
                data["gains"][1],
                k=k,
                ties=ties,
            )


def retrieval_inputs() -> dict[str, torch.Tensor]:
    """Seeded embeddings with duplicated rows (tied similarities) and a separate gallery."""
    gen = torch.Generator().manual_seed(3)
    query = torch.round(torch.randn(60, DIM, generator=gen) * 2) / 2
    query[30:40] = query[0:10]
    labels = torch.randint(0, 6, (60,), generator=gen)
    gallery = torch.round(torch.randn(80, DIM, generator=gen) * 2) / 2
    gallery_labels = torch.randint(0, 6, (80,), generator=gen)
    return {"q": query, "ql": labels, "g": gallery, "gl": gallery_labels}


def snapshot_retrieval(snap: Snapshot) -> None:
    """retrieval_metrics, pr_curve, RetrievalMetric and the merge / distributed forms."""
    d = retrieval_inputs()
    for similarity in ("cosine", "euclidean", "dot"):
        for ties in ("expected", "optimistic", "pessimistic"):
            for backend in ("numba", "torch"):
                key = f"metrics/retrieval_metrics/{similarity}/{ties}/{backend}"
                snap.record(
                    f"{key}/loo",
                    metrics.retrieval_metrics,
                    d["q"],
                    d["ql"],
                    ks=(1, 2, 5, 10),
                    similarity=similarity,
                    ties=ties,
                    backend=backend,
                )
                snap.record(
                    f"{key}/gallery",
                    metrics.retrieval_metrics,
                    d["q"],
                    d["ql"],
                    d["g"],
                    d["gl"],
                    ks=(1, 3),
                    similarity=similarity,
                    ties=ties,
                    backend=backend,
                )
            snap.record(
                f"metrics/pr_curve/{similarity}/{ties}",
                metrics.pr_curve,
                d["q"],
                d["ql"],
                similarity=similarity,
                ties=ties,
                num_points=21,
            )
    halves = [(d["q"][:30], d["ql"][:30]), (d["q"][30:], d["ql"][30:])]
    snap.record(
        "metrics/merge_retrieval_reports",
        metrics.merge_retrieval_reports,
        [metrics.retrieval_metrics(q, ql, d["g"], d["gl"], ks=(1, 3)) for q, ql in halves],
    )
    snap.record(
        "metrics/merge_pr_curves",
        metrics.merge_pr_curves,
        [metrics.pr_curve(q, ql, d["g"], d["gl"], num_points=21) for q, ql in halves],
    )
    snap.record(
        "metrics/distributed_retrieval_metrics",
        metrics.distributed_retrieval_metrics,
        d["q"],
        d["ql"],
        d["g"],
        d["gl"],
        ks=(1, 3),
    )
    snap.record(
        "metrics/distributed_pr_curve",
        metrics.distributed_pr_curve,
        d["q"],
        d["ql"],
        d["g"],
        d["gl"],
        num_points=21,
    )

    def module_report() -> Any:
        metric = metrics.RetrievalMetric(ks=(1, 5))
        metric.update(d["q"][:25], d["ql"][:25])
        metric.update(d["q"][25:], d["ql"][25:])
        return metric.compute()

    snap.record("metrics/RetrievalMetric", module_report)


def snapshot_curves(snap: Snapshot) -> None:
    """ROC curve, AUC, TPR@FPR, operating point and pair scores, on tied scores."""
    gen = torch.Generator().manual_seed(4)
    scores = torch.randint(0, 12, (200,), generator=gen).to(torch.float64) / 4
    is_positive = torch.rand(200, generator=gen) < 0.4
    weights = torch.rand(200, generator=gen).to(torch.float64)
    d = retrieval_inputs()
    snap.record("metrics/roc_auc", metrics.roc_auc, scores, is_positive)
    for drop in (False, True):
        snap.record(
            f"metrics/roc_curve/drop{drop}",
            metrics.roc_curve,
            scores,
            is_positive,
            drop_intermediate=drop,
        )
    for fpr in (0.0, 0.01, 0.1, 0.25, 0.5, 1.0):
        snap.record(
            f"metrics/tpr_at_fpr/{fpr}",
            metrics.tpr_at_fpr,
            scores,
            is_positive,
            fpr,
            return_threshold=True,
        )
        snap.record(
            f"metrics/tpr_at_fpr_weighted/{fpr}",
            metrics.tpr_at_fpr,
            scores,
            is_positive,
            fpr,
            sample_weight=weights,
        )
        snap.record(
            f"metrics/operating_point/{fpr}",
            metrics.operating_point,
            scores,
            is_positive,
            fpr,
        )
        snap.record(
            f"metrics/operating_point_weighted/{fpr}",
            metrics.operating_point,
            scores,
            is_positive,
            fpr,
            sample_weight=weights,
        )
    for similarity in ("cosine", "euclidean"):
        snap.record(
            f"metrics/pair_scores/{similarity}/loo",
            metrics.pair_scores,
            d["q"],
            d["ql"],
            similarity=similarity,
        )
        snap.record(
            f"metrics/pair_scores/{similarity}/gallery",
            metrics.pair_scores,
            d["q"],
            d["ql"],
            d["g"],
            d["gl"],
            similarity=similarity,
        )
        for bins in (None, 16):
            snap.record(
                f"metrics/roc_curve_from_embeddings/{similarity}/bins{bins}",
                metrics.roc_curve_from_embeddings,
                d["q"],
                d["ql"],
                similarity=similarity,
                bins=bins,
            )


def hamming_inputs() -> dict[str, torch.Tensor]:
    """Seeded +-1 codes (16 bits) with features for Euclidean-threshold affinities."""
    gen = torch.Generator().manual_seed(5)
    features_q = torch.randn(40, 6, generator=gen, dtype=torch.float64)
    features_db = torch.randn(70, 6, generator=gen, dtype=torch.float64)
    projection = torch.randn(6, 16, generator=gen, dtype=torch.float64)
    return {
        "q": torch.sign(features_q @ projection + 0.01),
        "db": torch.sign(features_db @ projection + 0.01),
        "ql": torch.randint(0, 4, (40,), generator=gen),
        "dbl": torch.randint(0, 4, (70,), generator=gen),
        "fq": features_q,
        "fdb": features_db,
    }


def snapshot_hamming(snap: Snapshot) -> None:
    """hamming_retrieval_metrics (labels and Euclidean affinities) and HammingIndex searches."""
    h = hamming_inputs()
    for ties in ("expected", "optimistic", "pessimistic"):
        snap.record(
            f"metrics/hamming_retrieval_metrics/labels/{ties}",
            metrics.hamming_retrieval_metrics,
            h["q"],
            h["ql"],
            h["db"],
            h["dbl"],
            ks=(1, 5, 10),
            ties=ties,
        )
        snap.record(
            f"metrics/hamming_retrieval_metrics/loo/{ties}",
            metrics.hamming_retrieval_metrics,
            h["db"],
            h["dbl"],
            ks=(1, 5),
            ties=ties,
        )
    affinity = metrics.EuclideanThresholdAffinity(thresholds=(2.0, 3.0, 4.0), levels=(1, 2, 5))
    snap.record("metrics/EuclideanThresholdAffinity", affinity, h["fq"], h["fdb"])
    snap.record(
        "metrics/EuclideanThresholdAffinity/from_quantiles",
        lambda: metrics.EuclideanThresholdAffinity.from_quantiles(h["fdb"]).to_dict(),
    )
    snap.record(
        "metrics/hamming_retrieval_metrics/euclidean",
        metrics.hamming_retrieval_metrics,
        h["q"],
        h["fq"],
        h["db"],
        h["fdb"],
        ks=(1, 5),
        affinity=affinity,
    )

    def index_results() -> dict[str, Any]:
        index = HammingIndex(16)
        index.add(h["db"])
        distances, ids = index.search(h["q"], 7)
        lims, r_dist, r_ids = index.radius_search(h["q"], 4)
        return {
            "search_dist": distances,
            "search_ids": ids,
            "lims": lims,
            "r_dist": r_dist,
            "r_ids": r_ids,
        }

    snap.record("hashing/HammingIndex", index_results)


def snapshot_similarity(snap: Snapshot) -> None:
    """BilinearSimilarity (both methods) and MMC on a small seeded three-class problem."""
    rng = np.random.default_rng(6)
    centers = rng.normal(size=(3, 5))
    y = np.repeat(np.arange(3), 30)
    X = centers[y] + 0.8 * rng.normal(size=(90, 5))
    unit = X / np.linalg.norm(X, axis=1, keepdims=True)  # BilinearSimilarity needs unit rows
    estimators = {
        "bilinear_mean": lambda: BilinearSimilarity(alpha=0.2),
        "bilinear_indicator": lambda: BilinearSimilarity(
            alpha=0.2, risk="indicator", max_iter=50, random_state=0, n_threads=1
        ),
        "bilinear_mean_subsampled": lambda: BilinearSimilarity(
            alpha=0.2, negatives="tuples", n_negative_samples=40, random_state=0
        ),
        "mmc": lambda: MMC(max_iter=50, random_state=0),
        "mmc_subsampled": lambda: MMC(
            max_iter=50, negatives="pairs", n_negative_samples=500, random_state=0
        ),
    }
    for name, make in estimators.items():

        def fitted(make: Callable = make) -> dict[str, Any]:
            features = X if isinstance(make(), MMC) else unit
            estimator = make().fit(features, y)
            return {
                key: value
                for key, value in vars(estimator).items()
                if key.endswith("_") and not key.startswith("_")
            } | {"pair_score": estimator.pair_score(features[:10], features[10:20])}

        snap.record(f"similarity/{name}", fitted)


def main(argv: list[str]) -> int:
    """Write the snapshot to ``argv[0]``."""
    if len(argv) != 1:
        print("usage: snapshot.py OUT.pt", file=sys.stderr)
        return 2
    torch.use_deterministic_algorithms(True)
    snap = Snapshot()
    for section in (
        snapshot_losses,
        snapshot_errors,
        snapshot_ranking,
        snapshot_retrieval,
        snapshot_curves,
        snapshot_hamming,
        snapshot_similarity,
    ):
        section(snap)
    torch.save({"tensors": snap.tensors, "text": snap.text}, argv[0])
    errors = sum(key.startswith("error/") for key in snap.text)
    print(f"{len(snap.tensors)} tensors, {len(snap.text)} entries ({errors} errors) -> {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
