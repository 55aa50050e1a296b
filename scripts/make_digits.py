"""Write gradps/data/digits.npz: scikit-learn's 8x8 handwritten digits (1,797 images, pixels 0-16)
split 80/20, stratified, with seed 0, exactly as `train_test_split` splits them.

The workers load the dataset from that file, without importing scikit-learn (seconds of every
run's start); tests/test_models_datasets.py checks that the file is what this script writes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "gradps" / "data" / "digits.npz"
TEST_FRACTION = 0.2
# Fixed: every process must see the same train/test split.
SPLIT_SEED = 0


def digits_split() -> dict[str, np.ndarray]:
    """The split as the file holds it: uint8 pixels (N, 64) and int64 labels."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    pixels, labels = bunch.data.astype(np.uint8), bunch.target.astype(np.int64)
    train_x, test_x, train_y, test_y = train_test_split(
        pixels, labels, test_size=TEST_FRACTION, stratify=labels, random_state=SPLIT_SEED
    )
    return {"train_x": train_x, "train_y": train_y, "test_x": test_x, "test_y": test_y}


def main() -> None:
    np.savez_compressed(OUT, **digits_split())
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
