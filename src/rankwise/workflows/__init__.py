"""rankwise.workflows: the runs the command line starts, callable from Python, on one engine.

:mod:`~rankwise.workflows.sweep` is the engine (one locked output folder, no lost work); the
protocols on it are :mod:`~rankwise.workflows.bench` (Tables 1 and 2 of Wen et al., NeurIPS
2022), :mod:`~rankwise.workflows.tune` (validation-mAP selection, their App. D.1),
:mod:`~rankwise.workflows.hashing` (TALR and its baselines, He et al., CVPR 2018) and
:mod:`~rankwise.workflows.roc` (pointwise ROC optimization, Vogel et al., ICML 2018). Beside them,
:mod:`~rankwise.workflows.pretrain` makes the pretrained start ``model.pretrained`` loads and
:mod:`~rankwise.workflows.export` exports a trained run for serving (``rankwise export``).
"""
