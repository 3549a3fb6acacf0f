"""One exception hierarchy for everything kvstate raises on purpose.

Two tiers, as in STYLE.md: caller mistakes (``KVStateError`` subclasses that show
what was expected, what was found and the fix) and unsupported combinations
(``UnsupportedError``), which name the model or feature.
"""

from __future__ import annotations


class KVStateError(Exception):
    """Base class of every error kvstate raises on purpose."""

    def __init__(self, message: str, *, expected: object = None, found: object = None,
                 fix: str | None = None) -> None:
        parts = [message]
        if expected is not None:
            parts.append(f"expected: {expected}")
        if found is not None:
            parts.append(f"found: {found}")
        if fix:
            parts.append(f"fix: {fix}")
        super().__init__("; ".join(parts))
        self.message = message  # the rule broken, without the details
        self.expected = expected
        self.found = found
        self.fix = fix


class InputError(KVStateError, ValueError):
    """Malformed user input: wrong rank, dtype or shape of ``input_ids`` and friends."""


class GenerationOptionError(InputError):
    """A generation option that cannot run: one transformers refuses when ``generate`` starts (a NaN
    temperature, ``stop_strings`` without ``tokenizer=``), or stop strings past kvstate's bounds. Raised before
    any forward; the state is unchanged."""


class MaskError(InputError):
    """The attention mask does not cover processed + new tokens, or contradicts the state."""


class PositionError(InputError):
    """Explicit positions do not continue the state's logical next position."""


class EmptyStateError(PositionError):
    """A continuation at position > 0 was asked of a state that holds nothing (seed 002)."""


class PlaceholderError(InputError):
    """Media placeholder ids outside every item a processor laid out (a model generated them), in a call
    that passes that kind's pixels: transformers would count them as media tokens."""


class BatchMismatchError(InputError):
    """The input's batch size differs from the state's."""


class DeviceMismatchError(InputError):
    """State tensors live on another device than the model."""


class DeviceUnavailableError(InputError):
    """A model was asked for on a device this machine does not have (``--device cuda`` without CUDA)."""


class DtypeMismatchError(InputError):
    """State tensors have another dtype than the model's K/V."""


class FingerprintMismatchError(KVStateError):
    """The state was produced by a different model (weights, config or dtype)."""


class RollbackError(KVStateError):
    """A rollback asked for tokens that a layer no longer retains."""


class UnsupportedError(KVStateError, NotImplementedError):
    """The model family or feature has no kvstate support; the message names it."""


class UnsupportedModelError(UnsupportedError):
    """No adapter is registered for this ``model_type``."""


class DefaultModelError(KVStateError):
    """An embedded model (the default Gemma-3-270M, or SmolLM2-135M) could not be located or loaded."""


class StateFileError(KVStateError):
    """A state file is truncated, corrupted, of another format version, or malformed."""


class LayoutMismatchError(KVStateError):
    """The state's layers (count, kinds, heads, head dim) do not fit the model."""


class StoreError(KVStateError):
    """A prefix store cannot be created: the path or URL is unusable."""


class StoreWarning(UserWarning):
    """A prefix store failed; the call went on without it (a store is a cache, never the answer)."""


class TransformersVersionError(KVStateError, ImportError):
    """The installed transformers is outside the window kvstate is tested with (``import kvstate``)."""


class SaveTargetError(StateFileError):
    """A save path kvstate must not replace (a device, FIFO, socket, folder or dangling symlink),
    or one it cannot write; raised before any work is done."""


class InputFileError(KVStateError):
    """A file to read (a prompt file) is not a regular file, is over the size cap, or cannot be read."""


class AgainstError(KVStateError):
    """``kvstate verify --against`` cannot use a server: a malformed URL, no answer, a refused key or model."""


class ScheduleWarning(UserWarning):
    """The canonical schedule cannot keep its promise here: the attention path is not known to repeat its bits,
    or a state is continued under another schedule than it was fed with (its slots are fed again)."""


class CompressionWarning(UserWarning):
    """A compression ran, but not as asked: e.g. a family whose attention cannot take per-head masks kept the
    same slots in every head (``kvstate.compress``)."""
