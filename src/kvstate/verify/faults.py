"""The known bugs ``kvstate verify --inject`` can plant (a light module: the CLI parser imports it)."""

FAULTS = ("corrupt-k", "drop-mask", "refeed-last", "zero-rope-deltas", "shift-positions", "nondeterministic-attention")
