"""examples/finetune_deepseek.py end to end on tiny sizes: converts, fine-tunes in GRAPH mode
with the bias update on, saves, exports, and transformers loads the export and computes our
validation loss."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("transformers")


@pytest.mark.slow  # GRAPH-mode compilation of a training step: about 20 s
def test_finetune_example(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import finetune_deepseek
    finally:
        sys.path.pop(0)
    out = tmp_path / "run"
    result = finetune_deepseek.main(["--steps", "12", "--batch-size", "4", "--seq-len", "32",
                                     "--hidden", "32", "--experts", "4", "--eval-every", "6",
                                     "--out", str(out)])
    (first, before), (_, after) = result["val"][0], result["val"][-1]
    assert first == 0 and after < before - 0.5, result["val"]
    assert abs(result["ours"] - result["transformers"]) < 1e-5 * result["ours"]
    for name in ("loss.png", "finetuned.safetensors", "ms/config.json", "hf/config.json",
                 "hf/model.safetensors"):
        assert (out / name).stat().st_size > 0, name
