"""The committed figures' PNG encoding (dora_num.repro.plotting.png_bytes): the pixels matplotlib rendered,
losslessly, without an alpha channel that carries nothing, and the same bytes every time."""

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from dora_num.repro.plotting import png_bytes  # noqa: E402


def _figure(transparent: bool):
    fig, ax = plt.subplots(figsize=(2, 1.5), dpi=100)
    ax.plot([0, 1, 2], [0, 1, 0.5])
    ax.scatter(np.linspace(0, 2, 50), np.sin(np.linspace(0, 6, 50)), s=3, alpha=0.4)
    if transparent:
        fig.patch.set_alpha(0.0)
        ax.patch.set_alpha(0.0)
    return fig


def _matplotlib_rgba(fig) -> np.ndarray:
    raw = io.BytesIO()
    fig.savefig(raw, format="png", metadata={"Software": None})
    return np.asarray(Image.open(io.BytesIO(raw.getvalue())).convert("RGBA"))


def test_an_opaque_figure_is_stored_as_rgb_with_the_same_pixels():
    fig = _figure(transparent=False)
    ref = _matplotlib_rgba(fig)
    im = Image.open(io.BytesIO(png_bytes(fig)))
    assert im.mode == "RGB"
    assert (ref[..., 3] == 255).all()
    np.testing.assert_array_equal(np.asarray(im), ref[..., :3])
    assert im.info.get("dpi") is not None and round(im.info["dpi"][0]) == 100
    plt.close(fig)


def test_a_transparent_figure_keeps_its_alpha_channel():
    fig = _figure(transparent=True)
    ref = _matplotlib_rgba(fig)
    im = Image.open(io.BytesIO(png_bytes(fig)))
    assert im.mode == "RGBA" and (ref[..., 3] < 255).any()
    np.testing.assert_array_equal(np.asarray(im), ref)
    plt.close(fig)


def test_the_same_figure_gives_the_same_bytes():
    fig = _figure(transparent=False)
    assert png_bytes(fig) == png_bytes(fig)
    plt.close(fig)
