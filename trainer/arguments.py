"""Command-line flags of the trainer, generated from the config's named settings.

`python -m trainer`, `rtp train-local`, `rtp local` and `rtp render-job` all take their
training flags from here, so a flag's name, type, choices and help come from the field
that declares it in trainer/config_sections.py (its `named(...)` parameter, Literal type and
docstring) and nowhere else. `config_from_args` is the matching reader: it resolves the
flags through `resolve_config`, the one function every entry point uses.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from trainer.config import (
    DEFAULT_PRESET,
    PRESETS,
    ConfigError,
    TrainConfig,
    named_settings,
    normalize_faults,
    parse_overrides,
    resolve_config,
)

PIPELINE_SETTINGS = tuple(param for param, setting in named_settings().items() if setting.pipeline)
"""The named settings a pipeline run exposes as parameters (besides preset and overrides),
declared `named(..., pipeline=True)` in trainer/config_sections.py."""


def add_named_arguments(
    parser: argparse.ArgumentParser, params: Iterable[str], *, show_defaults: bool = True
) -> None:
    """A flag for each named setting in `params`; an unset flag is None (the config decides)."""
    settings = named_settings()
    for param in params:
        setting = settings[param]
        shown = setting.default if setting.default != "" else "none"
        default = f" (default: {shown})" if show_defaults and (shown != "none" or not setting.path) else ""
        helptext = f"{setting.help} [config {setting.key}]{default}".replace("%", "%%")
        if param == "faults":
            parser.add_argument(
                setting.flag,
                dest="faults",
                action="append",
                metavar="KIND@STEP[:RANK]",
                help=helptext + "; repeatable",
            )
            continue
        parser.add_argument(
            setting.flag,
            dest=param,
            type=setting.scalar_type,
            choices=setting.choices,
            help=helptext,
        )


def add_preset_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        default=DEFAULT_PRESET,
        choices=sorted(PRESETS),
        help="model/optimizer preset (default: %(default)s)",
    )


def named_from_args(args: argparse.Namespace, params: Iterable[str]) -> dict[str, Any]:
    """The named settings a parsed command line gave (None where a flag was not given)."""
    values = {param: getattr(args, param, None) for param in params}
    faults = values.get("faults")
    if faults is not None:
        values["faults"] = normalize_faults(faults)
    return values


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The trainer's flags: a config file, or a preset with named settings and overrides."""
    parser.add_argument(
        "--config",
        metavar="PATH|JSON",
        help="a training config written by `rtp` (<run>/train/config.json), or that JSON itself; "
        "it carries every setting, so it is not combined with the other training flags",
    )
    add_preset_argument(parser)
    add_named_arguments(parser, named_settings())
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other config field, e.g. optimizer.lr=1e-3 or model.n_layers=4; repeatable "
        "(fields with their own flag are refused here)",
    )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The config the trainer flags describe (`add_training_arguments`), checked."""
    named = named_from_args(args, named_settings())
    if args.config:
        given = [named_settings()[p].flag for p, value in named.items() if value is not None]
        if given or args.override or args.preset != DEFAULT_PRESET:
            raise ConfigError(
                f"--config carries the whole training config; drop {', '.join(given) or '--override/--preset'} "
                "or drop --config"
            )
        if args.config.lstrip().startswith("{"):  # inline, as a job's pods get it
            return TrainConfig.from_json(args.config)
        return TrainConfig.read(args.config)
    if not args.dataset_dir:
        raise ConfigError("--dataset-dir is required (a staged dataset snapshot), or pass --config")
    return resolve_config(preset=args.preset, named=named, overrides=list(args.override))


def config_from_pipeline(
    *,
    preset: str,
    overrides: str,
    dataset_dir: str,
    workdir: str,
    checkpoint_dir: str,
    model_dir: str = "",
    **named: Any,
) -> TrainConfig:
    """The config a pipeline run's parameters describe (`PIPELINE_SETTINGS` as `named`);
    `model_dir` is the staged model folder (empty: the built-in byte-level model)."""
    unknown = set(named) - set(PIPELINE_SETTINGS)
    if unknown:
        raise ConfigError(f"not pipeline training settings: {', '.join(sorted(unknown))}")
    return resolve_config(
        preset=preset,
        named={
            **named,
            "dataset_dir": dataset_dir,
            "workdir": workdir,
            "checkpoint_dir": checkpoint_dir,
            "model_dir": model_dir,
        },
        overrides=parse_overrides(overrides),
    )
