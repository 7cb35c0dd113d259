"""rankwise.similarity_learning: similarities learned for pointwise ROC optimization.

Vogel, Bellet & Clémençon, ICML 2018, as scikit-learn estimators: :class:`BilinearSimilarity`
(problem (6), closed form of Sec. 5.1) and :class:`MMC` (Xing et al. 2002 in the form of Sec.
5.3), with their training pairs (complete or incomplete U-statistics, Sec. 4). scikit-learn is not
a core dependency: without it, importing this package raises
:class:`~rankwise._extras.MissingDependencyError` naming ``pip install 'rankwise[train]'``.
"""

from .._extras import require

require(("sklearn",), "train", "rankwise.similarity_learning (BilinearSimilarity, MMC)")

from .bilinear import BilinearSimilarity  # noqa: E402 - after the check of the extra
from .mmc import MMC  # noqa: E402

__all__ = ["BilinearSimilarity", "MMC"]
