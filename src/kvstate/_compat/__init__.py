"""Every contact with transformers internals (and with torch's private ops) lives in this package.

``versions`` holds the tested window (checked on ``import kvstate``), ``core`` the cache and
model-side helpers, ``generation`` the seams of ``generate``, ``own_cache`` the models with a cache class of their own,
``scan`` the Mamba selective scan, ``watch`` the attention listener that compression scores with,
``attention`` the attention path of kvstate's forwards and the one rule that picks each call's kernel, ``appends``
where a decode's K/V appends land in a cache layer, ``onednn`` torch's private oneDNN linear ops. Import a name
from its module (``from kvstate._compat.core import layer_specs``): this package imports nothing itself, so
``import kvstate`` runs the version gate before torch or transformers load.
"""
