"""Small generated ImageFolder trees for tests (Pillow): ``root/<split>/<class>/<i>.png``.

Class ``k`` is a filled shape in colour ``COLOURS[k]`` (square or disc, random size and position) on a
noisy grey background: learnable by a small network in a few epochs, not by looking at one pixel.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

COLOURS = ((220, 40, 40), (40, 180, 40), (40, 70, 220), (230, 200, 30), (200, 60, 200), (30, 200, 210))


def make_image_folder(
    root: str | Path,
    num_classes: int = 4,
    per_class: dict[str, int] | None = None,
    size: int = 40,
    seed: int = 0,
) -> Path:
    """Write ``per_class[split]`` PNGs per class and split (default train 48, val 16); return ``root``."""
    from PIL import Image, ImageDraw

    if not 1 <= num_classes <= len(COLOURS):
        raise ValueError(f"num_classes must be 1..{len(COLOURS)}")
    root = Path(root)
    rng = np.random.default_rng(seed)
    for split, count in (per_class or {"train": 48, "val": 16}).items():
        for k in range(num_classes):
            folder = root / split / f"class_{k}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                grey = rng.integers(60, 190)
                pixels = np.clip(grey + rng.normal(0, 20, (size, size, 3)), 0, 255).astype(np.uint8)
                img = Image.fromarray(pixels)
                side = int(rng.integers(size // 3, size // 2 + 1))
                x0, y0 = (int(v) for v in rng.integers(0, size - side, 2))
                colour = tuple(
                    int(c) for c in np.clip(np.array(COLOURS[k]) + rng.integers(-25, 26, 3), 0, 255)
                )
                draw = ImageDraw.Draw(img)
                box = (x0, y0, x0 + side, y0 + side)
                (draw.rectangle if rng.random() < 0.5 else draw.ellipse)(box, fill=colour)
                img.save(folder / f"{i}.png")
    return root
