"""training_curves.png is read correctly (issue 14, item 19): the selected step is marked, and a
wobble of a few thousandths in validation mAP does not fill the axis as if it were a trend."""

from __future__ import annotations

from rankwise.training.curves import MIN_MAP_SPAN, plot_training_curves, training_figure

RECORDS = [
    *({"kind": "train", "step": s, "loss": 0.30 - 0.001 * (s % 3)} for s in range(10, 110, 10)),
    *({"kind": "val", "step": s, "map": 0.801 + 0.002 * (s % 40 == 0)} for s in range(20, 120, 20)),
]


def test_the_selected_step_is_marked_and_noise_is_not_stretched(tmp_path):
    fig = training_figure(RECORDS, "auc", selected_step=40)
    ax_loss, ax_map = fig.axes[:2]
    low, high = ax_map.get_ylim()
    assert high - low >= MIN_MAP_SPAN - 1e-12 and 0.0 <= low < 0.801 < 0.803 < high <= 1.0
    loss_low, loss_high = ax_loss.get_ylim()
    assert loss_high - loss_low >= 0.03 - 1e-12  # 10 % of the largest loss, not 0.002
    for ax in (ax_loss, ax_map):
        assert any(list(line.get_xdata()) == [40, 40] for line in ax.get_lines())
    labels = [t.get_text() for t in ax_map.get_legend().get_texts()]
    assert labels == ["selected: step 40, val mAP 0.8030"]
    assert plot_training_curves(RECORDS, tmp_path / "c.png", selected_step=40).stat().st_size


def test_the_map_axis_stays_within_zero_and_one():
    near_one = [{"kind": "val", "step": s, "map": 0.999} for s in (1, 2)]
    low, high = training_figure(near_one).axes[1].get_ylim()
    assert high == 1.0 and abs(high - low - MIN_MAP_SPAN) < 1e-12
