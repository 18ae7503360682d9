"""posttrain/registry.py: every trainer is one entry, and everything built from the registry has every entry."""

import dataclasses
import os

import pytest

import posttrain
from posttrain import registry
from posttrain.cli import RUNS, TRAINERS, build_parser
from posttrain.cli_help import COMMON, field_classes
from posttrain.configs import field_types
from posttrain.configs.reference import GROUPS, config_reference
from posttrain.configs.reference import TRAINERS as REFERENCE
from posttrain.configs.trl_compat import SNAPSHOTS, Compat


@pytest.mark.parametrize("entry", registry.TRAINERS, ids=lambda e: e.name)
def test_each_entry_names_a_trainer_its_config_its_trl_table_and_its_docs(entry):
    trainer, config = registry.load(entry.trainer), registry.load(entry.config)
    assert getattr(posttrain, entry.trainer_name) is trainer and getattr(posttrain, entry.config_name) is config
    assert entry.trainer_name in posttrain.__all__ and entry.config_name in posttrain.__all__
    assert dataclasses.is_dataclass(config) and isinstance(trainer, type)
    assert all(isinstance(c, Compat) for c in registry.load(entry.compat)) and os.path.exists(SNAPSHOTS[entry.name])
    assert REFERENCE[entry.name][0] is config
    for title, path in entry.groups:  # the reference's sections: the config's own groups
        assert issubclass(config, registry.load(path)) and (title, registry.load(path)) in GROUPS
    assert f"TRL 1.16.0's {entry.config_name}" in config_reference()
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "config.md")) as f:
        assert f"## Every field of TRL 1.16.0's {entry.config_name}" in f.read()


@pytest.mark.parametrize("entry", [e for e in registry.TRAINERS if e.command], ids=lambda e: e.name)
def test_each_command_is_a_subcommand_with_its_help_page_and_its_run(entry):
    script_cls, config_cls, line = TRAINERS[entry.name]
    assert config_cls is registry.load(entry.config) and line == entry.command
    assert entry.name in build_parser().format_help() and callable(registry.load(entry.run)) and entry.name in RUNS
    flags = {name for cls in field_classes(script_cls, config_cls) for name in field_types(cls)}
    assert COMMON[entry.name] == entry.common and set(entry.common) <= flags


def test_the_commands_are_the_registrys_and_no_more():
    assert set(TRAINERS) == set(RUNS) == set(COMMON) == {e.name for e in registry.TRAINERS if e.command}
    assert set(REFERENCE) == set(registry.BY_NAME)
