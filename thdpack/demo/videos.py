"""Small generated videos for tests, benchmarks and demos (needs PyAV: ``pip install thdpack[video]``)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np


def write_video(path, frames: int, fps, h: int, w: int, seed: int | np.random.Generator = 0) -> None:
    """Write an MPEG-4 file of ``frames`` random RGB frames of ``h x w`` pixels at ``fps``.

    ``seed``: an int, or a ``numpy`` Generator to draw the frames from (advanced by the call).
    A file with zero frames still gets its header.
    """
    import av

    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        out.start_encoding()  # the header, even with no frame
        for _ in range(frames):
            img = (rng.random((h, w, 3)) * 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
