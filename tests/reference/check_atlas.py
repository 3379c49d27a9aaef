"""The atlas diffract-dataset rendered: expected names, one non-empty sprite per index row."""
import json
import sys

import numpy as np
from PIL import Image

folder, expected = sys.argv[1], sys.argv[2].split("|")
meta = json.load(open(f"{folder}/atlas.json"))
rows = [line.rstrip("\n").split("\t") for line in open(f"{folder}/index.tsv")][1:]
names = [r[2] for r in rows]
assert sorted(names) == sorted(expected), names
size, cols = meta["sprite_size"], meta["columns"]
sheet = np.asarray(Image.open(f"{folder}/{meta['sheets'][0]}").convert("RGBA"))
assert sheet.shape == (cols * size, cols * size, 4), sheet.shape
for i, name in enumerate(names):
    cell = sheet[(i // cols) * size:(i // cols + 1) * size, (i % cols) * size:(i % cols + 1) * size]
    opaque = (cell[..., 3] > 128).mean()
    assert 0.2 < opaque < 1.0, (name, opaque)  # a glyph, fitted, with a transparent margin
    assert cell[..., :3][cell[..., 3] > 128].std() > 5, name  # colour, not a flat box
print("atlas ok:", ", ".join(names))
