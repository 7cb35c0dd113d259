"""The issue-21 study summaries (benchmarks/studies/) on hand-made run folders: the right runs are
read, means / drops / late validation gains are computed from them, and every missing or
unfinished run is counted instead of silently dropped; and the study's driver (sampling_rate.sh)
with a stand-in CLI: the subset, budget and schedule it passes, and that finished runs are skipped."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

STUDIES = Path(__file__).resolve().parents[1] / "benchmarks" / "studies"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, STUDIES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(run: Path, test_map: float, best_step: int = 800, vals=(0.40, 0.50), status="completed"):
    """A finished run: report.json and the validation records (the last two at 640 and 800)."""
    run.mkdir(parents=True)
    test = {"map": test_map, "recall_at": {"1": 0.5, "10": 0.9}, "map_at_r": 0.3}
    report = {"status": status, "steps": 800, "best_step": best_step, "test": test}
    (run / "report.json").write_text(json.dumps(report))
    records = [{"kind": "train", "step": 10, "loss": 1.0}, {"kind": "val", "step": 80, "map": 0.1}]
    records += [{"kind": "val", "step": s, "map": v} for s, v in zip((640, 800), vals, strict=True)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_sampling_rate_summary_means_drops_gains_and_unfinished_runs(tmp_path, capsys):
    summary = _script("summarize_sampling_rate")
    out = tmp_path / "study"
    for cell, maps in {"fb_k2": (0.60, 0.62, 0.58), "fb_k8": (0.45, 0.45, 0.45)}.items():
        for seed, value in enumerate(maps):
            _run(
                out / "pretrained" / cell / "ap" / f"seed{seed}",
                value,
                best_step=720 if seed == 0 else 800,
            )
    _run(out / "pretrained" / "fb_k4" / "ap" / "seed0", 0.55, status="interrupted")
    assert summary.main([str(out), "--markdown", str(tmp_path / "t.md")]) == 0
    text = (tmp_path / "t.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| AP loss"))
    # K = 2: 60 ± 2; K = 4 unfinished; K = 8: 45 ± 0; drop 15 points = 25 %; the seed-1 and -2
    # runs of each cell selected their last step (4 of 6); every run gained 10 points late
    assert (
        row
        == "| AP loss (biased) | 60.00 ± 2.00 | — | 45.00 ± 0.00 | 15.00 | 25 % | 4 of 6 | +10.00 |"
    )
    assert "Unfinished runs: 204 of 210." in text
    assert summary.main([str(tmp_path / "nowhere")]) == 2
    assert "sampling_rate.sh" in capsys.readouterr().err


def test_sampling_rate_summary_of_a_subset_counts_only_the_subset(tmp_path):
    summary = _script("summarize_sampling_rate")
    out = tmp_path / "study"
    for cell, value in {"fc_k2": 0.50, "fc_k8": 0.70}.items():
        for seed in range(3):
            _run(out / "pretrained" / cell / "smooth_ap" / f"seed{seed}", value)
    _run(out / "pretrained" / "fc_k2" / "ap" / "seed0", 0.4)
    args = ["--starts", "pretrained", "--cells", "fc_k2", "fc_k8", "--losses", "ap", "smooth_ap"]
    assert summary.main([str(out), *args, "--markdown", str(tmp_path / "t.md")]) == 0
    text = (tmp_path / "t.md").read_text()
    assert "from scratch" not in text and "SOPRC" not in text
    row = next(
        line
        for line in text.split("fixed 16 classes")[1].splitlines()
        if line.startswith("| Smooth-AP")
    )
    # K = 4 is outside the subset; the drop from 50 to 70 is -20 points, -40 %
    assert row.startswith("| Smooth-AP | 50.00 ± 0.00 | not run | 70.00 ± 0.00 | -20.00 | -40 % |")
    # 2 cells x 2 losses x 3 seeds = 12 runs, 7 finished
    assert "Unfinished runs: 5 of 12." in text


def test_sampling_rate_paired_differences_by_seed_and_the_unpaired_count(tmp_path):
    summary = _script("summarize_sampling_rate")
    out = tmp_path / "study"
    for loss, maps in {"soprc": (0.60, 0.70, 0.50), "soprc_detach": (0.62, 0.70)}.items():
        for seed, value in enumerate(maps):
            _run(out / "scratch" / "fc_k8" / loss / f"seed{seed}", value)
    # a numv run without its defaults partner is not paired
    _run(out / "pretrained" / "fb_k2" / "soprc_numv" / "seed0", 0.3)
    text = summary.paired(out)
    row = next(line for line in text.splitlines() if "from scratch | K = 8, batch 128" in line)
    assert row.endswith("| — | +2.00 / +0.00 (mean +1.00) |")
    total = text.splitlines()[-1]
    assert "| — (30 pairs unfinished) |" in total
    assert "+1.00 over 2 pairs: 1 better, 1 equal, 0 worse (28 pairs unfinished)" in total
    assert summary.main([str(out), "--paired", "--markdown", str(tmp_path / "p.md")]) == 0
    assert "paired by seed" in (tmp_path / "p.md").read_text()


def test_pretrained_table_prefers_the_bench_runs_and_lists_the_missing(tmp_path):
    table = _script("pretrained_table")
    study, bench = tmp_path / "study", tmp_path / "bench"
    for seed in range(3):
        _run(study / "pretrained" / "fb_k4" / "ap" / f"seed{seed}", 0.5 + 0.01 * seed)
        _run(bench / "triplet" / f"seed{seed}", 0.2)
        # a study run of a loss the bench also ran is not read
        _run(study / "pretrained" / "fb_k4" / "triplet" / f"seed{seed}", 0.9)
    _run(bench / "auc" / "seed0", 0.3)
    text, missing = table.table(study, [bench])
    rows = {line.split(" | ")[0]: line for line in text.splitlines()}
    assert rows["| AP loss (biased)"].startswith("| AP loss (biased) | 51.00 ± 1.00 | 50.00 ± 0.00")
    assert "50.00, 51.00, 52.00 | 800 / 800 / 800 of 800 |" in rows["| AP loss (biased)"]
    assert rows["| triplet, batch-hard (PML)"].startswith(
        "| triplet, batch-hard (PML) | 20.00 ± 0.00"
    )
    assert rows["| AUC loss (batch-all) (1 of 3 seeds)"].startswith(
        "| AUC loss (batch-all) (1 of 3 seeds) | 30.00 |"
    )
    assert len(missing) == 3 * (len(table.ROWS) - 3) + 2
    assert any(m.startswith("auc seed 1") for m in missing)


@pytest.mark.parametrize("args", [[], ["--study", "nowhere"]])
def test_pretrained_table_refuses_missing_folders(args, capsys):
    assert _script("pretrained_table").main(args) == 2
    assert "no such folder" in capsys.readouterr().err


# A stand-in for the rankwise CLI: records each call's arguments and finishes the run at once.
FAKE_RANKWISE = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
while [ $# -gt 0 ]; do case $1 in -o | --resume) out=$2 ;; esac; shift; done
mkdir -p "$out"
touch "$out/pretrained.pt"
echo '{"status": "completed"}' > "$out/report.json"
"""


def _study(tmp_path: Path, **env: str):
    fake = tmp_path / "rankwise"
    fake.write_text(FAKE_RANKWISE)
    fake.chmod(0o755)
    calls = tmp_path / "calls.txt"
    calls.touch()
    # the script's own settings come only from the test, never from the caller's shell
    own = {"BUDGET", "EVAL_EVERY", "SCHEDULE", "SEEDS", "STARTS", "CELLS_RUN", "LOSSES_RUN"}
    own |= {"THREADS", "BACKBONE_LR_MULT", "PRETRAIN_SEED"}
    inherited = {key: value for key, value in os.environ.items() if key not in own}
    full = {**inherited, "RANKWISE": str(fake), "CALLS": str(calls), **env}
    result = subprocess.run(
        ["bash", str(STUDIES / "sampling_rate.sh"), str(tmp_path / "out")],
        cwd=STUDIES.parents[1],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return result, calls.read_text().splitlines()


def test_sampling_rate_study_runs_the_subset_once_with_the_step_schedule(tmp_path):
    subset = {"SEEDS": "0", "STARTS": "pretrained", "CELLS_RUN": "fb_k2 fc_k8", "LOSSES_RUN": "ap"}
    result, calls = _study(tmp_path, BUDGET="2400", EVAL_EVERY="120", SCHEDULE="step", **subset)
    assert result.returncode == 0, result.stderr
    pretrain, *trains = calls
    assert pretrain.startswith("pretrain ")
    assert len(trains) == 2
    for call in trains:
        # the paper's two decays, at half and three quarters of the budget
        assert "schedule.name=multistep schedule.milestones=[1200,1800]" in call
        assert "budget.iterations=2400 eval_every=120" in call
        assert "model.pretrained=" in call and "loss.name=ap" in call
    assert "sampler.m=8 sampler.batch_size=128" in trains[1]
    # a second pass finds every run completed and starts nothing
    again, calls_again = _study(tmp_path, SCHEDULE="step", **subset)
    assert again.returncode == 0 and calls_again == calls


def test_sampling_rate_study_defaults_to_a_constant_rate_and_refuses_unknown_schedules(tmp_path):
    subset = {"SEEDS": "1", "STARTS": "scratch", "CELLS_RUN": "fb_k4", "LOSSES_RUN": "soprc_numv"}
    result, calls = _study(tmp_path, **subset)
    assert result.returncode == 0, result.stderr
    assert "schedule." not in calls[1] and "budget.iterations=800" in calls[1]
    assert "loss.params.tpr_count=num_v" in calls[1] and "model.pretrained" not in calls[1]
    bad, _ = _study(tmp_path, SCHEDULE="cosine", **subset)
    assert bad.returncode == 2 and "SCHEDULE=cosine: use none or step" in bad.stderr


def test_sampling_rate_study_pretrains_with_the_given_seed_only(tmp_path):
    subset = {"SEEDS": "0", "STARTS": "pretrained", "CELLS_RUN": "fb_k2", "LOSSES_RUN": "ap"}
    result, calls = _study(tmp_path, PRETRAIN_SEED="2", **subset)
    assert result.returncode == 0, result.stderr
    pretrain, train = calls
    # the pretraining's seed, and not the fine-tuning's: that stays the run's own seed
    assert pretrain.endswith(" seed=2") and train.count("seed=") == 1 and " seed=0 " in train
    (tmp_path / "plain").mkdir()
    plain, calls = _study(tmp_path / "plain", **subset)
    assert plain.returncode == 0 and "seed=" not in calls[0]


def test_sampling_rate_summary_adds_roadmap_and_recall_at_k_only_when_asked(tmp_path):
    """Issue 33's losses have labels in the study but are not in its default list: the default
    summary is the 210-run study's, `--losses` adds their rows."""
    summary = _script("summarize_sampling_rate")
    out = tmp_path / "study"
    for loss, value in {"roadmap": 0.61, "recall_at_k": 0.58, "soprc": 0.60}.items():
        for seed in range(3):
            _run(out / "pretrained" / "fb_k2" / loss / f"seed{seed}", value)
    assert summary.main([str(out), "--markdown", str(tmp_path / "default.md")]) == 0
    default = (tmp_path / "default.md").read_text()
    assert "ROADMAP" not in default and "Recall@k" not in default
    assert "Unfinished runs: 207 of 210." in default
    args = ["--starts", "pretrained", "--cells", "fb_k2", "fb_k8"]
    args += ["--losses", "soprc", "roadmap", "recall_at_k", "--markdown", str(tmp_path / "t.md")]
    assert summary.main([str(out), *args]) == 0
    text = (tmp_path / "t.md").read_text()
    rows = {line.split(" | ")[0]: line for line in text.split("fixed 16 classes")[0].splitlines()}
    assert rows["| ROADMAP"].startswith("| ROADMAP | 61.00 ± 0.00 | not run | — |")
    assert rows["| Recall@k surrogate"].startswith("| Recall@k surrogate | 58.00 ± 0.00 |")
    # 2 cells x 3 losses x 3 seeds
    assert "Unfinished runs: 9 of 18." in text


def test_pretrained_table_has_rows_for_roadmap_and_recall_at_k(tmp_path):
    table = _script("pretrained_table")
    bench = tmp_path / "surrogates"
    for seed in range(3):
        _run(bench / "roadmap" / f"seed{seed}", 0.7)
        _run(bench / "recall_at_k" / f"seed{seed}", 0.65)
    text, missing = table.table(None, [bench])
    rows = {line.split(" | ")[0]: line for line in text.splitlines()}
    assert rows["| ROADMAP"].startswith("| ROADMAP | 70.00 ± 0.00")
    assert rows["| Recall@k surrogate"].startswith("| Recall@k surrogate | 65.00 ± 0.00")
    assert not any(m.startswith(("roadmap", "recall_at_k")) for m in missing)


def test_study_driver_runs_roadmap_and_recall_at_k_when_listed(tmp_path):
    subset = {"SEEDS": "0", "STARTS": "pretrained", "CELLS_RUN": "fb_k8"}
    result, calls = _study(tmp_path, LOSSES_RUN="roadmap recall_at_k", **subset)
    assert result.returncode == 0, result.stderr
    _, roadmap, recall = calls
    assert "loss.name=roadmap" in roadmap and "loss.name=recall_at_k" in recall
    assert "sampler.m=8 sampler.batch_size=64" in recall and "model.pretrained=" in recall


def test_study_driver_and_summary_know_recall_at_k_with_detached_positive_ranks(tmp_path):
    """Issue 38: the label recall_at_k_detach runs the Recall@k surrogate with
    detach_positive_ranks=true and gets its own row beside the faithful default."""
    subset = {"SEEDS": "0", "STARTS": "pretrained", "CELLS_RUN": "fb_k8"}
    result, calls = _study(tmp_path, LOSSES_RUN="recall_at_k recall_at_k_detach", **subset)
    assert result.returncode == 0, result.stderr
    _, faithful, detached = calls
    assert "detach_positive_ranks" not in faithful
    assert "loss.name=recall_at_k loss.params.detach_positive_ranks=true" in detached
    summary = _script("summarize_sampling_rate")
    out = tmp_path / "study"
    for loss, value in {"recall_at_k": 0.58, "recall_at_k_detach": 0.66}.items():
        for seed in range(3):
            _run(out / "pretrained" / "fb_k8" / loss / f"seed{seed}", value)
    args = ["--starts", "pretrained", "--cells", "fb_k2", "fb_k8"]
    args += ["--losses", "recall_at_k", "recall_at_k_detach", "--markdown", str(tmp_path / "t.md")]
    assert summary.main([str(out), *args]) == 0
    rows = [line for line in (tmp_path / "t.md").read_text().splitlines() if "Recall@k" in line]
    assert rows[0].startswith("| Recall@k surrogate | — | not run | 58.00 ± 0.00 |")
    expected = "| Recall@k surrogate, `detach_positive_ranks=true` | — | not run | 66.00 ± 0.00 |"
    assert rows[1].startswith(expected)


# A stand-in for `rankwise bench`: records the call; a sweep it starts gets its sweep.json.
FAKE_BENCH = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
while [ $# -gt 0 ]; do [ "$1" = -o ] && mkdir -p "$2" && touch "$2/sweep.json"; shift; done
"""


def test_pretrained_bench_runs_the_surrogate_sweeps_and_resumes_a_started_one(tmp_path):
    fake = tmp_path / "rankwise"
    fake.write_text(FAKE_BENCH)
    fake.chmod(0o755)
    study, out, calls = tmp_path / "study", tmp_path / "bench", tmp_path / "calls.txt"
    (study / "pretraining").mkdir(parents=True)
    (study / "pretraining" / "pretrained.pt").touch()
    inherited = {k: v for k, v in os.environ.items() if k not in ("SWEEPS", "BACKBONE_LR_MULT")}

    def run(**env: str) -> list[str]:
        calls.write_text("")
        full = {**inherited, "RANKWISE": str(fake), "CALLS": str(calls), **env}
        script = STUDIES / "pretrained_bench.sh"
        done = subprocess.run(
            ["bash", str(script), str(study), str(out)],
            cwd=STUDIES.parents[1],
            env=full,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return calls.read_text().splitlines()

    roadmap, recall = run(SWEEPS="roadmap recall_at_k")
    assert roadmap.startswith(f"bench -d fashion-mnist-instances --seeds 3 -o {out}/roadmap ")
    assert "--losses roadmap " in roadmap and "k_temperature" not in roadmap
    # the paper's tau1 from the pretrained start, over the config's from-scratch override
    assert "--losses recall_at_k loss.params.k_temperature=1.0 " in recall
    for call in (roadmap, recall):
        assert f"model.pretrained={study}/pretraining" in call and "budget.iterations=800" in call
    # all four sweeps: the started ones are resumed, the two others start
    xbm, others, *resumed = run()
    assert "--losses xbm loss.params.start_iteration=400" in xbm
    assert "--losses triplet,multi_similarity,dir,blackbox_ap,auc" in others
    assert resumed == [f"bench --resume {out}/roadmap", f"bench --resume {out}/recall_at_k"]


def test_sampling_rate_study_resumes_an_interrupted_pretraining(tmp_path):
    subset = {"SEEDS": "0", "STARTS": "pretrained", "CELLS_RUN": "fb_k2", "LOSSES_RUN": "ap"}
    # what an interrupted `rankwise pretrain` leaves: a checkpoint and no pretrained.pt
    (tmp_path / "out" / "pretraining" / "checkpoints").mkdir(parents=True)
    (tmp_path / "out" / "pretraining" / "checkpoints" / "last.pt").touch()
    result, calls = _study(tmp_path, **subset)
    assert result.returncode == 0, result.stderr
    resume, train = calls
    assert resume.startswith("pretrain --resume ") and resume.endswith("out/pretraining")
    assert train.startswith("train ")
    assert (tmp_path / "out" / "pretraining" / "pretrained.pt").is_file()


def test_positive_share_of_each_cell():
    summary = _script("summarize_sampling_rate")
    # 1 of 63 partners at K = 2 in a batch of 64; 7 of 127 at K = 8 in a batch of 128
    assert summary.positive_share("fb_k2") == 1 / 63
    assert summary.positive_share("fc_k8") == 7 / 127
    text = summary.tables(Path("nowhere"), starts=("pretrained",))
    assert "K = 2: 3.2 %, K = 4: 4.8 %, K = 8: 5.5 %" in text  # fixed 16 classes
    assert "K = 2: 1.6 %, K = 4: 4.8 %, K = 8: 11.1 %" in text  # fixed batch of 64


def test_pretraining_variance_over_study_folders(tmp_path, capsys):
    summary = _script("summarize_sampling_rate")
    outs = [tmp_path / f"pre{i}" for i in range(3)]
    values = {  # (loss, pretraining) -> (K = 2, K = 8)
        "soprc": ((0.80, 0.66), (0.82, 0.70), (0.81, 0.71)),
        "ap": ((0.81, 0.70), (0.83, 0.72), (0.80, 0.69)),
    }
    for loss, by_pretraining in values.items():
        for out, (k2, k8) in zip(outs, by_pretraining, strict=True):
            _run(out / "pretrained" / "fb_k2" / loss / "seed0", k2)
            _run(out / "pretrained" / "fb_k8" / loss / "seed0", k8)
    # a fine-tuning seed other than the one asked for is not read
    _run(outs[2] / "pretrained" / "fb_k2" / "smooth_ap" / "seed1", 0.9)
    args = [str(outs[0]), "--pretrainings", *map(str, outs[1:]), "--losses", "soprc", "ap"]
    assert summary.main([*args, "--markdown", str(tmp_path / "v.md")]) == 0
    text = (tmp_path / "v.md").read_text()
    lines = text.splitlines()
    assert (
        "| SOPRC (defaults) | K = 2, batch 64, 1.6 % | 80.00 | 82.00 | 81.00 | 81.00 ± 1.00 |"
        in lines
    )
    # drops 14 / 12 / 10 (SOPRC) against 11 / 11 / 11 (AP): SOPRC drops most under two of three
    assert "| SOPRC (defaults) | 14.00 | 12.00 | 10.00 | 12.00 ± 2.00 |" in lines
    assert "| *largest drop* | SOPRC (defaults) | SOPRC (defaults) | AP loss (biased) | |" in lines
    assert "Missing runs: 0 of 12." in text
    # the default losses of this mode are the claim's three: Smooth-AP's six runs are missing
    assert summary.main([str(outs[0]), "--pretrainings", *map(str, outs[1:])]) == 0
    assert "Missing runs: 6 of 18." in capsys.readouterr().out
    assert summary.main([str(outs[0]), "--pretrainings", str(tmp_path / "nowhere")]) == 2


def test_memory_table_pairs_seeds_and_lists_unfinished_runs(tmp_path):
    table = _script("memory_table")
    for seed, (plain, memory) in enumerate([(0.60, 0.62), (0.58, 0.57), (0.62, 0.66)]):
        _run(tmp_path / f"ap_plain_s{seed}", plain)
        _run(tmp_path / f"ap_mem_s{seed}", memory, best_step=640 if seed == 2 else 800)
    _run(tmp_path / "soprc_plain_s0", 0.5, status="interrupted")
    assert table.main([str(tmp_path), "--markdown", str(tmp_path / "t.md")]) == 0
    lines = (tmp_path / "t.md").read_text().splitlines()
    memory_row = next(line for line in lines if line.startswith("| AP loss + memory"))
    # 61.67 ± 4.51 over seeds; per seed +2, −1, +4 points; validation rose 10 points late
    assert memory_row.startswith("| AP loss + memory 256 (from step 800) | 61.67 ± 4.51 |")
    assert "| +2.00, -1.00, +4.00 | 800 / 800 / 640 of 800 | +10.00, +10.00, +10.00 |" in memory_row
    assert "Missing or unfinished runs: 6" in "\n".join(lines)
    assert table.main([str(tmp_path / "nowhere")]) == 2
