"""The experts' load as a picture: the tokens each expert of each MoE layer received in one step, drawn as a heatmap
image for tensorboard's Images tab (tag `IMAGE_TAG`, one image per logging step).

One row per MoE layer (labelled with its layer id), one column per expert; a cell's colour is the expert's tokens
over its layer's mean, on a fixed scale (`SCALE_MAX`): blue 0 (no token), white 1 (the balanced share), red 2 or
more. With expert parallelism, dark lines part the experts of each EP rank: the reddest group is the rank that
receives the most rows, the one whose memory the planner's `--routing-skew` sizes. A legend under the cells shows the
scale. Drawn with numpy and Pillow (a dependency of tensorboard); the model hands the counts as 1-D device tensors
named `moe/layer_<i>/tokens_per_expert` (`ROW_TAG`), which the loop reads in its one transfer of a logging step.
"""

from __future__ import annotations

import re

import numpy as np
from PIL import Image, ImageDraw, ImageFont

__all__ = ["IMAGE_TAG", "ROW_TAG", "SCALE_MAX", "colours", "expert_load_image", "rows_of"]

IMAGE_TAG = "moe/tokens_per_expert"
"""The image's tag in the run folder."""
ROW_TAG = re.compile(r"^moe/layer_(\d+)/tokens_per_expert$")
"""The tag of one layer's row among a step's values (the model's `post_optimizer_step`)."""
SCALE_MAX = 2.0
"""Tokens over the layer's mean at which a cell is full red (and beyond)."""
_BLUE, _WHITE, _RED = np.array([33, 102, 172.0]), np.array([247, 247, 247.0]), np.array([178, 24, 43.0])
_SEPARATOR = np.array([40, 40, 40], dtype=np.uint8)
_INK = (20, 20, 20)
_PAPER = (255, 255, 255)


def rows_of(values: dict) -> dict[int, list[float]]:
    """Layer id -> tokens per expert, for the values of `values` tagged `ROW_TAG`, in layer order."""
    rows = {int(m.group(1)): v for tag, v in values.items() if (m := ROW_TAG.match(tag))}
    return dict(sorted(rows.items()))


def colours(load: np.ndarray) -> np.ndarray:
    """RGB (uint8, one more trailing axis) of loads relative to the mean: blue at 0, white at 1, red at
    `SCALE_MAX` and beyond."""
    t = np.clip(load, 0.0, SCALE_MAX)[..., None]
    low = _BLUE + (_WHITE - _BLUE) * t  # 0..1
    high = _WHITE + (_RED - _WHITE) * (t - 1.0) / (SCALE_MAX - 1.0)  # 1..SCALE_MAX
    return np.rint(np.where(t <= 1.0, low, high)).astype(np.uint8)


def expert_load_image(rows: dict[int, list[float]], ep: int = 1) -> np.ndarray:
    """The heatmap of `rows` (layer id -> tokens per expert; the same number of experts in each), with the experts
    of each of `ep` EP ranks parted by lines; an RGB uint8 array, height x width x 3."""
    layers = list(rows)
    counts = np.asarray([rows[layer] for layer in layers], dtype=np.float64)
    n_layers, n_experts = counts.shape
    mean = counts.mean(axis=1, keepdims=True)
    load = np.divide(counts, mean, out=np.zeros_like(counts), where=mean > 0)
    # cells large enough to see at any size (8 experts: 32 px; 256 experts: 3 px), the picture about 640 px wide
    cell_w, cell_h = int(np.clip(640 // n_experts, 3, 32)), int(np.clip(320 // n_layers, 4, 24))
    cells = np.repeat(np.repeat(colours(load), cell_h, axis=0), cell_w, axis=1)
    if ep > 1 and n_experts % ep == 0:
        for group in range(1, ep):
            cells[:, group * (n_experts // ep) * cell_w - 1] = _SEPARATOR
    font = ImageFont.load_default()
    margin = 8 + max(int(font.getlength(f"layer {layer}")) for layer in layers)
    legend_h = 34
    height, width = cells.shape[0] + legend_h + 4, margin + max(cells.shape[1], 220) + 4
    canvas = np.full((height, width, 3), 255, dtype=np.uint8)
    canvas[2:2 + cells.shape[0], margin:margin + cells.shape[1]] = cells
    # the legend: the colour scale from 0 to SCALE_MAX
    bar_y, bar_w = cells.shape[0] + 8, 200
    canvas[bar_y:bar_y + 8, margin:margin + bar_w] = colours(np.linspace(0, SCALE_MAX, bar_w))[None]
    image = Image.fromarray(canvas)
    draw = ImageDraw.Draw(image)
    for i, layer in enumerate(layers):
        if cell_h >= 10 or i % max(1, 12 // cell_h) == 0:  # a label per row while they fit, else every few rows
            draw.text((2, 2 + i * cell_h + max(cell_h - 11, 0) // 2), f"layer {layer}", fill=_INK, font=font)
    for value, text in ((0.0, "0"), (1.0, "1 = mean"), (SCALE_MAX, f"{SCALE_MAX:g}+")):
        x = margin + int(value / SCALE_MAX * (bar_w - 1))
        draw.line([(x, bar_y + 8), (x, bar_y + 11)], fill=_INK)
        draw.text((min(x, margin + bar_w - 6 * len(text)), bar_y + 12), text, fill=_INK, font=font)
    return np.asarray(image)
