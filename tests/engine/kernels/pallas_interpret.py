"""Run JAX's Pallas ragged paged attention kernel on CPU, in TPU interpret mode (tests only).

`pltpu.force_tpu_interpret_mode()` alone fails on this kernel under JAX 0.10.2 with
`AttributeError: 'ReshapeTransform' object has no attribute 'indices'`: the interpreter reads a ref through
its list of transforms and handles indexers only (`interpret/utils.py: to_range` reads `transform.indices`),
while the kernel reads each KV block through a reshaped VMEM ref (`async_copy.wait().reshape(...)` in
`ragged_paged_attention/kernel.py`). With that fixed, the next failure is the interpreter's masked store
(`pltpu.store(..., mask=...)`, the kernel's `masked_store` of its softmax state): `shared_memory.py:
swap_buffer_content` marks positions out of bounds with `in_bounds_mask[in_bounds_shape[i]:] = False` for
every dimension i, which always slices the first dimension, so an in-bounds store of a (8, 2, 128) block is
refused as "Out-of-bounds masked swap".

`tpu_interpret()` patches two interpreter callbacks while it is active, and nothing else (DMAs, semaphores,
the grid, unmasked loads and stores are JAX's):
- `get`: a read through a reshape reads what the transforms before the reshape select (the interpreter's own
  `get`), reshapes that value, and applies the indexers after it with the interpreter's own `to_range`;
- `swap` with a mask: read the target range (own `get`), write `where(mask, new, old)` with an unmasked swap
  (own `swap`), return `where(mask, old, new)`: what a masked swap returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import numpy as np
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
from jax._src.pallas.mosaic.interpret import utils as interpret_utils
from jax._src.state.types import ReshapeTransform
from jax.experimental.pallas import tpu as pltpu


@contextlib.contextmanager
def tpu_interpret() -> Iterator[None]:
    """Pallas TPU kernels traced inside run in JAX's TPU interpreter, reads through reshaped refs included."""
    original = tpu_interpreter.get

    def through_reshapes(read):
        def get(token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kwargs):
            transforms = tuple(transforms)
            reshapes = [i for i, t in enumerate(transforms) if isinstance(t, ReshapeTransform)]
            if not reshapes:
                return read(token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kwargs)
            at = reshapes[-1]
            token, value = get(token, device_id, local_core_id, memory_space, buffer_id, transforms[:at], *args,
                               **kwargs)
            value = np.asarray(value).reshape(transforms[at].shape)
            after = jax.tree.map(int, transforms[at + 1:])
            return token, (value[interpret_utils.to_range(after)] if after else value)
        return get

    get = through_reshapes(original)
    get.__wrapped__ = through_reshapes(original.__wrapped__)  # DMAs read through the undecorated function
    original_swap = tpu_interpreter.swap

    def swap(token, device_id, local_core_id, memory_space, buffer_id, transforms, val, mask, **kwargs):
        if mask is None:
            return original_swap(token, device_id, local_core_id, memory_space, buffer_id, transforms, val, None,
                                 **kwargs)
        mask, val = np.asarray(mask), np.asarray(val)
        token, old = get(token, device_id, local_core_id, memory_space, buffer_id, transforms, **kwargs)
        token, _ = original_swap(token, device_id, local_core_id, memory_space, buffer_id, transforms,
                                 np.where(mask, val, old), None, **kwargs)
        return token, np.where(mask, old, val)

    tpu_interpreter.get, tpu_interpreter.swap = get, swap
    try:
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
            yield
    finally:
        tpu_interpreter.get, tpu_interpreter.swap = original, original_swap
