"""The batched forwards: the rows of many conversations in one forward, each with the bits it gets alone.

``decode`` (a step of many streams: ``Packed``, ``Single``), ``prefill`` (chunks in tiled, packed
forwards: ``Tiled``), ``packed`` (the packed forward's cache and per-stream attention), ``pool`` (the
streams' K/V, one buffer a layer), ``invariant`` (matrix products in fixed tiles) and ``kernels`` (the
tiles' products on prepacked weights). Nothing is imported here: ``engine.core`` imports ``prefill``,
and ``decode`` imports ``engine.core``.
"""
