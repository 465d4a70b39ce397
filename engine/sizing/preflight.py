"""Lower the engine's step programs for a TPU on a machine without one (`pagefleet check`).

Every program the runner compiles is traced with abstract arguments (`jax.ShapeDtypeStruct`: shapes,
dtypes and shardings, no weights) on a `jax.sharding.AbstractMesh` of the slice's devices, whose
abstract device names the TPU generation, and lowered with `lowering_platforms=("tpu",)`: the model,
the Pallas ragged paged attention kernel (through Mosaic), and the sampler, at every shape bucket the
runner pads steps to. Lowering is what fails for a shape the kernel or a sharding cannot take; XLA's
TPU compile (which needs the chip) is not run, so memory comes from estimates (`engine.kernels.pallas_blocks`
for VMEM, `orchestrator/plan/size.py` for HBM).

The runner's programs and bucket rules are read in one place, `_runner_programs`, so a change of the
runner's interface changes this function only.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AbstractDevice, AbstractMesh, NamedSharding, PartitionSpec as P

from engine.sizing.capacity import pages_for
from engine.config import EngineConfig, SamplingConfig
from engine.device import runner
from engine.device.runner_config import RunnerConfig
from engine.kv.kv_groups import KVGroups
from engine.models.model import StepSettings, kv_pool_axes
from engine.models.model_config import ModelConfig
from engine.kernels.pallas_blocks import KernelBlocks, kernel_blocks
from engine.models.tensor_parallel import sharded_config
from engine.models.weights import abstract_transformer, partition_spec


@dataclass(frozen=True)
class Target:
    """A TPU generation as JAX names it: what the Pallas kernel and Mosaic ask the device while lowering."""

    device: AbstractDevice
    """JAX's device kind and TensorCores per device (v5p runs as a megacore: one device, two cores)."""
    chip: pltpu.ChipVersion

    @property
    def vmem_bytes_per_core(self) -> int:
        """VMEM of one TensorCore (JAX's own table, the one Mosaic uses); a kernel grid step runs on one core."""
        return pltpu.get_tpu_info_for_chip(self.chip, self.device.num_cores).vmem_capacity_bytes


# Device kinds as JAX reports them on each chip ("TPU v5" is a v5p, the "lite" chips are v5e and v6e).
TARGETS: dict[str, Target] = {
    "v5p": Target(AbstractDevice("TPU v5", 2, "tpu"), pltpu.ChipVersion.TPU_V5P),
    "v6e": Target(AbstractDevice("TPU v6 lite", 1, "tpu"), pltpu.ChipVersion.TPU_V6E),
    "v5e": Target(AbstractDevice("TPU v5 lite", 1, "tpu"), pltpu.ChipVersion.TPU_V5E),
}


@dataclass(frozen=True)
class Program:
    """One step program lowered at one shape bucket."""

    name: str
    """The runner's program: `step` (forward and sample, prompt chunks), `decode` (the same, one token a row),
    `multi_step` (decode steps looped on the device), `chain` (a multi-step call's inputs from the previous one)."""
    tokens: int
    """Query tokens per step (T bucket)."""
    seqs: int
    """Sequence rows (S bucket)."""
    lower_s: float
    """Seconds to trace and lower."""
    kernel: KernelBlocks | None
    """The Pallas kernel's blocking in this program (None: no kernel, or not lowering for TPU)."""
    mosaic_calls: int
    """Mosaic kernels (`tpu_custom_call`) in the lowered module: the Pallas kernel once per scanned layer body."""


class LoweringFailed(ValueError):
    """A step program does not lower for the target; the message names the program and its shapes."""


def abstract_mesh(devices: int, model: int, target: Target | None) -> AbstractMesh:
    """A ("data", "model") mesh of `devices` devices, tensor parallel over `model` of them."""
    return AbstractMesh((devices // model, model), ("data", "model"),
                        abstract_device=None if target is None else target.device)


def lower_step_programs(cfg: ModelConfig, engine: EngineConfig, max_seq_len: int, dtype: str, sampling_mode: str,
                        num_stop_ids: int, mesh: AbstractMesh, platform: str,
                        on_program: Callable[[Program], None] | None = None) -> list[Program]:
    """Trace and lower every step program of an engine with these configs for `platform` ("tpu" or "cpu").

    `sampling_mode` is the runner's (`greedy`, `sample` or `truncate`); `num_stop_ids` the EOS ids a
    multi-step call checks. Raises `LoweringFailed` at the first program that does not lower.
    """
    jdtype = jnp.dtype(dtype)
    impl = "pallas_tpu" if platform == "tpu" else "reference"
    cfg = sharded_config(cfg, mesh.shape["model"])  # the KV heads as the engine holds them (replicated past kv_heads)
    model = abstract_transformer(cfg, jdtype, mesh)
    groups = KVGroups.for_engine(cfg.layer_windows(), engine.kv_groups, engine.host_kv_pages)  # as the engine runs
    run_config = RunnerConfig.of(engine, groups)
    pool_axes = kv_pool_axes(cfg, groups.units(engine.max_pages), engine.page_size, groups.layers_per_unit)
    pool = hax.NamedArray(jax.ShapeDtypeStruct(tuple(a.size for a in pool_axes), jdtype,
                                          sharding=NamedSharding(mesh, partition_spec(pool_axes, mesh))), pool_axes)
    replicated = NamedSharding(mesh, P())

    def arg(shape: tuple[int, ...], kind) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(kind), sharding=replicated)

    settings = runner.step_settings(run_config, groups, impl, mesh, platform)
    tp = mesh.shape["model"]
    programs = []
    for name, tokens, seqs, fn, args in _runner_programs(engine, max_seq_len, sampling_mode, num_stop_ids,
                                                                 model, pool, settings, arg):
        started = time.perf_counter()
        try:
            with jax.sharding.use_abstract_mesh(mesh):
                text = fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()
        except Exception as e:  # noqa: BLE001 - any lowering error is the answer, reported with the shapes
            raise LoweringFailed(f"the {name} program (T={tokens} tokens, S={seqs} sequences) does not lower for "
                                 f"{platform}: {_describe(e)}") from e
        kernel = None
        if impl == "pallas_tpu" and name != "chain":  # chain only moves the rows' counters
            q_shape = (tokens, cfg.num_heads // tp, cfg.head_dim)
            kv_shape = (cfg.num_layers * engine.max_pages, engine.page_size, 2 * cfg.num_kv_heads // tp, cfg.head_dim)
            kernel = kernel_blocks(q_shape, jdtype, kv_shape, jdtype, pages_for(max_seq_len, engine.page_size),
                                   mesh.abstract_device.device_kind)
        program = Program(name, tokens, seqs, time.perf_counter() - started, kernel, text.count("tpu_custom_call"))
        programs.append(program)
        if on_program is not None:
            on_program(program)
    return programs


def _describe(e: BaseException) -> str:
    """An exception in one line; an assertion without a message is named by the line that failed."""
    message = str(e).splitlines()[0] if str(e) else ""
    if not message and e.__traceback__ is not None:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        message = f"{frame.filename.rsplit('site-packages/', 1)[-1]}:{frame.lineno}: {frame.line}"
    return f"{type(e).__name__}: {message}"


def sampling_mode(sampling: SamplingConfig, vocab_size: int) -> str:
    """The runner's sampling mode for a job whose every row samples as `sampling` says."""
    row = runner.RowSampling(sampling.draw_temperature, sampling.top_k, sampling.top_p, np.zeros(2, np.uint32), 0,
                             sampling.min_p, sampling.repetition_penalty, sampling.presence_penalty,
                             sampling.frequency_penalty, min_tokens_end=sampling.min_tokens)
    return runner._sampling_mode([row], vocab_size)


def _runner_programs(engine: EngineConfig, max_seq_len: int, mode: str, num_stop_ids: int, model, pool,
                     settings: StepSettings, arg) -> Iterator[tuple]:
    """(name, T, S, jitted program, abstract args) of every program the runner compiles for this engine.

    The one place that knows the runner's programs, their argument lists and its bucket rules (`bucket`,
    `decode_bucket`, steps with prompt chunks at the max_seqs bucket): keep it in step with engine/device/runner.py and
    engine/device/multi_step.py.
    """
    from engine.device import multi_step, runner
    pages = pages_for(max_seq_len, engine.page_size)
    rows = runner.bucket(engine.max_seqs, runner.MIN_SEQ_BUCKET)
    decode = sorted({runner.ModelRunner.decode_bucket(SimpleNamespace(config=engine), n)
                     for n in range(1, engine.max_seqs + 1)})
    token_buckets = sorted({runner.bucket(n, runner.MIN_TOKEN_BUCKET) for n in range(1, engine.max_prefill_size + 1)})
    i32, f32 = jnp.int32, jnp.float32

    G = settings.num_groups

    def inputs(T: int, S: int):
        return runner.StepInputs(arg((T,), i32), arg((T,), i32), arg((G, T), i32), arg((S + 1,), i32),
                                 arg((S,), i32), arg((G, S, pages), i32), arg((1,), i32), arg((S,), i32),
                                 arg((T,), jnp.bool_))

    def sampling(S: int) -> tuple:
        return arg((S,), f32), arg((S,), i32), arg((S,), f32), arg((S,), f32), arg((S, 2), jnp.uint32)

    def penalties(S: int) -> tuple | None:  # ModelRunner._penalties' arrays, for a mode that penalizes
        V = model.config.vocab_size
        return ((arg((S, V), jnp.bool_), arg((S, V), i32), arg((S,), f32), arg((S,), f32), arg((S,), f32))
                if "+penalties" in mode else None)

    stops = runner.bucket(num_stop_ids, 4)

    def min_tokens(S: int) -> tuple | None:  # device_calls.min_tokens_arrays', for a mode that holds stop ids back
        return (arg((S, stops), i32), arg((S,), i32)) if "+min_tokens" in mode else None

    for T in token_buckets:  # steps that carry prompt chunks: max_seqs rows, T varies
        yield ("step", T, rows, runner._step_sample,
               (model, pool, inputs(T, rows), settings, mode, *sampling(rows),
                arg((rows,), i32), penalties(rows), min_tokens(rows)))
    for S in decode:  # decode-only steps: one token a row
        yield "decode", S, S, runner._step_sample, (model, pool, inputs(S, S), settings, mode, *sampling(S),
                                                  arg((S,), i32), penalties(S), min_tokens(S))
    if engine.decode_steps > 1:
        K = engine.decode_steps
        for S in decode:
            per_row = tuple(arg((S,), i32) for _ in range(4))
            yield ("multi_step", S, S, multi_step._steps_sample,
                   (model, pool, settings, K, mode, *per_row[:3], arg((G, S, pages), i32), arg((1,), i32),
                    *sampling(S), arg((S, stops), i32), penalties(S), min_tokens(S)))
            if engine.pipeline_decode:
                yield ("chain", S, S, multi_step._chain,
                       (arg((K, S), i32), *per_row, arg((S,), i32), arg((S,), jnp.bool_), arg((S, stops), i32), K))

