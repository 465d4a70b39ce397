"""`pagefleet generate`'s command line: parse the arguments, then `orchestrator.local.generate` does the work."""

from __future__ import annotations

import argparse

import draccus

from engine import backend_is_cpu_only, start_kernel_build
from orchestrator import exit_codes
from orchestrator.config import KEYS_DOC, ConfigError, config_error
from orchestrator.config_reference import help_text as keys_help
from orchestrator.config_types import check_config_types
from orchestrator.local import generate
from orchestrator.local.generate import GenerateConfig, explicit_engine_keys, run_generate

USAGE = "usage: pagefleet generate --model DIR_URL_OR_HUB_ID --input IN.jsonl --output OUT.jsonl [--section.key=value ...]"


def parse_args(argv: list[str]) -> GenerateConfig:
    """The command line as a GenerateConfig; a bad argument is a one-line ConfigError naming it."""
    check_config_types(GenerateConfig, None, argv)  # `--sampling.stop=[1]` is refused, not read as "1"
    try:
        return draccus.parse(config_class=GenerateConfig, args=argv, prog="pagefleet generate", exit_on_error=False)
    except argparse.ArgumentError as e:
        raise ConfigError(f"{e}; {USAGE} (keys in {KEYS_DOC})") from None
    except Exception as e:  # noqa: BLE001 - draccus' and the components' errors, made one line
        raise config_error(e, None) from None


def help_text() -> str:
    """`pagefleet generate --help`: usage and every key (each listed once)."""
    return f"{USAGE}\n\n{generate.__doc__.strip()}\n\nkeys ({KEYS_DOC} has the same list):\n{keys_help(GenerateConfig)}"


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        return exit_codes.OK
    cfg = parse_args(argv)
    if cfg.engine.attention_impl in ("auto", "cpu_kernel") and cfg.dtype == "float32":
        if backend_is_cpu_only():  # the compiler runs while JAX, the tokenizer and weights load
            start_kernel_build()
    return run_generate(cfg, explicit_engine_keys(argv))
